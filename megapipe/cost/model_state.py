"""Bytes one GPU holds per parameter while it runs forward and backward: weights, main gradients, master weights
and Adam moments, as megatron-core shards them over data parallelism and moves them to the host.

Megatron-LM ``docs/source/api-guide/dist_optimizer.md`` (d = data-parallel shards):

======================  ====================  =================
params / main grads     non-distributed       distributed
======================  ====================  =================
bf16 / fp32             18                    6 + 12 / d
fp16 / fp16             20                    4 + 16 / d
fp32 / fp32             16                    8 + 8 / d
======================  ====================  =================

The replicated part is the weights and the main-gradient buffer (megatron-core ``DistributedDataParallel``
sizes it ``torch.float if ddp_config.grad_reduce_in_fp32 else param.dtype``); the sharded part is the fp32
master weights and the two Adam moments (fp16 also keeps an fp32 copy of its gradient shard). fp32 training
has no master copy.

- **Precision-aware optimizer** (``--use-precision-aware-optimizer``; megatron-core ``optimizer/__init__.py``
  hands Transformer Engine's FusedAdam ``exp_avg_dtype``, ``exp_avg_sq_dtype`` and, when it holds the master
  weights, ``master_weight_dtype``): the moments take their dtype's bytes (fp8: 1). TE holds the master weights
  when ``OptimizerConfig.use_precision_aware_optimizer_no_fp8_or_ds_fp8`` (no FP8, delayed scaling, fp16 master
  weights or CPU offload); with bf16 parameters, fp32 master weights and ``store_param_remainders`` (on by
  default from TE 2.1) it keeps only the 16 bits the bf16 weight lacks, 2 bytes. Otherwise megatron-core keeps
  them itself (``shard_fp32_from_float16_groups``), 4 bytes. Megatron-LM takes fp32 or fp16 master weights; NeMo 1's
  ``distributed_fused_adam`` (apex ``DistributedFusedAdam``) keeps master weights and moments in its one ``dtype``,
  bf16 for Nemotron-4 340B, so ``main_params_dtype`` also takes bf16.
- **Optimizer-state offloading** (``--offload-optimizer-states``, megatron-core's ``OptimizerStateOffloader``,
  Megatron-LM's dev branch): master weights and moments go to the host after each step and come back during
  the next step's gradient finalisation (``training.py`` ``train_step``), so forward and backward run without
  them. The step's own peak, weights, gradients and the reloaded state with the activations freed, is below the
  forward-backward peak whenever the state is smaller than the activations (the runs that use it).
- **Hybrid CPU optimizer** (``--optimizer-cpu-offload``, megatron-core ``HybridDeviceOptimizer``):
  ``optimizer_offload_fraction`` of the parameters get their master weights and moments on the host.
- **Megatron FSDP** (``--use-megatron-fsdp``, ``megatron/core/distributed/fsdp``; its README's
  ``zero_dp_strategy``): ``optim`` shards what the distributed optimizer shards; ``optim_grads`` the main
  gradients too (ZeRO-2); ``optim_grads_params`` the weights as well (ZeRO-3). Routed experts shard over the
  expert data-parallel group (arXiv 2603.07685, Sec. 4.1.7). The layer being computed is all-gathered into
  transient buffers (about two layers' weights and gradients with prefetch), which the memory the usable
  fraction leaves free holds; with its default ``keep_fp8_transpose_cache=False`` Megatron FSDP frees the FP8
  weight copies after each layer (README: keeping them costs one byte per parameter), so none persist.
"""

from __future__ import annotations

from megapipe.records import ParallelSpec, TrainSpec

__all__ = ["OPTIMIZER_DTYPES", "SHARDING_STRATEGIES", "dtype_bytes", "optimizer_state_bytes", "shards", "state_problem",
           "weight_and_grad_bytes", "bytes_per_parameter", "fp8_copies_persist"]

OPTIMIZER_DTYPES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0}
"""Megatron's ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` / ``--main-params-dtype`` choices and their bytes."""
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron FSDP's ``--data-parallel-sharding-strategy`` values, least to most sharded."""


def dtype_bytes(name: str) -> float:
    """Bytes of one optimizer-state element of dtype ``name`` (a key of :data:`OPTIMIZER_DTYPES`)."""
    return OPTIMIZER_DTYPES[name]


def _te_holds_master(train: TrainSpec) -> bool:
    """megatron-core's ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` (``optimizer_config.py``)."""
    return (train.main_params_dtype != "fp32" or train.precision != "fp8" or train.fp8_recipe == "delayed"
            or train.optimizer_cpu_offload)


def _master_bytes(train: TrainSpec) -> float:
    if train.precision == "fp32":
        return 0.0
    if not train.use_precision_aware_optimizer or not _te_holds_master(train):
        return 4.0
    if train.main_params_dtype != "fp32":
        return dtype_bytes(train.main_params_dtype)
    return 2.0 if train.precision in ("bf16", "fp8") else 4.0  # FusedAdam's store_param_remainders on bf16 weights


