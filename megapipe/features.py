"""The runtime features a plan may run with, and the combinations megatron-core accepts.

The record is :class:`megapipe.records.RuntimeFeatures` (megatron-core's TransformerConfig names);
this module holds the values each feature takes and :func:`feature_problem`, the one place that says
why a combination cannot run (megatron-core's ``TransformerConfig.__post_init__`` and Megatron-LM's
``validate_args``, the versions ``scripts/check_megatron_args.py`` checks). The config boundary turns a
problem into a one-line error; the search skips such candidates (counted under ``features``).
"""

from __future__ import annotations

from megapipe.records import ModelSpec, ParallelSpec, Recompute, RuntimeFeatures, TrainSpec

__all__ = [
    "DISPATCHERS",
    "FLEX_BACKENDS",
    "CUDA_GRAPH_IMPLS",
    "CUDA_GRAPH_SCOPES",
    "MOE_GRAPH_SCOPES",
    "RECOMPUTE_MODULES",
    "OFFLOAD_MODULES",
    "feature_problem",
    "problem_sizes",
    "device_max_connections",
    "SEARCHED",
    "GRAPHED_SCOPES",
    "feature_variants",
    "MOE_SETTINGS",
]

DISPATCHERS = ("alltoall", "allgather", "flex")
"""megatron-core's ``moe_token_dispatcher_type``."""
FLEX_BACKENDS = ("deepep", "hybridep")
"""``moe_flex_dispatcher_backend`` of the flex dispatcher."""
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "full_iteration")
"""megatron-core's ``CudaGraphScope`` values megapipe costs (``mamba`` aside)."""
MOE_GRAPH_SCOPES = ("moe", "moe_router", "moe_preprocess")
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core's allowed ``recompute_modules`` (TransformerConfig.__post_init__)."""
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""megatron-core's allowed ``offload_modules`` (TransformerConfig.__post_init__, core_v0.16.1)."""


MOE_SETTINGS = ("expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
                "moe_flex_dispatcher_backend", "overlap_moe_expert_parallel_comm", "moe_shared_expert_overlap",
                "moe_permute_fusion", "moe_router_fusion", "moe_router_force_load_balancing",
                "moe_router_padding_for_quantization", "moe_load_imbalance")
"""The parallel and train settings that only a mixture-of-experts model reads (a dense plan's record leaves them
out; :func:`feature_problem` refuses the features among them on a dense model)."""


def _moe_problem(features: RuntimeFeatures, model: ModelSpec, parallel: ParallelSpec | None) -> str | None:
    moe_only = {
        "moe_token_dispatcher_type": features.moe_token_dispatcher_type != "alltoall",
        "overlap_moe_expert_parallel_comm": features.overlap_moe_expert_parallel_comm,
        "moe_shared_expert_overlap": features.moe_shared_expert_overlap,
        "moe_permute_fusion": features.moe_permute_fusion,
        "moe_router_fusion": features.moe_router_fusion,
        "moe_router_force_load_balancing": features.moe_router_force_load_balancing,
        "moe_router_padding_for_quantization": features.moe_router_padding_for_quantization,
    }
    if not model.is_moe:
        named = [name for name, on in moe_only.items() if on]
        return f"{', '.join(named)} need a MoE model (model.num_moe_experts > 0); unset them" if named else None
    if features.moe_token_dispatcher_type == "flex" and features.moe_flex_dispatcher_backend not in FLEX_BACKENDS:
        return (f"moe_flex_dispatcher_backend={features.moe_flex_dispatcher_backend!r}; the flex dispatcher "
                f"takes {' or '.join(FLEX_BACKENDS)}")
    if features.overlap_moe_expert_parallel_comm:
        if features.moe_token_dispatcher_type not in ("alltoall", "flex"):
            return (f"overlap_moe_expert_parallel_comm needs the alltoall or flex dispatcher, not "
                    f"{features.moe_token_dispatcher_type}; set parallel.moe_token_dispatcher_type=alltoall")
        if model.mtp_num_layers > 1:
            return (f"overlap_moe_expert_parallel_comm supports at most one MTP layer, not mtp_num_layers="
                    f"{model.mtp_num_layers}; turn the overlap off")
        if features.cuda_graphs and (features.cuda_graph_impl != "transformer_engine"
                                     or {"moe", "mlp"} & set(features.cuda_graph_scope)):
            return ("overlap_moe_expert_parallel_comm takes only Transformer Engine graphs without the moe or mlp "
                    "scope (megatron-core 0.16); use cuda_graph_impl=transformer_engine, scope attn/moe_router/"
                    "moe_preprocess")
    if features.moe_shared_expert_overlap:
        if not model.moe_shared_expert_intermediate_size:
            return "moe_shared_expert_overlap needs shared experts (model.moe_shared_expert_intermediate_size > 0)"
        if "shared_experts" in features.recompute_modules:
            return "recompute_modules shared_experts cannot run with moe_shared_expert_overlap; drop one of them"
        if features.moe_token_dispatcher_type != "alltoall":
            return (f"moe_shared_expert_overlap works with the alltoall dispatcher only, not "
                    f"{features.moe_token_dispatcher_type}; use parallel.moe_token_dispatcher_type=alltoall")
        if features.overlap_moe_expert_parallel_comm:
            return ("moe_shared_expert_overlap and overlap_moe_expert_parallel_comm exclude each other; "
                    "keep one (EP overlap hides more)")
    if features.overlap_moe_expert_parallel_comm and parallel is not None:
        if parallel.expert_model_parallel_size < 2:
            return "overlap_moe_expert_parallel_comm needs expert_model_parallel_size > 1 (there is no all-to-all)"
        pp, vp = parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size
        if pp > 1 and vp < 2:
            return (f"overlap_moe_expert_parallel_comm needs pipeline_model_parallel_size=1 or interleaving "
                    f"(virtual_pipeline_model_parallel_size >= 2), not PP={pp} VP={vp}; set a VP or turn it off")
        if model.mtp_num_layers == 1 and pp == 1:
            return ("overlap_moe_expert_parallel_comm with an MTP layer needs pipeline_model_parallel_size > 1 "
                    "(megatron-core 0.16)")
    if features.moe_token_dispatcher_type == "flex" and parallel is not None and \
            parallel.tensor_model_parallel_size * parallel.expert_model_parallel_size < 2:
        return "the flex dispatcher needs TP x EP > 1 (DeepEP/HybridEP move tokens between GPUs); use alltoall"
    return None


