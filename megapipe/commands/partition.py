"""``megapipe partition``: which layers go on which pipeline stage.

Solves the exact min-max partition for the configured model and cluster (or a
``profile=FILE``), prints one row per stage with its layers, time, static and
activation GiB and headroom, the Megatron layout string and arguments, and the
equal split beside it with the predicted step-time gain (both simulated with
the configured schedule). ``output.format=json`` prints one JSON object instead.
"""

from __future__ import annotations

import json
import sys
import warnings

from omegaconf import DictConfig

from megapipe import cost
from megapipe.config import Setup, to_setup
from megapipe.emit import emit
from megapipe.partition import solve
from megapipe.profile.format import Profile
from megapipe.profile.match import match_profile
from megapipe.records import LayerKind, Partition, StageSpec
from megapipe.schedules import build
from megapipe.simulate import P2PCost, SimResult, StageTimes, simulate
from megapipe.simulate import inputs as simulate_inputs
from megapipe.stages import stage_specs

__all__ = ["run", "matched_profile", "setup_profile", "setup_stage_specs", "stage_times", "pipeline_p2p"]

GIB = 2**30


def matched_profile(setup: Setup) -> Profile:
    """The ``profile=FILE`` profile, checked against the model's shape and scaled for the cluster's GPU."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = match_profile(Profile.load(setup.profile_path), model=setup.model, gpu=setup.cluster.gpu)
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    return profile


def setup_profile(setup: Setup) -> Profile:
    """The measured profile given with ``profile=FILE`` (checked against the model), else the cost model's."""
    if setup.profile_path:
        return matched_profile(setup)
    return cost.layer_costs(model=setup.model, gpu=setup.cluster.gpu, cluster=setup.cluster,
                            parallel=setup.parallel, train=setup.train)


def setup_stage_specs(setup: Setup, profile: Profile, *, pipeline_model_parallel_size: int | None = None):
    """StageSpecs for the setup's cluster. On a mixed cluster costed by the cost model, each GPU type's
    time_scale is the ratio of its modelled layer times to the reference GPU's, as in the planner."""
    pp = pipeline_model_parallel_size or setup.parallel.pipeline_model_parallel_size
    scales = None
    if setup.cluster.is_heterogeneous and not setup.profile_path:
        reference_ms = _total_ms(profile)
        scales = {group.gpu.name: _total_ms(cost.layer_costs(model=setup.model, gpu=group.gpu, cluster=setup.cluster,
                                                             parallel=setup.parallel, train=setup.train)) / reference_ms
                  for group in setup.cluster.node_groups}
    return stage_specs(setup.cluster, pipeline_model_parallel_size=pp, time_scales=scales)


def _total_ms(profile: Profile) -> float:
    return sum(layer.fwd_ms + layer.bwd_ms for layer in profile.layers)


def stage_times(profile: Profile, part: Partition, specs: tuple[StageSpec, ...], stage_to_rank) -> StageTimes:
    """Per layout stage F, B, W (scaled by the rank's time_scale) and activation bytes."""
    return simulate_inputs.stage_times(layers=profile.layers, layers_per_stage=part.layers_per_stage,
                                       stage_to_rank=stage_to_rank, specs=specs)


def pipeline_p2p(setup: Setup) -> P2PCost:
    """The configured model's message between pipeline neighbours on the configured cluster."""
    return simulate_inputs.p2p_cost(model=setup.model, cluster=setup.cluster, parallel=setup.parallel,
                                    train=setup.train)


