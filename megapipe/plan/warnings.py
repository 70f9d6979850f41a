"""Performance hazards reported next to a plan (warnings, not errors).

- Pipelines deeper than 8 stages: p2p latency and the (p-1) fill/drain grow with p,
  and Megatron's own recipes stay at PP <= 8 for dense models.
- Bubble outside ``search.bubble_warning_range`` when one is set (none by default), with
  pipelining only.
- Tensor parallelism across nodes: TP all-reduces every layer, so it needs NVLink.
- Long context (>= 128k tokens) with a deep pipeline: each in-flight microbatch holds
  s-proportional activations on the first stage, which context parallelism shards
  and pipelining does not.
- MoE token dispatch whose transient buffers (:func:`megapipe.cost.memory.dispatcher_transient_bytes`)
  exceed the memory left free by ``gpu.usable_memory_fraction``: the plan's memory check does
  not hold them, so the run may go out of memory inside a MoE layer.
"""

from __future__ import annotations

from megapipe.records import ClusterSpec, ParallelSpec, TrainSpec
from megapipe.units import GIB

__all__ = ["MAX_PIPELINE_DEPTH", "LONG_CONTEXT", "plan_warnings"]

MAX_PIPELINE_DEPTH = 8
LONG_CONTEXT = 131072
_DEEP_FOR_LONG_CONTEXT = 4


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
    return tuple(out)
