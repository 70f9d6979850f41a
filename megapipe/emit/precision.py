"""How each Megatron front end is told the plan's precision, FP8 recipe and Transformer Engine overlap.

One home for the names (checked in the public sources, docs/emit.md):

- Megatron-LM: ``--bf16`` / ``--fp16``; FP8 adds ``--fp8-format hybrid`` (E4M3 forward, E5M2
  gradients; ``e4m3`` for MXFP8, as Megatron-Bridge's MXFP8 recipe sets), ``--fp8-recipe`` and
  ``--fp8-param-gather``; ``--tp-comm-overlap`` needs ``--sequence-parallel`` (``validate_args``).
- Megatron-Bridge: a ``mixed_precision`` recipe name (``bf16_mixed``; FP8:
  ``bf16_with_fp8_delayed_scaling_mixed``, ``bf16_with_fp8_current_scaling_mixed`` for
  ``tensorwise``, ``bf16_with_mxfp8_mixed``, ``bf16_with_fp8_subchannel_scaling_mixed`` for
  ``blockwise``; ``megatron/bridge/training/mixed_precision.py``). Those recipes fix their own
  ``fp8_param_gather`` (on, off for blockwise), and the current-scaling one keeps the first and last
  layers in bf16; where the plan differs, a warning says so. TP overlap comes from the recipe's
  ``comm_overlap`` (a warning says so).
- NeMo 2: ``trainer.plugins`` (MegatronMixedPrecision) ``fp8``, ``fp8_recipe``, ``fp8_param_gather``.
- NeMo 1: ``model.fp8``, ``model.fp8_hybrid``, ``model.fp8_params`` (delayed scaling only) and
  ``model.ub_tp_comm_overlap``.

bf16 main gradients (``train.grad_reduce_in_fp32=false``): Megatron-LM ``--grad-reduce-in-bf16``
(``validate_args`` then clears ``accumulate_allreduce_grads_in_fp32``, which becomes the DDP config's
``grad_reduce_in_fp32``; core_v0.16.1 to main); NeMo 2 ``trainer.plugins.grad_reduce_in_fp32`` (MegatronMixedPrecision);
NeMo 1 ``model.optim.grad_sync_dtype=bf16`` (distributed_fused_adam). Megatron-Bridge's mixed-precision recipe writes
its own ``grad_reduce_in_fp32`` over ``ddp.grad_reduce_in_fp32`` (``MixedPrecisionConfig.setup``), so an override
cannot set it: a warning names the recipe change, as its performance recipes make it.
"""

from __future__ import annotations

from megapipe.records import ParallelSpec, TrainSpec

__all__ = ["megatron_precision_args", "bridge_precision", "nemo2_precision", "nemo1_precision", "tp_overlap_on"]

_BRIDGE_RECIPES = {"delayed": ("bf16_with_fp8_delayed_scaling_mixed", True),
                   "tensorwise": ("bf16_with_fp8_current_scaling_mixed", True),
                   "mxfp8": ("bf16_with_mxfp8_mixed", True),
                   "blockwise": ("bf16_with_fp8_subchannel_scaling_mixed", False)}
"""recipe -> (Megatron-Bridge mixed_precision recipe, the fp8_param_gather it sets)."""
_NEMO2_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32", "fp8": "bf16-mixed"}
_NEMO1_PRECISION = {"bf16": "bf16-mixed", "fp16": 16, "fp32": 32, "fp8": "bf16-mixed"}


def tp_overlap_on(parallel: ParallelSpec) -> bool:
    """Whether the plan runs Transformer Engine's TP communication overlap (it needs sequence parallelism)."""
    return parallel.tp_comm_overlap and parallel.sequence_parallel and parallel.tensor_model_parallel_size > 1


def _format(train: TrainSpec) -> str:
    return "e4m3" if train.fp8_recipe == "mxfp8" else "hybrid"