def _value_problem(features: RuntimeFeatures) -> str | None:
    """The first feature set to a value megatron-core does not know (dispatcher, graph impl, scopes, modules)."""
    if features.moe_token_dispatcher_type not in DISPATCHERS:
        return f"moe_token_dispatcher_type={features.moe_token_dispatcher_type!r}; use one of {', '.join(DISPATCHERS)}"
    if features.cuda_graph_impl not in CUDA_GRAPH_IMPLS:
        return f"cuda_graph_impl={features.cuda_graph_impl!r}; use one of {', '.join(CUDA_GRAPH_IMPLS)}"
    bad = [scope for scope in features.cuda_graph_scope if scope not in CUDA_GRAPH_SCOPES]
    if bad:
        return f"cuda_graph_scope holds {bad}; use values of {', '.join(CUDA_GRAPH_SCOPES)}"
    bad = [module for module in features.recompute_modules if module not in RECOMPUTE_MODULES]
    if bad:
        return f"recompute_modules holds {bad}; use values of {', '.join(RECOMPUTE_MODULES)}"
    bad = [module for module in features.offload_modules if module not in OFFLOAD_MODULES]
    if bad:
        return f"offload_modules holds {bad}; use values of {', '.join(OFFLOAD_MODULES)}"
    return None


def _offload_problem(features: RuntimeFeatures, model: ModelSpec) -> str | None:
    """Why megatron-core's fine-grained activation offloading cannot run as set (TransformerConfig.__post_init__,
    and its CUDA-graph rules in docs/user-guide/features/fine_grained_activation_offloading.md)."""
    modules = set(features.offload_modules)
    if features.fine_grained_activation_offloading != bool(modules):
        return ("fine_grained_activation_offloading and offload_modules go together: set both (offload_modules "
                "names what leaves the GPU) or neither")
    if "attn_proj" in modules and "core_attn" not in modules:
        return "offload_modules attn_proj needs core_attn too (its input is the attention output core_attn keeps)"
    moe_parts = sorted(modules & {"expert_fc1", "moe_act"})
    if moe_parts and not model.is_moe:
        return f"offload_modules {moe_parts} name MoE parts, but the model has no experts"
    if modules & {"attn_norm", "mlp_norm"} and features.cuda_graphs:
        return "offload_modules attn_norm and mlp_norm cannot run with CUDA graphs (they cross the graphs' boundaries)"
    return None


