"""What several commands share: the profile a setup is costed with, its stage specs and p2p cost, console output.

No command imports another; they all import this.
"""

from __future__ import annotations

import json
import sys
import warnings

from megapipe import cost
from megapipe.config import Setup
from megapipe.io import load_profile
from megapipe.placement import default_gpus, modelled_stage_specs
from megapipe.profile.match import match_profile
from megapipe.records import GpuSpec, Partition, Profile, StageSpec
from megapipe.simulate import P2PCost, StageTimes
from megapipe.simulate import inputs as simulate_inputs

__all__ = ["matched_profile", "setup_profile", "setup_stage_specs", "stage_times", "pipeline_p2p", "print_json",
           "console", "warn"]

_PIPED_WIDTH = 160
"""Columns when stdout is not a terminal: rich would fold tables into 80."""


def warn(message: str) -> None:
    """One warning line on stderr."""
    print(f"warning: {message}", file=sys.stderr)


def matched_profile(setup: Setup) -> Profile:
    """The ``profile=FILE`` profile, checked against the model's shape and scaled for the cluster's GPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = match_profile(load_profile(setup.profile_path), model=setup.model, gpu=setup.cluster.gpu)
    for warning in caught:
        warn(str(warning.message))
    return profile


def setup_profile(setup: Setup) -> Profile:
    """The measured profile given with ``profile=FILE`` (checked against the model), else the cost model's."""
    if setup.profile_path:
        return matched_profile(setup)
    return cost.layer_costs(model=setup.model, gpu=setup.cluster.gpu, cluster=setup.cluster,
                            parallel=setup.parallel, train=setup.train)


def setup_stage_specs(setup: Setup, *, pipeline_model_parallel_size: int | None = None,
                      gpus: tuple[GpuSpec, ...] | None = None) -> tuple[StageSpec, ...]:
    """StageSpecs for the setup's cluster (placed by :func:`megapipe.placement.default_gpus` unless ``gpus``),
    each GPU type's time scale the ratio of its modelled layer times to the reference GPU's, as in the planner."""
    pp = pipeline_model_parallel_size or setup.parallel.pipeline_model_parallel_size
    placed = gpus or default_gpus(setup.cluster, pp)

    def layers_of(gpu: GpuSpec):
        return cost.layer_costs(model=setup.model, gpu=gpu, cluster=setup.cluster, parallel=setup.parallel,
                                train=setup.train).layers

    return modelled_stage_specs(placed, reference=setup.cluster.gpu, layers_of=layers_of,
                                microbatch_overhead_ms=setup.cluster.runtime.microbatch_overhead_ms)


def stage_times(profile: Profile, part: Partition, specs: tuple[StageSpec, ...], stage_to_rank) -> StageTimes:
    """Per layout stage F, B, W (scaled by the rank's time_scale) and activation bytes."""
    return simulate_inputs.stage_times(layers=profile.layers, entries_per_stage=part.entries_per_stage,
                                       stage_to_rank=stage_to_rank, specs=specs)


def pipeline_p2p(setup: Setup) -> P2PCost:
    """The configured model's message between pipeline neighbours on the configured cluster."""
    return simulate_inputs.p2p_cost(model=setup.model, cluster=setup.cluster, parallel=setup.parallel,
                                    train=setup.train)


def print_json(document: dict) -> None:
    """The one JSON object of ``output.format=json`` on stdout."""
    print(json.dumps(document, sort_keys=False))


def console(*, width: int | None = None, soft_wrap: bool = False):
    """A rich console on stdout; piped, it keeps ``width`` (or 160) columns instead of folding into 80."""
    from rich.console import Console

    out = Console(soft_wrap=soft_wrap)
    if not out.is_terminal:
        out = Console(soft_wrap=soft_wrap, width=max(out.width, width or _PIPED_WIDTH))
    elif width:
        out = Console(soft_wrap=soft_wrap, width=max(out.width, width))
    return out
