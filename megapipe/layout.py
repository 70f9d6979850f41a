"""Megatron's ``pipeline_model_parallel_layout`` DSL: format and parse.

Grammar (megatron-core ``PipelineParallelLayerLayout``): ``|`` separates stages,
``E`` is the embedding, ``t`` a decoder layer, ``m`` an MTP layer and ``L`` the
loss; ``x*N`` repeats a letter. Stages are listed vp-major
(stage index = vp * pipeline_model_parallel_size + pp_rank).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from megapipe.errors import ConfigError
from megapipe.records import LayerKind

__all__ = ["LETTER", "format_layout", "parse_layout"]

LETTER = {LayerKind.embedding: "E", LayerKind.decoder: "t", LayerKind.mtp: "m", LayerKind.loss: "L"}
_KIND = {v: k for k, v in LETTER.items()}


def _format_stage(kinds: Iterable[LayerKind]) -> str:
    out: list[str] = []
    run_letter, run_len = "", 0
    for kind in kinds:
        letter = LETTER[LayerKind(kind)]
        if letter == run_letter:
            run_len += 1
            continue
        if run_len:
            out.append(run_letter if run_len == 1 else f"{run_letter}*{run_len}")
        run_letter, run_len = letter, 1
    if run_len:
        out.append(run_letter if run_len == 1 else f"{run_letter}*{run_len}")
    return "".join(out)


def format_layout(stage_kinds: Sequence[Sequence[LayerKind]]) -> str:
    """``[[E,t,t],[t,t,L]] -> "Et*2|t*2L"``; runs of one letter are written ``x*N``."""
    return "|".join(_format_stage(kinds) for kinds in stage_kinds)


_TOKEN = re.compile(r"([EtmL])(?:\*(\d+))?")


def parse_layout(layout: str) -> tuple[tuple[LayerKind, ...], ...]:
    """Inverse of :func:`format_layout` for the flat form megapipe writes (no parentheses)."""
    stages = []
    for text in layout.replace(",", "").split("|"):
        kinds: list[LayerKind] = []
        pos = 0
        for match in _TOKEN.finditer(text):
            if match.start() != pos:
                raise ConfigError(f"cannot parse layout stage {text!r} in {layout!r}; use letters E, t, m, L and x*N")
            kinds.extend([_KIND[match.group(1)]] * int(match.group(2) or 1))
            pos = match.end()
        if pos != len(text):
            raise ConfigError(f"cannot parse layout stage {text!r} in {layout!r}; use letters E, t, m, L and x*N")
        stages.append(tuple(kinds))
    return tuple(stages)
