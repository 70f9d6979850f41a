"""Performance hazards reported next to a plan (warnings, not errors).

- Pipelines deeper than 8 stages: p2p latency and the (p-1) fill/drain grow with p,
  and Megatron's own recipes stay at PP <= 8 for dense models.
- Bubble outside ``search.bubble_warning_range`` when one is set (none by default), with
  pipelining only.
- Tensor parallelism across nodes: TP all-reduces every layer, so it needs NVLink.
- Long context (>= 128k tokens) with a deep pipeline: each in-flight microbatch holds
  s-proportional activations on the first stage, which context parallelism shards
  and pipelining does not.
- Few microbatches per pipeline (at most 4 x PP) with a bubble above the goal below: the fill and drain take a large share of the
  step, and a larger global batch is the fix; the warning names the global batch whose microbatches
  bring the flushed bubble ((p - 1) / (v m + p - 1), Narayanan et al. 2021 eq. 2 with v chunks) under
  ``search.bubble_target``'s upper end, else 10%.
- MoE token dispatch whose transient buffers (:func:`megapipe.cost.memory.dispatcher_transient_bytes`)
  exceed the memory left free by ``gpu.usable_memory_fraction``: the plan's memory check does
  not hold them, so the run may go out of memory inside a MoE layer.
- Offloading (optimizer state to the host, the hybrid CPU optimizer, fine-grained activation offloading): the
  memory model moves the state or activations off the GPU, the step time does not charge the copies (assumed
  hidden under compute, as arXiv 2603.07685 Sec. 4.1.5-4.1.6 measures them: 1.6-2% and 0.1-0.2 s per step) nor
  the hybrid optimizer's host Adam.
"""

from __future__ import annotations

import math

from megapipe.records import ClusterSpec, ParallelSpec, TrainSpec
from megapipe.units import GIB

__all__ = ["MAX_PIPELINE_DEPTH", "LONG_CONTEXT", "FEW_MICROBATCHES_PER_STAGE", "plan_warnings"]

MAX_PIPELINE_DEPTH = 8
LONG_CONTEXT = 131072
_DEEP_FOR_LONG_CONTEXT = 4
FEW_MICROBATCHES_PER_STAGE = 4
"""At most this many microbatches per pipeline stage, with a bubble above the goal, is warned about."""
_BUBBLE_GOAL = 0.10
"""The bubble the few-microbatches warning's suggested batch reaches when no search.bubble_target is set."""


def _offload_warnings(parallel: ParallelSpec, train: TrainSpec) -> list[str]:
    """What offloading moves off the GPU that the step time does not charge."""
    out = []
    if train.optimizer_cpu_offload:
        out.append(f"optimizer_cpu_offload: {train.optimizer_offload_fraction:.0%} of the optimizer step runs on the "
                   "host, which the step time does not charge")
    if train.offload_optimizer_states or parallel.features.fine_grained_activation_offloading:
        out.append("offloading: the host copies are assumed hidden under compute (the step time does not charge them)")
    return out


def plan_warnings(
    *,
    parallel: ParallelSpec,
    train: TrainSpec,
    cluster: ClusterSpec,
    bubble_fraction: float,
    num_microbatches: int,
    bubble_warning_range: tuple[float, float] | None = None,
    memory_over_gib: float = 0.0,
    dispatcher_bytes: float = 0.0,
    bubble_goal: float | None = None,
) -> tuple[str, ...]:
    """One short sentence per hazard, in a fixed order."""
    pp = parallel.pipeline_model_parallel_size
    tp = parallel.tensor_model_parallel_size
    out: list[str] = []
    if memory_over_gib > 0:
        out.append(f"does not fit: the fullest rank needs {memory_over_gib:.1f} GiB more than usable memory")
    reserve = min(group.gpu.memory_gib * GIB - group.gpu.usable_memory_bytes for group in cluster.node_groups)
    if dispatcher_bytes > reserve:
        out.append(f"MoE token dispatch holds {dispatcher_bytes / GIB:.1f} GiB of transient buffers per layer, more than "
                   f"the {reserve / GIB:.1f} GiB that gpu.usable_memory_fraction leaves free; lower "
                   "train.micro_batch_size or gpu.usable_memory_fraction")
    out += _offload_warnings(parallel, train)
    if pp > MAX_PIPELINE_DEPTH:
        out.append(f"pipeline_model_parallel_size={pp} > {MAX_PIPELINE_DEPTH}: deep pipeline, p2p latency dominates")
    if bubble_warning_range is not None and pp > 1:
        low, high = bubble_warning_range
        if not low <= bubble_fraction <= high:
            out.append(f"bubble {bubble_fraction:.1%} outside search.bubble_warning_range [{low:.0%}, {high:.0%}]")
    if tp > cluster.domain_gpus:
        out.append(f"tensor_model_parallel_size={tp} spans NVLink domains ({cluster.domain_gpus} GPUs each)")
    if train.seq_length >= LONG_CONTEXT and pp > _DEEP_FOR_LONG_CONTEXT:
        out.append(
            f"seq_length={train.seq_length} with pipeline_model_parallel_size={pp}: "
            "prefer context_parallel_size over a deep pipeline"
        )
    if pp > 1 and num_microbatches < pp:
        out.append(f"num_microbatches={num_microbatches} < pipeline_model_parallel_size={pp}: pipeline never fills")
    elif (pp > 1 and num_microbatches <= FEW_MICROBATCHES_PER_STAGE * pp
          and bubble_fraction > (bubble_goal or _BUBBLE_GOAL)):
        out.append(_few_microbatches(parallel, train, num_microbatches, bubble_fraction, bubble_goal or _BUBBLE_GOAL))
    return tuple(out)


def _few_microbatches(parallel: ParallelSpec, train: TrainSpec, num_microbatches: int, bubble_fraction: float,
                      goal: float) -> str:
    """The warning for a short pipeline: the bubble now, and the global batch that brings it under ``goal``."""
    pp, vp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
    needed = (pp - 1) * (1 - goal) / (vp * goal)  # (p - 1) / (v m + p - 1) <= goal
    smallest = max(math.ceil(needed - 1e-9), num_microbatches + 1)
    microbatches = -(-smallest // pp) * pp  # a multiple of PP, as interleaving needs
    batch = microbatches * train.micro_batch_size * parallel.data_parallel_size
    return (f"only {num_microbatches} microbatches per pipeline of {pp} stages: the pipeline bubble is "
            f"{bubble_fraction:.0%} of the pipeline's time; train.global_batch_size={batch} ({microbatches} "
            f"microbatches) brings it under {goal:.0%}")