def optimizer_state_bytes(train: TrainSpec) -> float:
    """Master weights and Adam moments per parameter before sharding (fp16 adds its fp32 gradient copy), as
    resident on the GPU during forward and backward: none with ``offload_optimizer_states``, the part
    ``optimizer_cpu_offload`` leaves on the GPU otherwise."""
    if train.offload_optimizer_states:
        return 0.0
    moments = (dtype_bytes(train.exp_avg_dtype) + dtype_bytes(train.exp_avg_sq_dtype)
               if train.use_precision_aware_optimizer else 8.0)
    state = _master_bytes(train) + moments + (4.0 if train.precision == "fp16" else 0.0)
    if train.optimizer_cpu_offload:
        state *= 1.0 - train.optimizer_offload_fraction
    return state


def weight_and_grad_bytes(train: TrainSpec) -> tuple[float, float]:
    """(weight, main gradient) bytes per parameter: the training dtype's weights (fp8 keeps bf16 ones; its FP8
    copies are :func:`megapipe.cost.precision.fp8_weight_copy_bytes`'), fp32 gradients but under fp16 and with
    ``grad_reduce_in_fp32=False`` (bf16 and fp8), where they take the parameters' 2 bytes."""
    weight = 4.0 if train.precision == "fp32" else 2.0
    if train.precision == "fp32":
        return weight, 4.0
    if train.precision == "fp16" or not train.grad_reduce_in_fp32:
        return weight, 2.0
    return weight, 4.0


def shards(parallel: ParallelSpec, *, expert: bool) -> int:
    """The data-parallel group a parameter's sharded state spreads over: DP x CP (``intra_dp_cp``), or for routed
    experts the expert data-parallel group (megatron-core ``optimizer/__init__.py``: ``intra_expt_dp_group``)."""
    if expert:
        return parallel.expert_data_parallel_size
    return parallel.data_parallel_size * parallel.context_parallel_size


def _strategy(parallel: ParallelSpec) -> str:
    """What is sharded: Megatron FSDP's strategy, ``optim`` for the distributed optimizer, else ``no_shard``."""
    if parallel.use_megatron_fsdp:
        return parallel.data_parallel_sharding_strategy
    return "optim" if parallel.use_distributed_optimizer else "no_shard"


def fp8_copies_persist(parallel: ParallelSpec) -> bool:
    """Whether FP8 weight copies stay for the step: not when Megatron FSDP shards the weights."""
    return _strategy(parallel) != "optim_grads_params"


def bytes_per_parameter(*, train: TrainSpec, parallel: ParallelSpec, expert: bool = False) -> float:
    """Weights, main gradients and optimizer state per parameter on one GPU during forward and backward."""
    weight, grad = weight_and_grad_bytes(train)
    state = optimizer_state_bytes(train)
    strategy, d = _strategy(parallel), shards(parallel, expert=expert)
    if strategy == "no_shard":
        return weight + grad + state
    if strategy == "optim":
        return weight + grad + state / d
    if strategy == "optim_grads":
        return weight + (grad + state) / d
    return (weight + grad + state) / d


def _dtype_problem(train: TrainSpec) -> str | None:
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        if getattr(train, name) not in OPTIMIZER_DTYPES:
            return f"train.{name}={getattr(train, name)!r}; use one of {', '.join(OPTIMIZER_DTYPES)}"
    if train.main_params_dtype not in ("fp32", "fp16", "bf16"):
        return f"train.main_params_dtype={train.main_params_dtype!r}; use fp32, fp16 or bf16"
    changed = [name for name in ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
               if getattr(train, name) != "fp32"]
    if changed and not train.use_precision_aware_optimizer:
        return (f"train.{changed[0]}={getattr(train, changed[0])} needs train.use_precision_aware_optimizer=true "
                "(megatron-core's OptimizerConfig asserts fp32 without it)")
    return None


def state_problem(parallel: ParallelSpec, train: TrainSpec) -> str | None:
    """Why Megatron would refuse these optimizer and sharding settings (``OptimizerConfig.__post_init__``,
    Megatron-LM ``validate_args``), in one line; None when they run."""
    problem = _dtype_problem(train)
    if problem:
        return problem
    if parallel.use_megatron_fsdp and parallel.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
        return (f"parallel.data_parallel_sharding_strategy={parallel.data_parallel_sharding_strategy!r}; use one of "
                f"{', '.join(SHARDING_STRATEGIES)}")
    if parallel.use_megatron_fsdp and not parallel.use_distributed_optimizer:
        return ("parallel.use_megatron_fsdp=true runs the distributed optimizer (Megatron-LM turns it on); set "
                "parallel.use_distributed_optimizer=true")
    if train.use_precision_aware_optimizer and not parallel.use_distributed_optimizer:
        return "train.use_precision_aware_optimizer needs parallel.use_distributed_optimizer=true"
    if train.optimizer_cpu_offload and not train.use_precision_aware_optimizer:
        return "train.optimizer_cpu_offload needs train.use_precision_aware_optimizer=true (Megatron-LM asserts it)"
    if train.optimizer_cpu_offload and train.fp8_param_gather and train.fp8_recipe != "delayed":
        return "train.optimizer_cpu_offload with fp8_param_gather needs fp8_recipe=delayed (Megatron-LM asserts it)"
    if train.offload_optimizer_states and (not parallel.use_distributed_optimizer or parallel.use_megatron_fsdp):
        return ("train.offload_optimizer_states needs the distributed optimizer without Megatron FSDP "
                "(Megatron-LM asserts it)")
    if train.offload_optimizer_states and train.optimizer_cpu_offload:
        return "train.offload_optimizer_states and optimizer_cpu_offload both move the optimizer state; keep one"
    return None
