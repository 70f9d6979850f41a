"""Run a plan dir's Megatron-LM arguments through Megatron-LM's own start-up checks, on CPU (opt-in, not CI).

    python scripts/check_megatron_args.py --megatron /path/to/Megatron-LM PLAN_DIR [PLAN_DIR ...]

For each plan dir (written by ``megapipe plan``) this reads ``megatron_args.txt`` (one shell line)
and plan.yaml, then takes the path ``pretrain_gpt.py`` takes at that checkout:

* core_v0.16.x: ``parse_args`` -> ``validate_args`` -> ``set_global_variables`` ->
  ``core_transformer_config_from_args``;
* core_v0.19.x and main: ``parse_and_validate_args`` -> ``gpt_config_from_args``.

It adds only a tokenizer (``--tokenizer-type NullTokenizer`` with the plan's vocabulary), data
(``--mock-data``), iterations (``--train-iters 10 --eval-interval 10``) and a learning rate, plus
``--no-rope-fusion`` when Transformer Engine is absent (Megatron refuses RoPE fusion without it;
the flag picks a kernel, not the model). It exports the plan's environment (``megatron_env``:
CUDA_DEVICE_MAX_CONNECTIONS, NVTE_CPU_OFFLOAD_V1, ...) and WORLD_SIZE / RANK for the plan's GPU count. In-process shims, printed:
without Transformer Engine here, Megatron's TE version checks see ``--te-version`` (default 2.12.0, the most
megapipe's plans state their features need) and moe_utils gets placeholders for TE's fused MoE kernels;
``get_device_arch_version`` returns the plan's GPU generation (it asks CUDA otherwise), and on
Python 3.11 ``typing.override`` is the identity (core_v0.19+ needs Python 3.12).

It then compares Megatron's TransformerConfig with plan.yaml: the shape, the parallel sizes,
precision, recompute and the decoder layers of every layout stage. Exit 0 when every plan dir
was accepted and agreed, 1 otherwise.

Environment (Python 3.11, CPU): ``pip install torch==2.13.0`` (the CPU wheel) first, then
``pip install numpy packaging six regex pyyaml pydantic triton``; the checkout's own
``megatron/core`` is used, not a wheel.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import traceback

DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--data-args-path", "--per-split-data-args-path")
TRAIN_LENGTH_FLAGS = ("--train-iters", "--train-samples")
ADDED_DEFAULTS = {"--train-iters": ["--train-iters", "10"], "--lr": ["--lr", "1e-4"]}
_ARCH = {"ampere": 8, "hopper": 9, "blackwell": 10, "cdna3": 9}


def flag_value(tokens: list[str], flag: str, default=None):
    for i, t in enumerate(tokens):
        if t == flag and i + 1 < len(tokens):
            return tokens[i + 1]
        if t.startswith(flag + "="):
            return t.split("=", 1)[1]
    return default


def has_flag(tokens: list[str], *flags: str) -> bool:
    return any(t == f or t.startswith(f + "=") for t in tokens for f in flags)


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401 pylint: disable=unused-import
    except Exception:  # ImportError, or a broken install
        return False
    return True


def added_tokens(tokens: list[str], vocab_size: int) -> list[str]:
    extra: list[str] = []
    if not have_te() and not has_flag(tokens, "--no-rope-fusion"):
        # TransformerConfig.__post_init__ raises "apply_rope_fusion is not available. Please
        # install TE >= 1.4." when Transformer Engine is absent (rope fusion defaults on, and
        # validate_args turns it off only for non-rope position embeddings). The flag only
        # picks the RoPE kernel; it does not change the model. Not for a real GPU launch.
        extra += ["--no-rope-fusion"]
    if not has_flag(tokens, "--tokenizer-type"):
        extra += ["--tokenizer-type", "NullTokenizer"]
        if not has_flag(tokens, "--vocab-size"):
            extra += ["--vocab-size", str(vocab_size)]
    if not has_flag(tokens, *DATA_FLAGS):
        extra += ["--mock-data"]
    if not has_flag(tokens, *TRAIN_LENGTH_FLAGS):
        extra += ADDED_DEFAULTS["--train-iters"]
    if not has_flag(tokens, "--eval-interval", "--full-validation", "--skip-train"):
        # build_train_valid_test_data_iterators computes train_iters // eval_interval
        # (training.py), a TypeError at run time when --eval-interval is unset.
        extra += ["--eval-interval", "10"]
    if not has_flag(tokens, "--lr"):
        extra += ADDED_DEFAULTS["--lr"]
    return extra


def runtime_lint(tokens: list[str]) -> list[str]:
    """What a real pretrain_gpt.py run needs that parse/validate_args do not check."""
    notes = []
    if not has_flag(tokens, "--tokenizer-type"):
        notes.append("no --tokenizer-type: pretrain_gpt.py defaults to GPT2BPETokenizer, which needs "
                     "--vocab-file/--merge-file (core_v0.16: bare assert; core_v0.19+/main: tries to download)")
    if not has_flag(tokens, *DATA_FLAGS):
        notes.append("no data source (--mock-data or --data-path ...)")
    if not has_flag(tokens, *TRAIN_LENGTH_FLAGS):
        notes.append("no --train-iters/--train-samples: the dataset builder asserts train_iters is not None")
    if not has_flag(tokens, "--eval-interval", "--full-validation", "--skip-train"):
        notes.append("no --eval-interval: training.py computes train_iters // eval_interval -> TypeError")
    if not has_flag(tokens, "--lr"):
        notes.append("no --lr: the LR scheduler gets max_lr=None")
    if not has_flag(tokens, "--bf16", "--fp16"):
        notes.append("neither --bf16 nor --fp16: Megatron trains in fp32")
    if has_flag(tokens, "--num-query-groups") and not has_flag(tokens, "--group-query-attention"):
        notes.append("--num-query-groups without --group-query-attention is ignored (MHA is built)")
    if has_flag(tokens, "--swiglu") and not has_flag(tokens, "--ffn-hidden-size"):
        notes.append("--swiglu without --ffn-hidden-size derives int(8h/3/64)*64 (21824 for h=8192, not 28672)")
    if has_flag(tokens, "--use-flash-attn"):
        notes.append("--use-flash-attn only affects legacy models; use --attention-backend")
    return notes


def install_shims(checkout: str) -> list[str]:
    """Import-time shims (see module docstring); returns what was done."""
    done = []
    import typing

    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
        done.append("typing.override := identity (Python < 3.12)")
    return done


TE_FUSED_MOE = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                "fused_sort_chunks_by_index_with_probs", "fused_unpermute", "fused_topk_with_score_function",
                "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss")
"""Transformer Engine's fused MoE kernels that megatron-core's moe_utils imports when TE is present."""


def patch_te(te_version: str) -> list[str]:
    """Without Transformer Engine here: Megatron's TE version checks see ``te_version`` (what the plan's warnings
    say it needs) and moe_utils gets placeholders for TE's fused MoE kernels, so --moe-permute-fusion and
    --moe-router-fusion are judged as on a machine with that TE. Nothing is run, so no kernel is called."""
    from packaging.version import Version

    import megatron.core.utils as core_utils
    import megatron.core.transformer.moe.moe_utils as moe_utils

    core_utils._te_version = Version(te_version)
    done = [f"megatron.core.utils._te_version := {te_version} (Transformer Engine absent here)"]
    stubbed = [name for name in TE_FUSED_MOE if getattr(moe_utils, name, None) is None]
    for name in stubbed:
        setattr(moe_utils, name, lambda *args, **kwargs: None)
    if stubbed:
        done.append(f"moe_utils.{{{', '.join(stubbed)}}} := placeholders (TE's fused MoE kernels)")
    return done


def patch_arch(arguments_module, device_arch: int) -> str:
    arguments_module.get_device_arch_version = lambda: device_arch
    return f"megatron.training.arguments.get_device_arch_version := lambda: {device_arch}"


def needs_max_connections_1(args, device_arch: int) -> bool:
    """The condition in validate_args (same text at core_v0.16.1, core_v0.19.0, main)."""
    tp_or_cp = args.tensor_model_parallel_size > 1 or args.context_parallel_size > 1
    fsdp = getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)
    moe_overlap = getattr(args, "overlap_moe_expert_parallel_comm", False)
    return tp_or_cp and device_arch < 10 and not fsdp and not moe_overlap


def stage_counts(config) -> dict | None:
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None or not hasattr(layout, "layout"):
        return None
    from megatron.core.transformer.enums import LayerType

    pp = layout.pipeline_model_parallel_size
    vp = layout.virtual_pipeline_model_parallel_size
    stages = []  # vp-major: stage index = v*pp + p
    for v in range(vp):
        for p in range(pp):
            cell = layout.layout[p][v]
            stages.append({
                "pp_rank": p, "vp_stage": v,
                "decoder": cell.count(LayerType.decoder),
                "embedding": cell.count(LayerType.embedding),
                "loss": cell.count(LayerType.loss),
                "mtp": cell.count(LayerType.mtp) if hasattr(LayerType, "mtp") else 0,
            })
    return {"pp": pp, "vp": vp, "layout": str(layout), "decoder_per_stage": [s["decoder"] for s in stages],
            "stages": stages}


def jsonable(value):
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    name = getattr(value, "__name__", None)
    return name if name else str(value)


CONFIG_FIELDS = [
    # shape
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
    "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias",
    "hidden_dropout", "attention_dropout", "attention_backend", "apply_rope_fusion",
    "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "init_method_std", "apply_query_key_layer_scaling", "attention_softmax_in_fp32",
    # parallelism
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "virtual_pipeline_model_parallel_size", "sequence_parallel", "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    # mixture of experts, MLA, MTP
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_layer_freq", "moe_token_dispatcher_type", "moe_grouped_gemm", "multi_latent_attention",
    "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers",
    "microbatch_group_size_per_vp_stage", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "tp_comm_overlap", "gradient_accumulation_fusion",
    "batch_p2p_comm", "deallocate_pipeline_outputs",
    # runtime features
    "moe_flex_dispatcher_backend", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
    "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion", "moe_router_force_load_balancing",
    "moe_router_padding_for_quantization", "cuda_graph_impl", "cuda_graph_scope", "cuda_graph_modules",
    # precision
    "fp16", "bf16", "params_dtype", "pipeline_dtype", "fp8", "fp8_recipe", "fp8_margin",
    "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_param",
    "first_last_layers_bf16", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
    "fp4", "fp4_recipe",
    # memory
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "cpu_offloading", "cross_entropy_loss_fusion", "cross_entropy_fusion_impl",
    "transformer_impl",
]
OPTIM_FIELDS = ["optimizer", "lr", "min_lr", "weight_decay", "bf16", "fp16", "params_dtype",
                "use_distributed_optimizer", "use_precision_aware_optimizer", "main_grads_dtype",
                "main_params_dtype", "exp_avg_dtype", "clip_grad", "adam_beta1", "adam_beta2"]
DDP_FIELDS = ["use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
              "align_param_gather", "grad_reduce_in_fp32", "bucket_size", "average_in_collective",
              "fp8_param_gather", "data_parallel_sharding_strategy", "use_megatron_fsdp"]
ARGS_FIELDS = [
    "world_size", "data_parallel_size", "micro_batch_size", "global_batch_size",
    "seq_length", "max_position_embeddings", "position_embedding_type", "rotary_base",
    "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "untie_embeddings_and_output_weights",
    "vocab_size", "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type",
    "params_dtype", "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16",
    "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
    "align_param_gather", "overlap_p2p_comm", "tp_comm_overlap", "use_flash_attn",
    "cross_entropy_loss_fusion", "transformer_impl", "spec",
]


def run(checkout: str, tokens: list[str], *, vocab_size: int, world_size: int | None, dp: int,
        device_arch: int, max_connections: str, extra: list[str], add: bool = True,
        te_version: str = "2.12.0", env: dict | None = None) -> dict:
    checkout = os.path.abspath(checkout)
    tp = int(flag_value(tokens, "--tensor-model-parallel-size", 1))
    pp = int(flag_value(tokens, "--pipeline-model-parallel-size", 1))
    cp = int(flag_value(tokens, "--context-parallel-size", 1))
    world = world_size if world_size is not None else tp * pp * cp * dp
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["RANK"] = "0"
    os.environ["LOCAL_RANK"] = "0"
    if max_connections == "unset":
        os.environ.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    else:
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = max_connections
    for name, value in (env or {}).items():  # the rest of the plan's environment (NVTE_CPU_OFFLOAD_V1, ...)
        if name != "CUDA_DEVICE_MAX_CONNECTIONS":
            os.environ[name] = str(value)

    report: dict = {"checkout": checkout, "world_size": world, "device_arch": device_arch,
                    "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    report["shims"] = install_shims(checkout)
    sys.path.insert(0, checkout)

    try:
        from megatron.training import arguments as A  # noqa: N812
    except ModuleNotFoundError as exc:
        hint = {"triton": "pip install triton  (imported at module level: core_v0.16 custom_layers/batch_invariant_kernels.py via training/initialize.py; core_v0.19+/main also moe/ops/paged_stash.py, ssm/ops)",
                "six": "pip install six regex pyyaml pydantic  (megatron.training imports)",
                "regex": "pip install regex", "yaml": "pip install pyyaml", "pydantic": "pip install pydantic"}
        report.update(ok=False, error=f"ModuleNotFoundError: {exc} -> {hint.get(exc.name, 'install it')}",
                      traceback=traceback.format_exc(limit=-3), stdout_tail="", added_tokens=[], runtime_lint=[])
        return report
    import megatron.core

    report["megatron_core_file"] = os.path.dirname(megatron.core.__file__)
    report["megatron_core_version"] = getattr(megatron.core, "__version__", None)
    report["shims"].append(patch_arch(A, device_arch))
    if not have_te():
        report["shims"] += patch_te(te_version)
    if has_flag(tokens, "--moe-grouped-gemm"):  # validate_args asks CUDA for the GPU's compute capability
        import torch

        torch.cuda.get_device_capability = lambda *_: (device_arch, 0)
        report["shims"].append(f"torch.cuda.get_device_capability := lambda: ({device_arch}, 0) (--moe-grouped-gemm)")

    added = added_tokens(tokens + extra, vocab_size) if add else []
    argv = ["pretrain_gpt.py", *tokens, *extra, *added]
    report["added_tokens"] = added
    report["runtime_lint"] = runtime_lint(tokens + extra)
    report["argv"] = argv
    defaults = {"tokenizer_type": "GPT2BPETokenizer"}  # what pretrain_gpt.py passes
    sys.argv = argv
    log = io.StringIO()
    errlog = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(errlog):
            if hasattr(A, "parse_and_validate_args"):
                report["path"] = "parse_and_validate_args -> gpt_config_from_args"
                args = A.parse_and_validate_args(args_defaults=defaults)
                from megatron.training.argument_utils import gpt_config_from_args

                model_cfg = gpt_config_from_args(args)
                config = model_cfg.transformer
                report["model_config"] = {k: jsonable(getattr(model_cfg, k, None)) for k in (
                    "vocab_size", "should_pad_vocab", "make_vocab_size_divisible_by", "seq_length",
                    "position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling",
                    "share_embeddings_and_output_weights")}
                # pretrain_gpt.py then builds the whole container (optimizer + DDP configs too).
                from megatron.training.argument_utils import pretrain_cfg_container_from_args

                container = pretrain_cfg_container_from_args(args, model_cfg)
                optim_cfg, ddp_cfg = container.optimizer, container.ddp
            else:
                report["path"] = "parse_args -> validate_args -> set_global_variables -> core_transformer_config_from_args"
                args = A.parse_args()
                A.validate_args(args, defaults)
                from megatron.training.global_vars import set_global_variables

                set_global_variables(args)
                config = A.core_transformer_config_from_args(args)
                # pretrain() -> setup_model_and_optimizer -> get_megatron_optimizer_config(args);
                # the DDP config is built inline in get_model() (needs a model), so not here.
                from megatron.training.training import get_megatron_optimizer_config

                optim_cfg, _ = get_megatron_optimizer_config(args)
                ddp_cfg = None
    except BaseException as exc:  # AssertionError, ValueError, SystemExit from argparse...
        report["ok"] = False
        report["error"] = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, SystemExit):  # argparse: the reason is the last stderr line
            lines = [l for l in errlog.getvalue().splitlines() if l.strip()]
            report["error"] += f" ({lines[-1] if lines else 'no message'})"
        report["traceback"] = traceback.format_exc(limit=-4)
        report["stdout_tail"] = (log.getvalue() + errlog.getvalue())[-3000:]
        return report
    report["ok"] = True
    report["needs_CUDA_DEVICE_MAX_CONNECTIONS_1_before_blackwell"] = needs_max_connections_1(args, 9)
    report["args"] = {k: jsonable(getattr(args, k, None)) for k in ARGS_FIELDS}
    report["config"] = {k: jsonable(getattr(config, k, None)) for k in CONFIG_FIELDS if hasattr(config, k)}
    report["pipeline"] = stage_counts(config)
    report["optimizer_config"] = {k: jsonable(getattr(optim_cfg, k, None)) for k in OPTIM_FIELDS
                                  if hasattr(optim_cfg, k)}
    if ddp_cfg is not None:
        report["ddp_config"] = {k: jsonable(getattr(ddp_cfg, k, None)) for k in DDP_FIELDS if hasattr(ddp_cfg, k)}
    notes = (log.getvalue() + "\n" + errlog.getvalue()).splitlines()
    keep = ("WARNING", "Warning", "padded vocab", "UserWarning: Overriding", "number of microbatches")
    report["stdout_tail"] = "\n".join(dict.fromkeys(l for l in notes if any(k in l for k in keep)))[-3000:]
    return report


def _expected(plan: dict) -> dict:
    """What plan.yaml says Megatron must build."""
    best, model = plan["best"], plan["model"]
    par, train = best["parallel"], best["train"]
    vp = par["virtual_pipeline_model_parallel_size"]
    recompute = train["recompute_granularity"]
    return {
        "num_layers": model["num_layers"], "hidden_size": model["hidden_size"],
        "ffn_hidden_size": model["ffn_hidden_size"], "num_attention_heads": model["num_attention_heads"],
        "num_query_groups": model["num_query_groups"],
        "kv_channels": model["kv_channels"] or model["hidden_size"] // model["num_attention_heads"],
        "gated_linear_unit": model["activation"] == "swiglu",
        "normalization": "RMSNorm" if model["activation"] == "swiglu" else "LayerNorm",
        "add_bias_linear": (model["activation"] == "gelu" if model.get("add_bias_linear") is None
                            else bool(model["add_bias_linear"])),
        # Megatron-LM keeps the QKV bias in step with add_bias_linear (validate_args)
        "add_qkv_bias": bool(model.get("add_qkv_bias")) or (model["activation"] == "gelu" if model.get(
            "add_bias_linear") is None else bool(model["add_bias_linear"])),
        "use_rope_scaling": bool(model.get("use_rope_scaling")),
        **({"rope_scaling_factor": float(model["rope_scaling_factor"])} if model.get("use_rope_scaling") else {}),
        "tensor_model_parallel_size": par["tensor_model_parallel_size"],
        "pipeline_model_parallel_size": par["pipeline_model_parallel_size"],
        "virtual_pipeline_model_parallel_size": vp if vp > 1 else None,
        "context_parallel_size": par["context_parallel_size"],
        "sequence_parallel": par["sequence_parallel"] and par["tensor_model_parallel_size"] > 1,
        "bf16": train["precision"] in ("bf16", "fp8"), "fp16": train["precision"] == "fp16",
        **({"fp8": "e4m3" if train["fp8_recipe"] == "mxfp8" else "hybrid", "fp8_recipe": train["fp8_recipe"],
            "fp8_param": train["fp8_param_gather"]} if train["precision"] == "fp8" else {"fp8": None}),
        "tp_comm_overlap": bool(par.get("tp_comm_overlap", False)),
        "recompute_granularity": None if recompute == "none" else recompute,
        "seq_length": train["seq_length"], "micro_batch_size": train["micro_batch_size"],
        "global_batch_size": train["global_batch_size"],
        "untie_embeddings_and_output_weights": model["untie_embeddings_and_output_weights"],
        "decoder_per_stage": best["decoder_layers_per_stage"],
        **_expected_moe(model, par),
    }


def _expected_moe(model: dict, par: dict) -> dict:
    """The experts, MLA and MTP plan.yaml asks for (nothing for a dense model without them)."""
    out: dict = {}
    if model.get("multi_latent_attention"):
        out.update({key: model[key] for key in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                                "v_head_dim")}, multi_latent_attention=True)
        out.pop("num_query_groups", None)
    if model.get("mtp_num_layers"):
        out["mtp_num_layers"] = model["mtp_num_layers"]
    if model.get("num_moe_experts"):
        freq = model.get("moe_layer_freq") or []
        out.update(
            num_moe_experts=model["num_moe_experts"], moe_router_topk=model["moe_router_topk"],
            moe_ffn_hidden_size=model["moe_ffn_hidden_size"] or model["ffn_hidden_size"],
            moe_shared_expert_intermediate_size=model["moe_shared_expert_intermediate_size"] or None,
            moe_layer_freq=1 if all(freq) else [int(v) for v in freq],
            expert_model_parallel_size=par["expert_model_parallel_size"],
            expert_tensor_parallel_size=par["expert_tensor_parallel_size"],
            moe_token_dispatcher_type=par["moe_token_dispatcher_type"], moe_grouped_gemm=True,
        )
        out.update({key: par[key] for key in FEATURE_FIELDS if key in par})
        if par.get("moe_token_dispatcher_type") != "flex":
            out.pop("moe_flex_dispatcher_backend", None)  # unused by the other dispatchers
    if par.get("cuda_graph_impl", "none") != "none":
        out.update(cuda_graph_impl=par["cuda_graph_impl"], cuda_graph_scope=list(par.get("cuda_graph_scope") or []))
    return out


FEATURE_FIELDS = ("moe_flex_dispatcher_backend", "overlap_moe_expert_parallel_comm", "delay_wgrad_compute",
                  "moe_shared_expert_overlap", "moe_permute_fusion", "moe_router_fusion",
                  "moe_router_force_load_balancing", "moe_router_padding_for_quantization")
"""plan.yaml's runtime features that TransformerConfig carries under the same name."""


