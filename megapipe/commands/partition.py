"""``megapipe partition``: which layers go on which pipeline stage.

Solves the exact min-max partition for the configured model and cluster (or a
``profile=FILE``), prints one row per stage with its layers, time, static and
activation GiB and headroom, the Megatron layout string and arguments, and the
equal split beside it with the predicted step-time gain (both simulated with
the configured schedule). ``output.format=json`` prints one JSON object instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from megapipe.commands.common import console, pipeline_p2p, print_json, scenario_profile, stage_specs_of, stage_times
from megapipe.config import Scenario, to_scenario
from megapipe.config.options import output_options
from megapipe.emit import decoder_counts
from megapipe.options import OutputOptions
from megapipe.plandir import plan_emission
from megapipe.partition import solve
from megapipe.records import LayerKind, Partition, Profile
from megapipe.schedules import build
from megapipe.simulate import SimResult, simulate
from megapipe.units import GIB

__all__ = ["PartitionInputs", "prepare", "run", "result_dict", "CONFIG_KEYS", "FILES"]

CONFIG_KEYS = ("model", "cluster", "runtime", "parallel", "train", "schedule", "profile", "output.format",
               "output.bridge_keys")
"""What `megapipe partition --help` lists (:mod:`megapipe.config.keys`)."""
FILES = ()
"""It prints; it writes nothing."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionInputs:
    scenario: Scenario
    profile_path: str | None
    """``profile=FILE``: measured layer costs instead of the cost model's."""
    output: OutputOptions