def _solve_and_simulate(setup: Setup, profile: Profile, specs, *, method: str) -> tuple[Partition, SimResult]:
    par = setup.parallel
    schedule = build(setup.schedule, pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                     num_microbatches=setup.num_microbatches,
                     virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                     microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
    part = solve(profile, list(specs), num_microbatches=setup.num_microbatches, schedule=setup.schedule,
                 virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size, method=method,
                 check_memory=method == "optimal",
                 microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
    sim = simulate(schedule, stage_times(profile, part, specs, schedule.stage_to_rank), p2p=pipeline_p2p(setup))
    return part, sim


def _decoders(part: Partition) -> list[int]:
    return [sum(1 for kind in kinds if kind == LayerKind.decoder) for kinds in part.stage_kinds]


def result_dict(setup: Setup, optimal: Partition, optimal_sim: SimResult, equal: Partition,
                equal_sim: SimResult) -> dict:
    emitted = emit(partition=optimal, parallel=setup.parallel, train=setup.train)
    return {
        "model": setup.model.name,
        "cluster": setup.cluster.name,
        "schedule": setup.schedule,
        "num_microbatches": setup.num_microbatches,
        "layers_per_stage": list(optimal.layers_per_stage),
        "decoder_layers_per_stage": _decoders(optimal),
        "stage_time_ms": [round(t, 6) for t in optimal.stage_time_ms],
        "stage_memory_bytes": [float(round(b)) for b in optimal.stage_memory_bytes],
        "bottleneck_ms": round(optimal.bottleneck_ms, 6),
        "step_time_ms": round(optimal_sim.step_time_ms, 6),
        "bubble_fraction": round(optimal_sim.bubble_fraction, 6),
        "layout": emitted.layout,
        "megatron_args": emitted.megatron_command,
        "bridge_overrides": list(emitted.bridge_overrides),
        "nemo2_overrides": list(emitted.nemo2_overrides),
        "nemo1_overrides": list(emitted.nemo1_overrides),
        "warnings": list(emitted.warnings),
        "equal": {
            "layers_per_stage": list(equal.layers_per_stage),
            "layout": equal.layout,
            "bottleneck_ms": round(equal.bottleneck_ms, 6),
            "step_time_ms": round(equal_sim.step_time_ms, 6),
            "stage_memory_bytes": [float(round(b)) for b in equal.stage_memory_bytes],
            "fits_memory": bool(getattr(equal, "fits_memory", True)),
        },
        "predicted_gain": round(equal_sim.step_time_ms / optimal_sim.step_time_ms - 1.0, 6),
    }


def _print_table(setup: Setup, specs, optimal: Partition, result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(soft_wrap=True)
    par = setup.parallel
    table = Table(title=f"{setup.model.name} on {setup.cluster.name}: TP={par.tensor_model_parallel_size} "
                        f"PP={par.pipeline_model_parallel_size} VP={par.virtual_pipeline_model_parallel_size} "
                        f"DP={par.data_parallel_size}, {setup.schedule}, {setup.num_microbatches} microbatches")
    for column in ("stage", "rank", "layers", "time ms", "static GiB", "act GiB", "total GiB", "headroom GiB"):
        table.add_column(column, justify="right")
    pp = par.pipeline_model_parallel_size
    ranks = optimal.stage_to_rank or tuple(stage % pp for stage in range(len(optimal.stage_kinds)))
    for stage, kinds in enumerate(optimal.stage_kinds):
        rank = ranks[stage]
        act = optimal.stage_in_flight[stage] * optimal.stage_act_bytes[stage]
        cap = specs[rank].memory_bytes
        table.add_row(str(stage), str(rank), _describe_stage(kinds), f"{optimal.stage_time_ms[stage]:.2f}",
                      f"{optimal.stage_static_bytes[stage] / GIB:.2f}", f"{act / GIB:.2f}",
                      f"{optimal.stage_memory_bytes[stage] / GIB:.2f}",
                      f"{(cap - optimal.stage_memory_bytes[stage]) / GIB:.2f}")
    console.print(table)
    equal = result["equal"]
    console.print(f"layout:        {result['layout']}")
    console.print(f"Megatron-LM:   {result['megatron_args']}", soft_wrap=True)
    console.print(f"optimal:       bottleneck {result['bottleneck_ms']:.2f} ms, step {result['step_time_ms']:.1f} ms, "
                  f"bubble {result['bubble_fraction']:.1%}")
    console.print(f"equal split:   {equal['layout']}  bottleneck {equal['bottleneck_ms']:.2f} ms, "
                  f"step {equal['step_time_ms']:.1f} ms{'' if equal['fits_memory'] else ' (does not fit memory)'}")
    console.print(f"predicted gain over the equal split: {result['predicted_gain']:+.1%}")
    for warning in result["warnings"]:
        console.print(f"warning: {warning}")


def _describe_stage(kinds) -> str:
    decoders = sum(1 for kind in kinds if kind == LayerKind.decoder)
    extra = "".join(label for kind, label in ((LayerKind.embedding, "E+"),) if kind in kinds)
    tail = "".join(label for kind, label in ((LayerKind.mtp, "+mtp"), (LayerKind.loss, "+L")) if kind in kinds)
    return f"{extra}{decoders}{tail}"


def run(cfg: DictConfig) -> None:
    setup = to_setup(cfg)
    profile = setup_profile(setup)
    specs = setup_stage_specs(setup, profile)
    optimal, optimal_sim = _solve_and_simulate(setup, profile, specs, method="optimal")
    equal, equal_sim = _solve_and_simulate(setup, profile, specs, method="equal")
    result = result_dict(setup, optimal, optimal_sim, equal, equal_sim)
    if cfg.output.format == "json":
        print(json.dumps(result, sort_keys=False))
    else:
        _print_table(setup, specs, optimal, result)
