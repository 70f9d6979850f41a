"""The plan's memory settings in each front end's spelling: Megatron FSDP, the precision-aware optimizer's dtypes
and optimizer offloading (:mod:`megapipe.cost.model_state` costs them). Fine-grained activation offloading is a
TransformerConfig field and goes out with the other runtime features (:func:`megapipe.emit.moe.feature_config`).

Names checked in the sources:

- Megatron-LM core_v0.16.1 ``megatron/training/arguments.py``: ``--use-megatron-fsdp``,
  ``--data-parallel-sharding-strategy`` (with Megatron FSDP ``validate_args`` requires ``--ckpt-format
  fsdp_dtensor`` and CUDA_DEVICE_MAX_CONNECTIONS other than 1: :func:`megapipe.emit.megatron.megatron_env`),
  ``--use-precision-aware-optimizer``, ``--main-params-dtype`` (fp32 or fp16), ``--exp-avg-dtype``,
  ``--exp-avg-sq-dtype``, ``--optimizer-cpu-offload``, ``--optimizer-offload-fraction``. ``--offload-optimizer-states``
  exists only on Megatron-LM's dev branch (``OptimizerStateOffloader``), so no target gets it: a warning says so.
- Megatron-Bridge: ``ddp.use_megatron_fsdp`` and ``dist.use_megatron_fsdp`` (``ConfigContainer``'s Megatron-FSDP
  validation turns on the distributed optimizer and wants ``checkpoint.ckpt_format=fsdp_dtensor``),
  ``ddp.data_parallel_sharding_strategy``; ``optimizer.*`` is megatron-core's OptimizerConfig, whose dtype fields
  Bridge's overrides take as short names (``training/utils/omegaconf_utils.py``: ``str_to_dtype``).
- NeMo 2 (2.5-2.7): ``trainer.strategy.fsdp=megatron`` with ``trainer.strategy.ddp.data_parallel_sharding_strategy``
  (as NeMo's ``scripts/performance/utils.py`` sets them); ``optim.config.*`` is the same OptimizerConfig, but the
  NeMo-Run command line has no spelling for its ``torch.dtype`` fields: a warning names them.
- NeMo 1: ``model.optim.dtype`` of ``distributed_fused_adam`` (apex), one dtype for the master weights and both
  moments; no Megatron FSDP (its ``model.fsdp`` is PyTorch FSDP) and no optimizer offloading.
"""

from __future__ import annotations

from megapipe.records import ParallelSpec, TrainSpec

__all__ = ["megatron_memory_args", "bridge_memory", "nemo2_memory", "nemo1_memory", "memory_warnings"]

_OPTIMIZER_DTYPES = ("main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
_NOT_EMITTED = "NOT EMITTED: "


def _fsdp(parallel: ParallelSpec) -> bool:
    return parallel.use_megatron_fsdp


def _optimizer_dtypes(train: TrainSpec) -> dict[str, object]:
    """The precision-aware optimizer's fields megatron-core takes, when it is on (not a bf16 master weight)."""
    if not train.use_precision_aware_optimizer:
        return {}
    dtypes = {name: getattr(train, name) for name in _OPTIMIZER_DTYPES}
    if dtypes["main_params_dtype"] == "bf16":
        del dtypes["main_params_dtype"]
    return {"use_precision_aware_optimizer": True, **dtypes}


def _cpu_offload(train: TrainSpec) -> dict[str, object]:
    if not train.optimizer_cpu_offload:
        return {}
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": train.optimizer_offload_fraction}


def megatron_memory_args(train: TrainSpec, parallel: ParallelSpec) -> list[str]:
    """Megatron-LM flags for the memory settings (a bf16 master weight has none: :func:`memory_warnings`)."""
    args: list[str] = []
    if _fsdp(parallel):
        args += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", parallel.data_parallel_sharding_strategy,
                 "--ckpt-format", "fsdp_dtensor"]
    settings = {**_optimizer_dtypes(train), **_cpu_offload(train)}
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def bridge_memory(train: TrainSpec, parallel: ParallelSpec) -> dict[str, object]:
    """Megatron-Bridge ConfigContainer keys for the memory settings."""
    settings: dict[str, object] = {}
    if _fsdp(parallel):
        settings.update({"ddp.use_megatron_fsdp": True, "dist.use_megatron_fsdp": True,
                         "ddp.data_parallel_sharding_strategy": parallel.data_parallel_sharding_strategy,
                         "checkpoint.ckpt_format": "fsdp_dtensor"})
    optimizer = {**_optimizer_dtypes(train), **_cpu_offload(train)}
    settings.update({f"optimizer.{name}": value for name, value in optimizer.items()})
    return settings