def _solve_and_simulate(scenario: Scenario, profile: Profile, specs, *, method: str) -> tuple[Partition, SimResult]:
    par = scenario.parallel
    schedule = build(scenario.schedule, pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                     num_microbatches=scenario.num_microbatches,
                     virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
                     microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
    part = solve(profile, list(specs), num_microbatches=scenario.num_microbatches, schedule=scenario.schedule,
                 virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size, method=method,
                 check_memory=method == "optimal",
                 microbatch_group_size_per_vp_stage=par.microbatch_group_size_per_vp_stage)
    sim = simulate(schedule, stage_times(profile, part, specs, schedule.stage_to_rank), p2p=pipeline_p2p(scenario))
    return part, sim


def _decoders(part: Partition) -> list[int]:
    return list(decoder_counts(part.stage_kinds))


def result_dict(scenario: Scenario, optimal: Partition, optimal_sim: SimResult, equal: Partition,
                equal_sim: SimResult, specs, *, bridge_keys: str = "flat") -> dict:
    """The JSON form; a what-if schedule (one megatron-core does not run) gets no Megatron arguments."""
    emission = plan_emission(partition=optimal, parallel=scenario.parallel, train=scenario.train, model=scenario.model,
                             cluster=scenario.cluster, stage_gpus=[spec.gpu_name for spec in specs],
                             bridge_keys=bridge_keys)
    what_if, emitted = emission.what_if, emission.emitted
    return {
        "model": scenario.model.name,
        "cluster": scenario.cluster.name,
        "schedule": scenario.schedule,
        "num_microbatches": scenario.num_microbatches,
        "entries_per_stage": list(optimal.entries_per_stage),
        "decoder_layers_per_stage": _decoders(optimal),
        "stage_time_ms": [round(t, 6) for t in optimal.stage_time_ms],
        "stage_memory_bytes": [float(round(b)) for b in optimal.stage_memory_bytes],
        "rank_memory_bytes": [float(round(b)) for b in optimal.rank_memory_bytes],
        "bottleneck_ms": round(optimal.bottleneck_ms, 6),
        "step_time_ms": round(optimal_sim.step_time_ms, 6),
        "bubble_fraction": round(optimal_sim.bubble_fraction, 6),
        "layout": optimal.layout,
        "seq_length": scenario.train.seq_length,
        "seq_length_source": scenario.seq_length_source,
        "stage_gpus": [spec.gpu_name for spec in specs],
        "what_if": bool(what_if),
        "megatron_args": emitted.megatron_command if emitted else None,
        "megatron_env": dict(emitted.megatron_env) if emitted else None,
        "bridge_overrides": list(emitted.bridge_overrides) if emitted else None,
        "bridge_keys": emitted.bridge_keys.value if emitted else None,
        "nemo2_overrides": list(emitted.nemo2_overrides) if emitted else None,
        "nemo1_overrides": list(emitted.nemo1_overrides) if emitted else None,
        "warnings": list(what_if) + (list(emitted.warnings) if emitted else []),
        "equal": {
            "entries_per_stage": list(equal.entries_per_stage),
            "decoder_layers_per_stage": _decoders(equal),
            "layout": equal.layout,
            "bottleneck_ms": round(equal.bottleneck_ms, 6),
            "step_time_ms": round(equal_sim.step_time_ms, 6),
            "stage_memory_bytes": [float(round(b)) for b in equal.stage_memory_bytes],
            "fits_memory": bool(getattr(equal, "fits_memory", True)),
        },
        "predicted_gain": round(equal_sim.step_time_ms / optimal_sim.step_time_ms - 1.0, 6),
    }


def _print_table(scenario: Scenario, specs, optimal: Partition, result: dict) -> None:
    from rich.table import Table

    out = console(soft_wrap=True)
    par = scenario.parallel
    table = Table(title=f"{scenario.model.name} on {scenario.cluster.name}: TP={par.tensor_model_parallel_size} "
                        f"PP={par.pipeline_model_parallel_size} VP={par.virtual_pipeline_model_parallel_size} "
                        f"DP={par.data_parallel_size}, {scenario.schedule}, {scenario.num_microbatches} microbatches")
    for column in ("stage", "rank", "layers", "time ms", "static GiB", "act GiB", "total GiB", "headroom GiB"):
        table.add_column(column, justify="right")
    pp = par.pipeline_model_parallel_size
    ranks = optimal.stage_to_rank or tuple(stage % pp for stage in range(len(optimal.stage_kinds)))
    shared = len(ranks) > pp  # a rank's stages share its memory: headroom is the rank's, below
    for stage, kinds in enumerate(optimal.stage_kinds):
        rank = ranks[stage]
        act = optimal.stage_in_flight[stage] * optimal.stage_act_bytes[stage]
        cap = specs[rank].memory_bytes
        table.add_row(str(stage), str(rank), _describe_stage(kinds), f"{optimal.stage_time_ms[stage]:.2f}",
                      f"{optimal.stage_static_bytes[stage] / GIB:.2f}", f"{act / GIB:.2f}",
                      f"{optimal.stage_memory_bytes[stage] / GIB:.2f}",
                      "(rank)" if shared else f"{(cap - optimal.stage_memory_bytes[stage]) / GIB:.2f}")
    out.print(table)
    if shared:
        ranks_table = Table(title="per pipeline rank: its stages' activations summed at the moments they peak "
                                  "together (the stage rows above show each stage's own peak)")
        for column in ("rank", "stages", "peak GiB", "sum of stage peaks GiB", "headroom GiB"):
            ranks_table.add_column(column, justify="right")
        sums = optimal.rank_stage_peaks_bytes
        for rank, peak in enumerate(optimal.rank_memory_bytes):
            owned = ",".join(str(stage) for stage, owner in enumerate(ranks) if owner == rank)
            ranks_table.add_row(str(rank), owned, f"{peak / GIB:.2f}", f"{sums[rank] / GIB:.2f}",
                                f"{(specs[rank].memory_bytes - peak) / GIB:.2f}")
        out.print(ranks_table)
    equal = result["equal"]
    out.print(f"layout:        {result['layout']}  (seq_length {result['seq_length']:,} from "
              f"{result['seq_length_source']})", markup=False)
    if scenario.cluster.is_heterogeneous:
        out.print(f"stage GPUs:    {', '.join(result['stage_gpus'])} (node groups in the cluster file's order)",
                  markup=False)
    if result["megatron_args"] is not None:
        env = " ".join(f"{k}={v}" for k, v in result["megatron_env"].items())
        out.print(f"Megatron-LM:   {env + ' ' if env else ''}pretrain_gpt.py {result['megatron_args']}", soft_wrap=True,
                  markup=False)
    out.print(f"optimal:       bottleneck {result['bottleneck_ms']:.2f} ms, step {result['step_time_ms']:.1f} ms, "
                  f"bubble {result['bubble_fraction']:.1%}")
    out.print(f"equal split:   {equal['layout']}  bottleneck {equal['bottleneck_ms']:.2f} ms, "
                  f"step {equal['step_time_ms']:.1f} ms{'' if equal['fits_memory'] else ' (does not fit memory)'}")
    out.print(f"predicted gain over the equal split: {result['predicted_gain']:+.1%}")
    for warning in result["warnings"]:
        out.print(f"warning: {warning}")


def _describe_stage(kinds) -> str:
    decoders = sum(1 for kind in kinds if kind == LayerKind.decoder)
    extra = "".join(label for kind, label in ((LayerKind.embedding, "E+"),) if kind in kinds)
    tail = "".join(label for kind, label in ((LayerKind.mtp, "+mtp"), (LayerKind.loss, "+L")) if kind in kinds)
    return f"{extra}{decoders}{tail}"


def prepare(cfg: DictConfig) -> PartitionInputs:
    scenario = to_scenario(cfg)
    return PartitionInputs(scenario=scenario, profile_path=cfg.get("profile"), output=output_options(cfg))


def run(job: PartitionInputs, *, directory: str) -> None:
    scenario = job.scenario
    profile = scenario_profile(scenario, job.profile_path)
    specs = stage_specs_of(scenario)
    optimal, optimal_sim = _solve_and_simulate(scenario, profile, specs, method="optimal")
    equal, equal_sim = _solve_and_simulate(scenario, profile, specs, method="equal")
    result = result_dict(scenario, optimal, optimal_sim, equal, equal_sim, specs, bridge_keys=job.output.bridge_keys)
    if job.output.json:
        print_json(result)
    else:
        _print_table(scenario, specs, optimal, result)
