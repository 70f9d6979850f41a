"""Megatron's ``pipeline_model_parallel_layout`` DSL: format and parse.

Grammar (megatron-core ``PipelineParallelLayerLayout``): ``|`` separates stages,
``E`` is the embedding, ``t`` a decoder layer, ``m`` an MTP layer and ``L`` the
loss; ``x*N`` repeats a letter. Stages are listed vp-major
(stage index = vp * pipeline_model_parallel_size + pp_rank).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from megapipe.errors import ConfigError, ProfileError
from megapipe.records import LayerKind

__all__ = ["LETTER", "format_layout", "parse_layout", "stage_entries", "mtp_problem", "mtp_standalone", "max_stages"]

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


_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
"""A parenthesised group repeated N times, as megatron-core unrolls it first (``PipelineParallelLayerLayout.
parse_str_to_list``: ``(tt|)*2`` -> ``tt|tt|``)."""


def parse_layout(layout: str) -> tuple[tuple[LayerKind, ...], ...]:
    """Inverse of :func:`format_layout`; also reads megatron-core's repeated groups (``Et|(tt|)*30L``)."""
    stages = []
    flat = _GROUP.sub(lambda match: match.group(1) * int(match.group(2)), layout.replace(",", ""))
    for text in flat.split("|"):
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


def max_stages(num_layers: int) -> int:
    """The most layout stages (PP x VP chunks) ``num_layers`` decoders fill: one decoder per stage, and the
    embedding and the loss each in a chunk of its own at the ends (``E|t|...|t|L``: what Megatron's
    ``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split`` build, e.g.
    126 layers on PP16 x VP8). Every chunk holds a module, so none deadlocks (Megatron-LM #1852)."""
    return num_layers + 2


def _mtp_stages(stage_kinds: Sequence[Sequence[LayerKind]]) -> list[int]:
    return [index for index, kinds in enumerate(stage_kinds) if LayerKind.mtp in kinds]


def mtp_problem(stage_kinds: Sequence[Sequence[LayerKind]], *, pipeline_model_parallel_size: int) -> str | None:
    """Why megatron-core would not take this placement of the MTP layers, or None.

    megatron-core's ``PipelineParallelLayerLayout.validate_layer_layout`` (core_v0.16.1 and main): every
    ``m`` after the last ``t``; on each pipeline rank ``m`` only in the rank's last virtual chunk, and
    that chunk holds all of them. Its intent, per its error message, is also no MTP on the first pipeline
    rank (the code checks only the rank's other chunks); megapipe holds to the stricter rule.
    """
    stages = _mtp_stages(stage_kinds)
    if not stages:
        return None
    pp = pipeline_model_parallel_size
    flat = [kind for kinds in stage_kinds for kind in kinds]
    if LayerKind.decoder in flat[flat.index(LayerKind.mtp):]:
        return "a decoder layer t follows an MTP layer m; every m goes after the last t"
    if len(stages) > 1:
        return f"MTP layers are split over stages {stages}; megatron-core needs them all in one virtual stage"
    stage = stages[0]
    num_chunks = len(stage_kinds) // pp
    if stage // pp != num_chunks - 1:
        return (f"the MTP layers sit in stage {stage}, virtual chunk {stage // pp} of pipeline rank {stage % pp}; "
                f"megatron-core allows them only in a rank's last chunk ({num_chunks - 1})")
    if pp > 1 and stage % pp == 0:
        return f"the MTP layers sit on the first pipeline rank (stage {stage}); put them on a later rank"
    return None


def mtp_standalone(stage_kinds: Sequence[Sequence[LayerKind]], *, pipeline_model_parallel_size: int) -> bool:
    """megatron-core's ``mtp_standalone``: the MTP layers sit on a rank other than the last (it derives this
    from the layout and builds them there without the loss)."""
    stages = _mtp_stages(stage_kinds)
    return bool(stages) and stages[0] % pipeline_model_parallel_size != pipeline_model_parallel_size - 1


def stage_entries(profile, layout: str) -> tuple[int, ...]:
    """A profile's entries (``profile.layers``, a :class:`~megapipe.records.Profile`) per stage of ``layout``;
    raises ProfileError when the layout is not this profile's model."""
    stages = parse_layout(layout)
    kinds = [kind for stage in stages for kind in stage]
    if kinds != [layer.kind for layer in profile.layers]:
        spelled = "".join(LETTER[layer.kind] for layer in profile.layers)
        raise ProfileError(
            f"the run's layout {layout!r} ({len(kinds)} units) does not match the profile's units "
            f"({spelled[:40]}{'...' if len(spelled) > 40 else ''}, {len(spelled)}); pass the profile the run was "
            "planned with (profile=FILE)"
        )
    return tuple(len(stage) for stage in stages)