def nemo2_memory(train: TrainSpec, parallel: ParallelSpec) -> dict[str, object]:
    """NeMo 2 keys for the memory settings (the optimizer dtypes aside: :func:`memory_warnings`)."""
    settings: dict[str, object] = {}
    if _fsdp(parallel):
        strategy = parallel.data_parallel_sharding_strategy
        settings.update({"trainer.strategy.fsdp": "megatron",
                         "trainer.strategy.ddp.data_parallel_sharding_strategy": strategy})
    if train.use_precision_aware_optimizer:
        settings["optim.config.use_precision_aware_optimizer"] = True
    settings.update({f"optim.config.{name}": value for name, value in _cpu_offload(train).items()})
    return settings


def _nemo1_dtype(train: TrainSpec) -> str | None:
    """apex's one optimizer-state dtype, when the plan's three are one (None otherwise)."""
    dtypes = {getattr(train, name) for name in _OPTIMIZER_DTYPES}
    return dtypes.pop() if len(dtypes) == 1 else None


def nemo1_memory(train: TrainSpec) -> dict[str, object]:
    """NeMo 1 keys for the memory settings it has (distributed_fused_adam's state dtype)."""
    if not train.use_precision_aware_optimizer:
        return {}
    dtype = _nemo1_dtype(train)
    return {"model.optim.dtype": dtype} if dtype in ("fp32", "bf16", "fp16") else {}


def memory_warnings(train: TrainSpec, parallel: ParallelSpec) -> list[str]:
    """The memory settings a target cannot express (loud, as the plan's memory counts on them)."""
    warnings = []
    if train.offload_optimizer_states:
        warnings.append(f"{_NOT_EMITTED}offload_optimizer_states: --offload-optimizer-states exists only on "
                        "Megatron-LM's dev branch (megatron-core's OptimizerStateOffloader), not in core_v0.16.1-0.19 "
                        "or main, so no argument file sets it; the plan's memory counts on the optimizer state "
                        "leaving the GPU")
    if train.use_precision_aware_optimizer and train.main_params_dtype == "bf16":
        warnings.append(f"{_NOT_EMITTED}main_params_dtype=bf16 for Megatron-LM, Megatron-Bridge and NeMo 2: "
                        "megatron-core takes fp32 or fp16 master weights (NeMo 1's distributed_fused_adam gets "
                        "model.optim.dtype)")
    if train.use_precision_aware_optimizer:
        names = ", ".join(f"optim.config.{name}={getattr(train, name)}" for name in _OPTIMIZER_DTYPES)
        warnings.append(f"NeMo 2: set {names} (torch dtypes) in the recipe; the NeMo-Run command line cannot spell "
                        "them, so its overrides turn only use_precision_aware_optimizer on")
        if _nemo1_dtype(train) not in ("fp32", "bf16", "fp16"):
            warnings.append(f"{_NOT_EMITTED}NeMo 1's distributed_fused_adam keeps its master weights and moments in "
                            "one dtype (model.optim.dtype); the plan's differ, so its overrides leave them fp32")
    if train.optimizer_cpu_offload:
        warnings.append(f"{_NOT_EMITTED}optimizer_cpu_offload for NeMo 1, which has no hybrid CPU optimizer")
    if _fsdp(parallel):
        warnings.append(f"{_NOT_EMITTED}Megatron FSDP for NeMo 1 (its model.fsdp is PyTorch FSDP, not Megatron FSDP)")
    return warnings