def megatron_precision_args(train: TrainSpec, parallel: ParallelSpec) -> list[str]:
    args = []
    if train.precision in ("bf16", "fp8"):
        args.append("--bf16")
    elif train.precision == "fp16":
        args.append("--fp16")
    if train.precision == "fp8":
        args += ["--fp8-format", _format(train), "--fp8-recipe", train.fp8_recipe]
        if train.fp8_param_gather:
            args.append("--fp8-param-gather")
    if bf16_grads(train):
        args.append("--grad-reduce-in-bf16")
    if tp_overlap_on(parallel):
        args.append("--tp-comm-overlap")
    return args


def bf16_grads(train: TrainSpec) -> bool:
    """Whether the plan keeps bf16 main gradients (only bf16 and fp8 training has them)."""
    return not train.grad_reduce_in_fp32 and train.precision in ("bf16", "fp8")


def bridge_precision(train: TrainSpec, parallel: ParallelSpec) -> tuple[dict[str, object], list[str]]:
    settings: dict[str, object] = {}
    warnings = []
    if train.precision in ("bf16", "fp16"):
        settings["mixed_precision"] = f"{train.precision}_mixed"
    elif train.precision == "fp8":
        recipe, gathers = _BRIDGE_RECIPES[train.fp8_recipe]
        settings["mixed_precision"] = recipe
        if gathers != train.fp8_param_gather:
            warnings.append(f"Megatron-Bridge's {recipe} sets fp8_param_gather={gathers}, the plan "
                            f"fp8_param_gather={train.fp8_param_gather}: memory and the DP all-gather differ "
                            f"from the plan; plan with train.fp8_param_gather={str(gathers).lower()} to match it")
        if train.fp8_recipe == "tensorwise":
            warnings.append(f"Megatron-Bridge's {recipe} keeps the first and last decoder layers in bf16; the plan "
                            "runs every layer in FP8 (those two layers take a little longer)")
    if bf16_grads(train):
        warnings.append("Megatron-Bridge's mixed_precision recipe sets grad_reduce_in_fp32=True over ddp.*; for the "
                        "plan's bf16 main gradients set cfg.mixed_precision.grad_reduce_in_fp32 = False and "
                        "cfg.ddp.grad_reduce_in_fp32 = False in the recipe (as its performance recipes do)")
    if tp_overlap_on(parallel):
        warnings.append("Megatron-Bridge takes TP communication overlap from the recipe's "
                        "comm_overlap=CommOverlapConfig(tp_comm_overlap=True) (its 70B and 175B recipes set one); "
                        "an override cannot create it where the recipe has comm_overlap=None")
    return settings, warnings


def nemo2_precision(train: TrainSpec) -> dict[str, object]:
    settings: dict[str, object] = {"trainer.plugins.precision": _NEMO2_PRECISION[train.precision]}
    if train.precision == "fp8":
        settings.update({"trainer.plugins.fp8": _format(train), "trainer.plugins.fp8_recipe": train.fp8_recipe,
                         "trainer.plugins.fp8_param_gather": train.fp8_param_gather})
    if bf16_grads(train):
        settings["trainer.plugins.grad_reduce_in_fp32"] = False
    return settings


def nemo1_precision(train: TrainSpec, parallel: ParallelSpec) -> tuple[dict[str, object], list[str]]:
    settings: dict[str, object] = {"trainer.precision": _NEMO1_PRECISION[train.precision]}
    warnings = []
    if train.precision == "fp8":
        settings.update({"model.fp8": True, "model.fp8_hybrid": True, "model.fp8_params": train.fp8_param_gather})
        if train.fp8_recipe != "delayed":
            warnings.append(f"NeMo 1 runs FP8 with delayed scaling only; the plan's fp8_recipe={train.fp8_recipe} "
                            "cannot be expressed there")
    if bf16_grads(train):
        settings["model.optim.grad_sync_dtype"] = "bf16"
    if tp_overlap_on(parallel):
        settings["model.ub_tp_comm_overlap"] = True
    return settings, warnings
