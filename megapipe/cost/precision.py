"""Training precisions and FP8 recipes: element sizes, GEMM datatypes, and what each GPU supports.

``train.precision`` names how weights and activations are held and which datatype the GEMMs
run in (Megatron-LM ``--bf16`` / ``--fp16``, plus Transformer Engine's FP8 with ``--fp8-format``
and ``--fp8-recipe``):

- ``bf16``, ``fp16``: 16-bit weights and activations, 16-bit GEMMs;
- ``fp32``: fp32 throughout, GEMMs on TF32 tensor cores at half the bf16 rate (A100, H100 and
  B200 datasheets);
- ``fp8``: bf16 weights and activations, and the decoder's linear layers run FP8 GEMMs (Micikevicius
  et al. 2022, "FP8 Formats for Deep Learning"): forward E4M3, gradients E5M2 (the ``hybrid``
  format). Attention, norms, the embedding, the output layer and the optimizer stay in bf16/fp32
  (Transformer Engine's fp8_autocast covers TE linear layers only).

FP8 recipes (Megatron's ``--fp8-recipe``): ``delayed`` and ``tensorwise`` scale per tensor
(H100 and later); ``mxfp8`` scales each 32 elements with an E8M0 factor and needs Blackwell's
tensor cores (OCP Microscaling Formats spec v1.0); ``blockwise`` scales 1x128 activation tiles
and 128x128 weight blocks (DeepSeek-V3 report, Sec. 3.3), Hopper and Blackwell.
"""

from __future__ import annotations

from megapipe.errors import ConfigError
from megapipe.records import GpuSpec, TrainSpec

__all__ = [
    "PRECISIONS",
    "FP8_RECIPES",
    "element_bytes",
    "gemm_dtype",
    "default_fp8_recipe",
    "check_precision",
    "fp8_weight_copy_bytes",
    "recipe_gemm_share",
]

PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
_ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
_MX_BLOCK = 32
"""MXFP8 elements per E8M0 scale (OCP MX spec v1.0, Sec. 5)."""
_RECIPE_GEMM_SHARE = {"mxfp8": 0.74}
"""An FP8 recipe's GEMM rate over per-tensor FP8's (the GPU's ``fp8_matmul_efficiency``): MXFP8's block-scaled
GEMMs, 2,672 TFLOP/s on GB200 (cuBLAS, K=7,168, N=2,048; the DeepSeek-V3 GB200 write-up at Megatron-LM eb0783b6,
sec. 2.1) against 0.72 x 5,000 for per-tensor FP8 there."""


def recipe_gemm_share(recipe: str) -> float:
    """The share of the GPU's FP8 GEMM rate a recipe's GEMMs run at (1 for per-tensor and blockwise scaling)."""
    return _RECIPE_GEMM_SHARE.get(recipe, 1.0)


def element_bytes(precision: str) -> int:
    """Bytes of one activation or weight element as the model holds it (fp8 keeps bf16 tensors)."""
    try:
        return _ELEMENT_BYTES[precision]
    except KeyError:
        raise ConfigError(f"train.precision={precision!r} is not supported; use one of {', '.join(PRECISIONS)}") from None


def gemm_dtype(precision: str) -> str:
    """What the decoder's GEMMs run in: fp8, fp32 (TF32) or bf16 (fp16 runs at the bf16 rate)."""
    return {"fp8": "fp8", "fp32": "fp32"}.get(precision, "bf16")


def default_fp8_recipe(gpu: GpuSpec) -> str:
    """MXFP8 on Blackwell, whose tensor cores scale blocks natively; per-tensor current scaling before it."""
    return "mxfp8" if gpu.architecture == "blackwell" else "tensorwise"


def check_precision(train: TrainSpec, gpu: GpuSpec, *, where: str = "cluster.gpu") -> None:
    """ConfigError when the GPU cannot run the precision or recipe, naming both and the fix."""
    element_bytes(train.precision)
    if train.precision != "fp8":
        if train.fp8_recipe or train.fp8_param_gather:
            raise ConfigError(
                f"train.fp8_recipe={train.fp8_recipe!r} / fp8_param_gather={train.fp8_param_gather} need "
                f"train.precision=fp8 (it is {train.precision!r}); set train.precision=fp8 or drop them")
        return
    if gpu.fp8_tflops <= 0:
        raise ConfigError(
            f"train.precision=fp8 needs FP8 tensor cores, which {where} {gpu.name!r} lacks "
            f"({where}.fp8_tflops={gpu.fp8_tflops}); use train.precision=bf16 or an H100/H200/B200/B300 cluster")
    if train.fp8_recipe not in FP8_RECIPES:
        raise ConfigError(f"train.fp8_recipe={train.fp8_recipe!r} is unknown; use one of {', '.join(FP8_RECIPES)}")
    if train.fp8_recipe == "mxfp8" and gpu.architecture != "blackwell":
        raise ConfigError(
            f"train.fp8_recipe=mxfp8 needs Blackwell tensor cores; {where} {gpu.name!r} is "
            f"{gpu.architecture or 'unknown'}; use train.fp8_recipe=tensorwise or delayed")


def fp8_weight_copy_bytes(train: TrainSpec) -> float:
    """Extra bytes per GEMM weight that FP8 training keeps beside the bf16 weight.

    Transformer Engine caches each weight's FP8 copy for the step, and the transposed copy the
    backward's dgrad GEMM reads (TE ``Float8Tensor`` with its transpose cache on Hopper; MXFP8
    keeps a row-wise and a column-wise copy, each with one E8M0 scale per 32 elements;
    Transformer Engine issues #1261, #1764). With ``--fp8-param-gather`` the FP8 copy *is* the
    parameter, so the bf16 weight's 2 bytes go instead.
    """
    if train.precision != "fp8":
        return 0.0
    copies = 2.0 * (1.0 + 1.0 / _MX_BLOCK) if train.fp8_recipe == "mxfp8" else 2.0
    if train.fp8_param_gather:
        return copies - 2.0  # the FP8 copy replaces the bf16 weight's 2 bytes
    return copies
