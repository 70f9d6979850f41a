"""Every option type in one home: how a command searches, reports, replans, packs and measures.

Frozen records, built from the config's ``search.*``, ``output.*`` and ``pack.*`` groups and ``extra.*`` once at
the boundary (:mod:`megapipe.config.options`, :mod:`megapipe.config.jobs`); commands and the core read these,
never the Hydra config. Pure: no imports beyond the errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.errors import ConfigError

__all__ = ["Reference", "SearchOptions", "OutputOptions", "ReplanOptions", "REPLAN_ATTRIBUTIONS", "PackOptions",
           "MeasureOptions", "MEASURE_DTYPES"]

REPLAN_ATTRIBUTIONS = ("stage", "kind")
"""stage: each stage's measured time split in proportion to the profile; kind: per-kind factors first."""
MEASURE_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True, slots=True, kw_only=True)
class Reference:
    """A published configuration to evaluate beside the best plan."""

    label: str
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    reported_tokens_per_s_per_gpu: float | None = None
    source: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """What to search and how to rank; built from the ``search.*`` config group."""

    objective: str = "throughput"
    """throughput (tokens/s/GPU, higher first) or cost ($ per 1M tokens, lower first)."""
    top_k: int = 5
    allow_cross_node_tp: bool = False
    bubble_target: tuple[float, float] | None = None
    """[low, high]: per layout, keep the micro-batch size whose bubble falls in this range."""
    bubble_warning_range: tuple[float, float] | None = None
    """Warn when a pipelined plan's bubble falls outside [low, high]; None warns never."""
    ignore_memory_limit: bool = False
    """Keep plans that do not fit, flagged infeasible with the GiB over."""
    max_pipeline_model_parallel_size: int | None = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes tried when train.micro_batch_size is null."""
    max_virtual_pipeline_model_parallel_size: int | None = None
    """Most model chunks per pipeline rank searched; None: every VP Megatron allows (one decoder layer per
    chunk, the embedding and the loss in chunks of their own)."""
    per_stage_recompute: bool = False
    """Also try, per layout with one chunk per rank, a recompute setting per pipeline rank (AdaPipe)."""
    what_if_schedules: bool = False
    """Also search the schedules megatron-core cannot run; by default only 1f1b and interleaved_1f1b (and any
    schedule the user pins) are searched."""
    context_parallel_min_seq_length: int = 8192
    """Context parallelism is searched only from this sequence length up: arXiv 2603.07685 (the Megatron Core MoE
    report), Guideline 5, 'when to use: sequence length >= 8K tokens'; NeMo's tuned Llama 3 8B and 70B run CP 2 at
    8,192."""
    context_parallel_min_local_seq_length: int = 4096
    """...and only sizes that leave each context-parallel rank this many tokens (the same guideline: 'for sequences
    < 4K tokens, CP overhead typically exceeds benefits')."""
    total_tokens: float = 2.0e12
    """Tokens of the whole training run, for the total cost."""
    reference: Reference | None = None
    """Shown beside the best plan when set (``search.reference``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputOptions:
    """Where and how a command reports; never part of what was planned."""

    json: bool = False
    """Print one JSON object instead of tables (``output.format=json``)."""
    dir: str | None = None
    """Where files go (``output.dir``); None means the run directory under outputs/."""
    pictures: bool = True
    """Draw PNG pictures after the answer is printed."""
    bridge_keys: str = "flat"
    """Megatron-Bridge key spelling: flat (0.6.x) or nested (main's model.transformer.*)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplanOptions:
    """``megapipe replan`` settings from the search group."""

    min_gain: float = 0.02
    """Smallest predicted gain (0.02 = 2%) for which a change is suggested."""
    attribution: str = "stage"
    """How measured stage times are attributed to layers (:data:`REPLAN_ATTRIBUTIONS`)."""
    drift_threshold: float = 0.1
    """Relative difference between measured and predicted figures the monitor warns at."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PackOptions:
    """How ``megapipe pack`` packs: objective, node counts, baselines, what-ifs (the ``pack`` settings; PackConfig is made from it)."""

    objective: str = "throughput"
    """throughput (weighted model FLOP/s), makespan (finish every token budget soonest) or deadlines."""
    node_counts: tuple[int, ...] | None = None
    """Node counts a job may get; None: the powers of two up to each group's size, and its size."""
    baseline_pipeline_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """The fixed-depth baseline packs every job at one of these pipeline sizes (the best one is shown)."""
    fail_group: str | None = None
    """What-if: the node group of this GPU type fails; the jobs are repacked with the fewest moves."""
    fail_nodes: int = 0
    """What-if: this many nodes of the largest group fail."""
    arrive: bool = False
    """What-if: the jobs marked arrives_later join; repacked with the fewest moves."""
    move_slack: float = 0.0
    """What-if: accept an objective this fraction below the optimum to move fewer jobs."""
    restart_minutes: float = 10.0
    """When a job finishes, the others are repacked onto the nodes; a job that changes nodes idles this long
    (checkpoint, restart, reload)."""

    @property
    def what_if(self) -> bool:
        """Whether a what-if is asked (a node group or nodes fail, or the arriving jobs join)."""
        return self.fail_group is not None or bool(self.fail_nodes) or self.arrive


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasureOptions:
    """How to measure; the model, batch shape and parallel sizes come from the records."""

    device: str = "auto"
    """cpu, cuda or auto (cuda when available)."""
    warmup: int = 2
    """Untimed iterations before timing each unit."""
    iters: int = 5
    """Timed iterations; the profile holds their median, the meta their p10/p90."""
    num_threads: int | None = None
    """torch.set_num_threads for the CPU path; None leaves torch's default."""
    dtype: str | None = None
    """bf16, fp16 or fp32 for weights and activations; None takes train.precision."""
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}; use cpu, cuda or auto")
        if self.warmup < 0 or self.iters < 1:
            raise ConfigError(f"warmup={self.warmup}, iters={self.iters}; use warmup >= 0 and iters >= 1")
        if self.dtype is not None and self.dtype not in MEASURE_DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; use one of {', '.join(MEASURE_DTYPES)}")