def _overlap_problem(features: RuntimeFeatures, train: TrainSpec) -> str | None:
    """Why EP overlap (or the delayed weight gradients it enables) cannot run with this precision and recompute."""
    if features.overlap_moe_expert_parallel_comm and train.precision not in ("bf16", "fp16", "fp8"):
        return f"overlap_moe_expert_parallel_comm needs a bf16 or fp16 model, not precision={train.precision}"
    if features.overlap_moe_expert_parallel_comm and Recompute(train.recompute_granularity) == Recompute.full:
        return "overlap_moe_expert_parallel_comm cannot run with full recompute; use recompute_granularity=selective"
    if (features.overlap_moe_expert_parallel_comm and Recompute(train.recompute_granularity) == Recompute.selective
            and "moe" in features.recompute_modules):
        return "overlap_moe_expert_parallel_comm cannot recompute the moe module (megatron-core 0.17+); drop moe " \
               "from recompute_modules"
    if features.delay_wgrad_compute and not features.overlap_moe_expert_parallel_comm:
        return "delay_wgrad_compute needs overlap_moe_expert_parallel_comm=true (it overlaps the weight gradients " \
               "with the EP all-to-all)"
    return None


def _graph_problem(features: RuntimeFeatures, model: ModelSpec, train: TrainSpec) -> str | None:
    """Why megatron-core cannot capture these CUDA graphs (impl, scopes) for this model and recompute."""
    if features.cuda_graphs and model.is_moe and not features.cuda_graph_scope:
        return ("a CUDA graph of the whole MoE layer cannot capture dropless routing (its token counts change every "
                "step); set train.cuda_graph_scope=[attn,moe_router,moe_preprocess]")
    if features.cuda_graph_scope and features.cuda_graph_impl == "none":
        return "cuda_graph_scope is set but cuda_graph_impl=none; set cuda_graph_impl=transformer_engine (or local)"
    if "full_iteration" in features.cuda_graph_scope:
        if features.cuda_graph_impl != "local":
            return "cuda_graph_scope=full_iteration needs cuda_graph_impl=local"
        if model.is_moe and not features.moe_router_force_load_balancing:
            return ("cuda_graph_scope=full_iteration cannot capture dropless MoE routing (its token counts change "
                    "every step); capture attn/moe_router/moe_preprocess instead")
    scopes = set(features.cuda_graph_scope)
    if scopes & set(MOE_GRAPH_SCOPES) and not model.is_moe:
        return f"cuda_graph_scope {list(features.cuda_graph_scope)} names MoE parts, but the model has no experts"
    if "moe" in scopes and model.is_moe:
        return ("cuda_graph_scope moe captures only drop-and-pad MoE (static shapes); megapipe plans dropless "
                "routing, so capture attn, moe_router and moe_preprocess")
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        return "cuda_graph_scope moe_preprocess needs moe_router too (megatron-core captures them together)"
    if "mlp" in scopes and model.is_moe and all(model.moe_layers):
        return "cuda_graph_scope mlp captures dense layers only, and every layer of this model is MoE; drop mlp"
    if (features.cuda_graph_impl == "transformer_engine" and "moe_router" in scopes
            and Recompute(train.recompute_granularity) == Recompute.selective and "moe" in features.recompute_modules):
        return "recompute_modules moe cannot run with a Transformer Engine moe_router graph; drop one of them"
    if features.cuda_graphs and Recompute(train.recompute_granularity) == Recompute.full:
        return "CUDA graphs do not capture full recompute; use recompute_granularity=selective or none"
    return None


def _recompute_problem(features: RuntimeFeatures, model: ModelSpec, train: TrainSpec) -> str | None:
    """Why selective recompute cannot recompute these modules for this model and FP8 recipe."""
    if Recompute(train.recompute_granularity) == Recompute.selective:
        if "mla_up_proj" in features.recompute_modules and not model.multi_latent_attention:
            return "recompute_modules mla_up_proj needs multi-latent attention (model.multi_latent_attention=true)"
        if any(m in features.recompute_modules for m in ("moe_act", "moe", "shared_experts")) and not model.is_moe:
            return f"recompute_modules {list(features.recompute_modules)} names MoE parts, but the model has no experts"
        if (train.precision == "fp8" and train.fp8_recipe == "delayed"
                and any(m in features.recompute_modules for m in ("moe_act", "layernorm"))):
            return "recompute_modules moe_act and layernorm do not work with fp8_recipe=delayed; use tensorwise"
    return None


def _padding_and_bias_problem(features: RuntimeFeatures, model: ModelSpec, train: TrainSpec) -> str | None:
    """Why the router's quantization padding, or delayed weight gradients under an attn graph, cannot run."""
    if features.moe_router_padding_for_quantization and train.precision != "fp8":
        return "moe_router_padding_for_quantization needs FP8 (train.precision=fp8)"
    if features.moe_router_padding_for_quantization and features.moe_token_dispatcher_type == "allgather":
        return "moe_router_padding_for_quantization does not work with the allgather dispatcher; use alltoall or flex"
    biased = model.add_bias_linear if model.add_bias_linear is not None else model.activation == "gelu"
    if features.delay_wgrad_compute and biased and "attn" in features.cuda_graph_scope:
        return ("delay_wgrad_compute with an attn CUDA graph needs linear layers without biases (megatron-core "
                "0.17+); drop attn from cuda_graph_scope or turn delay_wgrad_compute off")
    return None