def _plain(value):
    """A TransformerConfig value (as :func:`jsonable` wrote it) in plan.yaml's terms: enums by member name
    (``CudaGraphScope.attn`` -> ``attn``), lists of them as lists of names."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, str) and "." in value and value[:1].isupper() and value.count(".") == 1:
        return value.split(".")[1]
    return value


def _compare(report: dict, expected: dict) -> list[str]:
    got = {**(report.get("args") or {}), **(report.get("config") or {})}
    got["decoder_per_stage"] = (report.get("pipeline") or {}).get("decoder_per_stage")
    if got.get("virtual_pipeline_model_parallel_size") in (None, 1):
        got["virtual_pipeline_model_parallel_size"] = None
    got["gated_linear_unit"] = bool(got.get("gated_linear_unit"))
    differ = []
    for key, want in expected.items():
        have = _plain(got.get(key))
        if key == "cuda_graph_scope" and have is None:
            have = _plain(got.get("cuda_graph_modules"))  # its name from megatron-core 0.19
        if isinstance(want, float) or isinstance(have, float):
            same = have is not None and abs(float(have) - float(want)) <= 1e-9 * max(1.0, abs(float(want)))
        else:
            same = have == want
        if not same:
            differ.append(f"{key}: Megatron {have!r}, plan {want!r}")
    return differ


def check_plan_dir(checkout: str, plan_dir: str, te_version: str = "2.12.0") -> bool:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from megapipe.plandir import read_plan

    plan = read_plan(plan_dir)
    emitted = plan.get("emitted")
    if not emitted:
        print(f"{plan_dir}: no Megatron arguments (a what-if plan); nothing to check")
        return False
    with open(os.path.join(plan_dir, "megatron_args.txt"), encoding="utf-8") as handle:
        tokens = shlex.split(handle.read())
    gpu = plan["cluster"]["node_groups"][0]["gpu"]
    arch = _ARCH.get(gpu.get("architecture", ""), 9)
    best = plan["best"]
    report = run(checkout, tokens, vocab_size=plan["model"]["vocab_size"], world_size=plan["cluster"]["num_gpus"],
                 dp=best["parallel"]["data_parallel_size"], device_arch=arch,
                 max_connections=emitted.get("megatron_env", {}).get("CUDA_DEVICE_MAX_CONNECTIONS", "unset"),
                 extra=[], te_version=te_version, env=emitted.get("megatron_env", {}))
    print(f"== {plan_dir}  ({report.get('megatron_core_version')} at {checkout}; {report.get('path')})")
    print(f"   env CUDA_DEVICE_MAX_CONNECTIONS={report['CUDA_DEVICE_MAX_CONNECTIONS']}, device arch {arch}, "
          f"WORLD_SIZE={report['world_size']}; added: {' '.join(report.get('added_tokens', []))}")
    for shim in report.get("shims", []):
        print(f"   shim: {shim}")
    if not report.get("ok"):
        print(f"   REFUSED: {report.get('error')}")
        return False
    differ = _compare(report, _expected(plan))
    for line in differ:
        print(f"   DIFFERS {line}")
    print(f"   ACCEPTED; {'agrees with plan.yaml' if not differ else f'{len(differ)} fields differ'}: "
          f"{report['pipeline']['decoder_per_stage'] if report.get('pipeline') else '-'} decoder layers per stage, "
          f"padded vocabulary {report['args'].get('padded_vocab_size')}")
    return not differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", required=True, help="a Megatron-LM checkout (holding megatron/ and pretrain_gpt.py)")
    parser.add_argument("--te-version", default="2.12.0",
                        help="the Transformer Engine version Megatron's checks see when TE is not installed here "
                             "(default 2.12.0: the most megapipe's plans state they need, delayed wgrad under an attn CUDA graph)")
    parser.add_argument("plan_dirs", nargs="+")
    opts = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(opts.megatron, "megatron", "training", "arguments.py")):
        print(f"not a Megatron-LM checkout: {opts.megatron}", file=sys.stderr)
        return 2
    if len(opts.plan_dirs) == 1:
        return 0 if check_plan_dir(opts.megatron, opts.plan_dirs[0], opts.te_version) else 1
    # Megatron keeps its parsed arguments in globals: one process per plan dir.
    import subprocess

    results = [subprocess.run([sys.executable, __file__, "--megatron", opts.megatron, "--te-version", opts.te_version,
                               plan_dir]).returncode == 0
               for plan_dir in opts.plan_dirs]
    print(f"{sum(results)} of {len(results)} plan dirs accepted by Megatron-LM and in agreement with plan.yaml")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