def problem_sizes(*, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                  virtual_pipeline_model_parallel_size: int, expert_model_parallel_size: int) -> tuple[bool, ...]:
    """What :func:`feature_problem` reads of the parallel sizes: whether PP > 1, VP >= 2, EP >= 2 and TP x EP >= 2.
    Sizes that agree on these get the same verdict for every feature set (tests/test_features.py), so a search
    decides each feature set once per such tuple."""
    return (pipeline_model_parallel_size > 1, virtual_pipeline_model_parallel_size >= 2,
            expert_model_parallel_size >= 2, tensor_model_parallel_size * expert_model_parallel_size >= 2)


def feature_problem(features: RuntimeFeatures, *, model: ModelSpec, parallel: ParallelSpec | None,
                    train: TrainSpec) -> str | None:
    """Why megatron-core would refuse these features for this model and plan, in one line; None when it runs.

    ``parallel`` None checks what holds at any parallel sizes (a search's sizes are not chosen yet)."""
    # Checked lazily in this order: it decides which message a combination with several problems gets.
    return (_value_problem(features) or _overlap_problem(features, train) or _moe_problem(features, model, parallel)
            or _graph_problem(features, model, train) or _recompute_problem(features, model, train)
            or _padding_and_bias_problem(features, model, train) or _offload_problem(features, model) or None)


def device_max_connections(features: RuntimeFeatures) -> int | None:
    """The CUDA_DEVICE_MAX_CONNECTIONS a plan needs: 32 with EP overlap (its dispatch and combine run on their own
    stream, which one connection would serialise; Megatron-LM's validate_args then only warns about TP/CP > 1 on
    Hopper) or with DeepEP/HybridEP (Megatron-Bridge's performance recipes), else None (Megatron's own rule for
    TP/CP decides)."""
    if features.overlap_moe_expert_parallel_comm or features.moe_token_dispatcher_type == "flex":
        return 32
    return None


SEARCHED = ("moe_token_dispatcher_type", "overlap_moe_expert_parallel_comm", "cuda_graph_scope")
"""The features ``megapipe plan`` searches for a MoE model when the config leaves them null."""
_DISPATCH_CHOICES = (("alltoall", "deepep"), ("flex", "deepep"), ("flex", "hybridep"))
GRAPHED_SCOPES = ("attn", "moe_router", "moe_preprocess")
"""The partial CUDA graphs fast dropless MoE runs capture (Megatron-LM's MoE README, the DeepSeek-V3 GB200
write-up): everything but the expert path, whose token counts change every step."""


def feature_variants(template: RuntimeFeatures, *, model: ModelSpec, free: frozenset[str]) -> tuple[RuntimeFeatures, ...]:
    """The feature sets a search tries: the template's, with each free searched feature (:data:`SEARCHED`)
    varied over its choices; dense models only ever get the template."""
    import dataclasses

    if not model.is_moe or not free:
        return (template,)
    dispatchers = _DISPATCH_CHOICES if "moe_token_dispatcher_type" in free else (
        (template.moe_token_dispatcher_type, template.moe_flex_dispatcher_backend),)
    overlaps = (False, True) if "overlap_moe_expert_parallel_comm" in free else (
        (template.overlap_moe_expert_parallel_comm,))
    graphs = (("none", ()), ("transformer_engine", GRAPHED_SCOPES)) if "cuda_graph_scope" in free else (
        (template.cuda_graph_impl, template.cuda_graph_scope),)
    out = []
    for (dispatcher, backend) in dispatchers:
        for overlap in overlaps:
            for impl, scopes in graphs:
                delay = overlap if "overlap_moe_expert_parallel_comm" in free else template.delay_wgrad_compute
                out.append(dataclasses.replace(
                    template, moe_token_dispatcher_type=dispatcher, moe_flex_dispatcher_backend=backend,
                    overlap_moe_expert_parallel_comm=overlap, delay_wgrad_compute=delay,
                    moe_shared_expert_overlap=template.moe_shared_expert_overlap and not overlap
                    and dispatcher == "alltoall",
                    cuda_graph_impl=impl, cuda_graph_scope=scopes))
    return tuple(dict.fromkeys(out))
