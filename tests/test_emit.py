"""Emitters: golden argument files, megatron-core's own layout parser, Hydra's override parser."""

from __future__ import annotations

import dataclasses
import os
import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megapipe.emit import (
    BridgeKeys,
    bridge_settings,
    decoder_counts,
    decoder_offsets,
    emit,
    equal_stage_kinds,
    launch_script,
    is_equal_split,
    nemo1_settings,
    nemo2_settings,
    rank_of_stage,
    shell_join,
)
from megapipe.errors import ConfigError
from megapipe.layout import format_layout, parse_layout
from megapipe.records import Activation, GpuSpec, LayerKind, ModelSpec, ParallelSpec, Partition, Recompute, TrainSpec

E, T, M, L = LayerKind.embedding, LayerKind.decoder, LayerKind.mtp, LayerKind.loss
PARSER = OverridesParser.create()
GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
H100 = GpuSpec(name="h100_80gb", bf16_tflops=989.4, hbm_gbytes_per_s=3350, memory_gib=79.6, architecture="hopper")
B200 = GpuSpec(name="b200_192gb", bf16_tflops=2250, hbm_gbytes_per_s=8000, memory_gib=178.8, architecture="blackwell")
LLAMA3_70B = ModelSpec(name="llama3_70b", num_layers=80, hidden_size=8192, num_attention_heads=64, num_query_groups=8,
                       ffn_hidden_size=28672, vocab_size=128256, seq_length=8192, rotary_base=500000.0)
GPT3_175B = ModelSpec(name="gpt3_175b", num_layers=96, hidden_size=12288, num_attention_heads=96, num_query_groups=96,
                      ffn_hidden_size=49152, vocab_size=51200, seq_length=2048, activation=Activation.gelu,
                      untie_embeddings_and_output_weights=False, position_embedding_type="learned_absolute")
SMALL = ModelSpec(name="small", num_layers=40, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                  ffn_hidden_size=4096, vocab_size=32000, seq_length=2048)


def emit_for(partition: Partition, parallel: ParallelSpec, train: TrainSpec, *, model: ModelSpec | None = None,
             gpu: GpuSpec = H100, bridge_keys: BridgeKeys = BridgeKeys.flat):
    """emit() for a model whose layer counts are the partition's (SMALL's shape otherwise)."""
    flat = [kind for kinds in partition.stage_kinds for kind in kinds]
    model = model or dataclasses.replace(SMALL, num_layers=flat.count(T), mtp_num_layers=flat.count(M))
    return emit(partition=partition, parallel=parallel, train=train, model=model,
                gpus=(gpu,) * parallel.pipeline_model_parallel_size, bridge_keys=bridge_keys)


def make_partition(stage_kinds, *, pp: int, vp: int = 1, schedule: str | None = None) -> Partition:
    stage_kinds = tuple(tuple(kinds) for kinds in stage_kinds)
    n = len(stage_kinds)
    return Partition(
        entries_per_stage=tuple(len(kinds) for kinds in stage_kinds),
        stage_kinds=stage_kinds,
        stage_time_ms=(1.0,) * n,
        stage_static_bytes=(0.0,) * n,
        stage_act_bytes=(0.0,) * n,
        stage_in_flight=(1,) * n,
        stage_memory_bytes=(0.0,) * n,
        layout=format_layout(stage_kinds),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        schedule=schedule or ("interleaved_1f1b" if vp > 1 else "1f1b"),
    )


@pytest.fixture(scope="module")
def vp_world_size():
    """assert_megatron_reads sets megatron-core's global virtual world size; restore it afterwards."""
    yield
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


def assert_megatron_reads(layout: str, stage_kinds, *, pp: int, vp: int) -> None:
    """megatron-core parses the string and builds the planned counts/offsets on every (pp_rank, vp_stage).

    Its layout methods silently use vp_stage=0 unless the virtual world size is set.
    """
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    flat = [kind for kinds in stage_kinds for kind in kinds]
    for parsed in (PipelineParallelLayerLayout.from_str(layout, pp), PipelineParallelLayerLayout(layout, pp)):
        assert parsed.virtual_pipeline_model_parallel_size == vp
        parsed.validate_layer_layout(num_layers=flat.count(T), mtp_num_layers=flat.count(M) or None)
        counts, offsets = decoder_counts(stage_kinds), decoder_offsets(stage_kinds)
        for index in range(pp * vp):
            pp_rank, vp_stage = rank_of_stage(index, pipeline_model_parallel_size=pp)
            kwargs = dict(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
            assert parsed.get_num_layers_to_build(**kwargs) == counts[index]
            assert parsed.get_layer_offset(**kwargs) == offsets[index]
            assert parsed.layout[pp_rank][vp_stage].count(LayerType.embedding) == stage_kinds[index].count(E)
            assert parsed.layout[pp_rank][vp_stage].count(LayerType.loss) == stage_kinds[index].count(L)


def assert_hydra_reads(overrides, expected: dict[str, object]) -> None:
    """Every override line parses with Hydra's own parser and gives back the intended value."""
    assert len(overrides) == len(expected)
    for line, (key, value) in zip(overrides, expected.items(), strict=True):
        (parsed,) = PARSER.parse_overrides([line])
        assert parsed.key_or_group == key.lstrip("+")
        assert parsed.value() == value and type(parsed.value()) is type(value)


def assert_shell_reads(command: str, tokens) -> None:
    assert shlex.split(command) == list(tokens)


# ---------------------------------------------------------------- golden strings

UNEVEN = parse_layout("Et*9|t*11|t*11|t*9L")
TP4_PP4 = ParallelSpec(tensor_model_parallel_size=4, pipeline_model_parallel_size=4, sequence_parallel=True)
TRAIN_FULL = TrainSpec(micro_batch_size=1, global_batch_size=512, recompute_granularity=Recompute.full)


GOLDEN_CASES = {
    # Llama 3 70B on H100, TP4 PP8 uneven, full recompute, bf16: CUDA_DEVICE_MAX_CONNECTIONS is needed.
    "llama3_70b_tp4pp8": dict(
        stages=parse_layout("Et*9|t*10|t*10|t*10|t*10|t*10|t*11|t*10L"), model=LLAMA3_70B, gpu=H100,
        parallel=ParallelSpec(tensor_model_parallel_size=4, pipeline_model_parallel_size=8, data_parallel_size=4,
                              sequence_parallel=True),
        train=TrainSpec(micro_batch_size=1, global_batch_size=256, seq_length=8192,
                        recompute_granularity=Recompute.full)),
    # GPT-3 175B on B200 (no env needed), interleaved with a microbatch group, selective, no distributed optimizer.
    "gpt3_175b_tp8pp4vp2": dict(
        stages=parse_layout("Et*11|t*12|t*12|t*12|t*12|t*12|t*12|t*13L"), model=GPT3_175B, gpu=B200,
        parallel=ParallelSpec(tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                              virtual_pipeline_model_parallel_size=2, data_parallel_size=8, sequence_parallel=True,
                              use_distributed_optimizer=False, microbatch_group_size_per_vp_stage=8),
        train=TrainSpec(micro_batch_size=2, global_batch_size=512, seq_length=2048,
                        recompute_granularity=Recompute.selective, precision="fp16")),
}


def _golden_files(name: str) -> dict[str, str]:
    case = GOLDEN_CASES[name]
    parallel = case["parallel"]
    part = make_partition(case["stages"], pp=parallel.pipeline_model_parallel_size,
                          vp=parallel.virtual_pipeline_model_parallel_size)
    flat = emit_for(part, parallel, case["train"], model=case["model"], gpu=case["gpu"])
    nested = emit_for(part, parallel, case["train"], model=case["model"], gpu=case["gpu"], bridge_keys=BridgeKeys.nested)
    return {
        "megatron_args.txt": flat.megatron_command + "\n",
        "bridge_overrides.txt": flat.bridge_command + "\n",
        "bridge_overrides_nested.txt": nested.bridge_command + "\n",
        "nemo2_overrides.txt": flat.nemo2_command + "\n",
        "nemo1_overrides.txt": flat.nemo1_command + "\n",
        "launch_megatron.sh": launch_script(flat, gpus_per_node=8, num_nodes=16, vocab_size=case["model"].vocab_size),
    }


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_argument_files(name):
    """The complete files of the plan dir, byte for byte (regenerate: MEGAPIPE_WRITE_GOLDEN=1)."""
    for file_name, text in _golden_files(name).items():
        path = os.path.join(GOLDEN, f"emit_{name}", file_name)
        if os.environ.get("MEGAPIPE_WRITE_GOLDEN"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
        with open(path, encoding="utf-8") as handle:
            assert text == handle.read(), (name, file_name)


def test_golden_files_parse_back():
    """Each file reads back: the shell gives the argv tokens, Hydra gives typed values, bash accepts the script."""
    import subprocess

    for name in GOLDEN_CASES:
        files = _golden_files(name)
        tokens = shlex.split(files["megatron_args.txt"])
        assert tokens[tokens.index("--num-layers") + 1] == str(GOLDEN_CASES[name]["model"].num_layers)
        for file_name in ("bridge_overrides.txt", "bridge_overrides_nested.txt", "nemo2_overrides.txt",
                          "nemo1_overrides.txt"):
            PARSER.parse_overrides(shlex.split(files[file_name]))
        assert subprocess.run(["bash", "-n"], input=files["launch_megatron.sh"], text=True).returncode == 0


def test_precision_shape_and_environment():
    case = GOLDEN_CASES["llama3_70b_tp4pp8"]
    part = make_partition(case["stages"], pp=8)
    out = emit_for(part, case["parallel"], case["train"], model=LLAMA3_70B, gpu=H100)
    args = out.megatron_args
    for flag in ("--bf16", "--swiglu", "--group-query-attention", "--untie-embeddings-and-output-weights",
                 "--disable-bias-linear", "--overlap-grad-reduce", "--overlap-param-gather"):
        assert flag in args
    assert args[args.index("--rotary-base") + 1] == "500000"  # Megatron's parser takes an int
    assert dict(out.megatron_env) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert "++env_vars.CUDA_DEVICE_MAX_CONNECTIONS='1'" in out.bridge_overrides
    assert "mixed_precision=bf16_mixed" in out.bridge_overrides
    assert "trainer.plugins.precision=bf16-mixed" in out.nemo2_overrides
    blackwell = emit_for(part, case["parallel"], case["train"], model=LLAMA3_70B, gpu=B200)
    assert blackwell.megatron_env == ()
    fp32 = emit_for(part, case["parallel"], TrainSpec(global_batch_size=256, precision="fp32"), model=LLAMA3_70B)
    assert not {"--bf16", "--fp16"} & set(fp32.megatron_args)
    single = ParallelSpec(pipeline_model_parallel_size=8, data_parallel_size=16)
    assert emit_for(part, single, case["train"], model=LLAMA3_70B).megatron_env == ()


def test_fp8_and_tp_overlap_for_every_front_end():
    case = GOLDEN_CASES["llama3_70b_tp4pp8"]
    part = make_partition(case["stages"], pp=8)
    parallel = dataclasses.replace(case["parallel"], tp_comm_overlap=True)
    tensorwise = dataclasses.replace(case["train"], precision="fp8", fp8_recipe="tensorwise", fp8_param_gather=True)
    out = emit_for(part, parallel, tensorwise, model=LLAMA3_70B, gpu=H100)
    args = list(out.megatron_args)
    assert args[args.index("--fp8-format") + 1] == "hybrid" and args[args.index("--fp8-recipe") + 1] == "tensorwise"
    assert {"--bf16", "--fp8-param-gather", "--tp-comm-overlap"} <= set(args)
    assert "mixed_precision=bf16_with_fp8_current_scaling_mixed" in out.bridge_overrides
    assert {"trainer.plugins.fp8=hybrid", "trainer.plugins.fp8_recipe=tensorwise",
            "trainer.plugins.fp8_param_gather=true"} <= set(out.nemo2_overrides)
    assert {"model.fp8=true", "model.fp8_params=true", "model.ub_tp_comm_overlap=true"} <= set(out.nemo1_overrides)
    assert any("first and last decoder layers in bf16" in w for w in out.warnings)
    assert any("delayed scaling only" in w for w in out.warnings)
    assert any("comm_overlap" in w for w in out.warnings) and any("MegatronCommOverlapCallback" in w for w in out.warnings)
    mxfp8 = dataclasses.replace(tensorwise, fp8_recipe="mxfp8", fp8_param_gather=False)
    out = emit_for(part, case["parallel"], mxfp8, model=LLAMA3_70B, gpu=B200)
    args = list(out.megatron_args)
    assert args[args.index("--fp8-format") + 1] == "e4m3" and "--fp8-param-gather" not in args
    assert "--tp-comm-overlap" not in args
    assert "mixed_precision=bf16_with_mxfp8_mixed" in out.bridge_overrides
    assert any("sets fp8_param_gather=True, the plan fp8_param_gather=False" in w for w in out.warnings)
    # NeMo 1 has delayed scaling only: model.fp8_hybrid=true next to an MXFP8 plan cannot run as planned
    assert "model.fp8_hybrid=true" in out.nemo1_overrides
    (reason,) = out.nemo1_unrunnable
    assert "fp8_recipe=mxfp8 cannot be expressed" in reason and reason in out.warnings
    delayed = dataclasses.replace(mxfp8, fp8_recipe="delayed")
    assert emit_for(part, case["parallel"], delayed, model=LLAMA3_70B, gpu=H100).nemo1_unrunnable == ()
    no_sp = dataclasses.replace(parallel, sequence_parallel=False)
    assert "--tp-comm-overlap" not in emit_for(part, no_sp, case["train"], model=LLAMA3_70B).megatron_args


def test_memory_settings_for_every_front_end():
    """Megatron FSDP, the precision-aware optimizer, optimizer and activation offloading in each target's names;
    what a target cannot take is flagged NOT EMITTED."""
    case = GOLDEN_CASES["llama3_70b_tp4pp8"]
    part = make_partition(case["stages"], pp=8)
    features = dataclasses.replace(case["parallel"].features, fine_grained_activation_offloading=True,
                                   offload_modules=("core_attn", "attn_proj"))
    parallel = dataclasses.replace(case["parallel"], use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads",
                                   features=features)
    train = dataclasses.replace(case["train"], use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                                exp_avg_sq_dtype="bf16", optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    out = emit_for(part, parallel, train, model=LLAMA3_70B, gpu=H100)
    args = list(out.megatron_args)
    assert args[args.index("--data-parallel-sharding-strategy") + 1] == "optim_grads"
    assert args[args.index("--ckpt-format") + 1] == "fsdp_dtensor"
    assert {"--use-megatron-fsdp", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
            "--fine-grained-activation-offloading"} <= set(args)
    assert args[args.index("--exp-avg-dtype") + 1] == "bf16"
    assert args[args.index("--optimizer-offload-fraction") + 1] == "0.5"
    assert args[args.index("--offload-modules") + 1:args.index("--offload-modules") + 3] == ["core_attn", "attn_proj"]
    env = dict(out.megatron_env)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] != "1" and env["NVTE_CPU_OFFLOAD_V1"] == "1"  # FSDP refuses 1
    assert {"ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads",
            "checkpoint.ckpt_format=fsdp_dtensor", "optimizer.exp_avg_dtype=bf16",
            "optimizer.optimizer_offload_fraction=0.5", "model.fine_grained_activation_offloading=true"} \
        <= set(out.bridge_overrides)
    assert {"trainer.strategy.fsdp=megatron", "optim.config.use_precision_aware_optimizer=true",
            "model.config.fine_grained_activation_offloading=true"} <= set(out.nemo2_overrides)
    not_emitted = [w for w in out.warnings if w.startswith("NOT EMITTED")]
    assert any("Megatron FSDP for NeMo 1" in w for w in not_emitted)
    assert any("optimizer_cpu_offload for NeMo 1" in w for w in not_emitted)
    assert any("fine-grained activation offloading for NeMo 1" in w for w in not_emitted)
    assert any("optim.config.exp_avg_dtype=bf16" in w for w in out.warnings)  # NeMo 2 cannot spell torch dtypes
    for line in (*out.bridge_overrides, *out.nemo2_overrides):
        PARSER.parse_overrides([line])
    # NeMo 1's apex optimizer keeps one state dtype; the dev branch's state offloading goes nowhere
    state = dataclasses.replace(case["train"], use_precision_aware_optimizer=True, main_params_dtype="bf16",
                                exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", offload_optimizer_states=True)
    out = emit_for(part, case["parallel"], state, model=LLAMA3_70B, gpu=H100)
    assert "model.optim.dtype=bf16" in out.nemo1_overrides and "--main-params-dtype" not in out.megatron_args
    assert any(w.startswith("NOT EMITTED: offload_optimizer_states") for w in out.warnings)
    assert any(w.startswith("NOT EMITTED: main_params_dtype=bf16") for w in out.warnings)
    plain = emit_for(part, case["parallel"], case["train"], model=LLAMA3_70B, gpu=H100)
    assert not {"--use-megatron-fsdp", "--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                "--fine-grained-activation-offloading"} & set(plain.megatron_args)


def test_bridge_nested_keys_keep_model_fields_outside_the_transformer():
    case = GOLDEN_CASES["llama3_70b_tp4pp8"]
    part = make_partition(case["stages"], pp=8)
    out = emit_for(part, case["parallel"], case["train"], model=LLAMA3_70B, bridge_keys=BridgeKeys.nested)
    keys = [line.split("=", 1)[0] for line in out.bridge_overrides]
    assert "model.transformer.num_layers" in keys and "model.transformer.pipeline_model_parallel_layout" in keys
    assert "model.seq_length" in keys and "model.vocab_size" in keys and "model.rotary_base" in keys
    assert not any(key.startswith("model.transformer.") and key.split(".")[-1] in ("seq_length", "vocab_size")
                   for key in keys)


def test_what_if_schedules_are_not_emitted():
    stages = parse_layout("Et*2|t*2|t*2|t*2L")
    with pytest.raises(ConfigError, match="what-if: megatron-core has no zb_h1"):
        emit_for(make_partition(stages, pp=4, schedule="zb_h1"), ParallelSpec(pipeline_model_parallel_size=4),
                 TrainSpec())


def test_recompute_none_is_omitted_for_megatron_and_null_elsewhere():
    out = emit_for(make_partition(UNEVEN, pp=4), TP4_PP4, TrainSpec())
    assert not any(arg.startswith("--recompute") for arg in out.megatron_args)
    assert "model.recompute_granularity=null" in out.bridge_overrides
    assert "model.activations_checkpoint_granularity=null" in out.nemo1_overrides


def test_nemo1_warns_on_uneven_split_only():
    uneven = emit_for(make_partition(UNEVEN, pp=4), TP4_PP4, TrainSpec())
    (warning,) = uneven.warnings
    assert "cannot be expressed" in warning and "9/11/11/9" in warning and "10 decoder layers" in warning
    assert uneven.nemo1_unrunnable == ()  # it runs, split equally
    even = parse_layout("Et*10|t*10|t*10|t*10L")
    assert emit_for(make_partition(even, pp=4), TP4_PP4, TrainSpec()).warnings == ()
    odd = parse_layout("Et*10|t*10|t*10|t*11L")
    out = emit_for(make_partition(odd, pp=4), TP4_PP4, TrainSpec())
    (warning,) = out.warnings
    assert "will reject" in warning
    assert out.nemo1_unrunnable == ("num_layers=41 does not divide over 4 model chunks (no layout key), so NeMo 1 "
                                    "rejects these overrides",)


def test_sequence_parallel_without_tensor_parallel_is_dropped_with_warning():
    parallel = ParallelSpec(pipeline_model_parallel_size=4, sequence_parallel=True)
    out = emit_for(make_partition(parse_layout("Et*2|t*2|t*2|t*2L"), pp=4), parallel, TrainSpec())
    assert "--sequence-parallel" not in out.megatron_args
    assert any("sequence_parallel" in warning for warning in out.warnings)


def test_as_dict_is_json_ready():
    import json

    out = emit_for(make_partition(UNEVEN, pp=4), TP4_PP4, TRAIN_FULL)
    data = json.loads(json.dumps(out.as_dict()))
    assert data["layout"] == out.layout and data["megatron_args"] == list(out.megatron_args)
    assert shlex.split(data["bridge_command"]) == data["bridge_overrides"]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("layout", "pp", "vp", "match"),
    [
        ("Et*4||t*4L", 3, 1, "#1852"),
        ("Et*4|t*4L", 4, 1, "needs 4"),
        ("t*4|Et*4L", 2, 1, "start with exactly one embedding"),
        ("Et*4L|t*4", 2, 1, "end with exactly one loss"),
        ("Et*4|mtL", 2, 1, "follows an MTP layer"),
        ("Et*4|t*2m|m|L", 2, 2, "split over stages"),
        ("Et*4|t*4|m|L", 2, 2, "first pipeline rank"),
        ("Et*4|t*4L", 1, 2, "needs pipeline_model_parallel_size > 1"),
    ],
)
def test_invalid_layouts_raise_config_error(layout, pp, vp, match):
    with pytest.raises(ConfigError, match=match):
        emit_for(partition=make_partition(parse_layout(layout), pp=pp, vp=vp),
             parallel=ParallelSpec(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp),
             train=TrainSpec())  # fmt: skip


def test_partition_for_other_sizes_raises():
    with pytest.raises(ConfigError, match="re-partition"):
        emit_for(partition=make_partition(UNEVEN, pp=4), parallel=ParallelSpec(pipeline_model_parallel_size=2),
             train=TrainSpec())  # fmt: skip


def test_zero_decoder_stages_with_embedding_or_loss_are_emitted(vp_world_size):
    """E alone and L alone are valid megatron-core stages; only a stage with nothing is refused."""
    for layout in ("E|t*4|t*4L", "Et*4|t*4|L"):
        stages = parse_layout(layout)
        out = emit_for(partition=make_partition(stages, pp=3), parallel=ParallelSpec(pipeline_model_parallel_size=3),
                   train=TrainSpec())  # fmt: skip
        assert_megatron_reads(out.layout, stages, pp=3, vp=1)


# ---------------------------------------------------------------- equal split vs megatron-core


@pytest.mark.parametrize(("num_layers", "pp", "vp"), [(8, 2, 1), (8, 4, 2), (12, 2, 3), (6, 3, 1)])
def test_equal_split_matches_megatron_default(num_layers, pp, vp):
    """Megatron-core's no-layout branch (explicit pp_rank) builds exactly the equal split's counts."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=2, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
    )  # fmt: skip
    stages = equal_stage_kinds(num_layers=num_layers, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp)  # fmt: skip
    for index, count in enumerate(decoder_counts(stages)):
        pp_rank, vp_stage = rank_of_stage(index, pipeline_model_parallel_size=pp)
        assert get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank) == count
    assert is_equal_split(stages, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    assert equal_stage_kinds(num_layers=num_layers + 1, pipeline_model_parallel_size=pp * vp) is None


# ---------------------------------------------------------------- property: random partitions round-trip


@st.composite
def partitions(draw):
    pp = draw(st.integers(1, 8))
    vp = draw(st.integers(1, 3)) if pp > 1 else 1  # Megatron-LM interleaves only with pp > 1
    n = pp * vp
    counts = [draw(st.integers(0 if i in (0, n - 1) else 1, 12)) for i in range(n)]
    mtp = draw(st.integers(0, 2)) if counts[-1] > 0 else 0
    stages = [[T] * count for count in counts]
    stages[0].insert(0, E)
    stages[-1].extend([M] * mtp + [L])
    return tuple(tuple(stage) for stage in stages), pp, vp


@settings(max_examples=150, deadline=None)
@given(
    partitions(),
    st.sampled_from(list(Recompute)),
    st.integers(1, 8),
    st.booleans(),
    st.booleans(),
)
def test_random_partitions_round_trip(vp_world_size, case, recompute, tp, sequence_parallel, distributed):
    stages, pp, vp = case
    parallel = ParallelSpec(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=sequence_parallel, use_distributed_optimizer=distributed,
    )  # fmt: skip
    train = TrainSpec(micro_batch_size=2, global_batch_size=8 * pp, recompute_granularity=recompute)
    out = emit_for(make_partition(stages, pp=pp, vp=vp), parallel, train)
    assert parse_layout(out.layout) == stages
    assert_megatron_reads(out.layout, stages, pp=pp, vp=vp)
    args = out.megatron_args
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == out.layout
    assert_shell_reads(out.megatron_command, args)
    env = dict(out.megatron_env)
    flat = [kind for kinds in stages for kind in kinds]
    model = dataclasses.replace(SMALL, num_layers=flat.count(T), mtp_num_layers=flat.count(M))
    assert_hydra_reads(out.bridge_overrides, bridge_settings(layout=out.layout, parallel=parallel, train=train,
                                                             model=model, env=env))
    assert_hydra_reads(out.nemo2_overrides, nemo2_settings(layout=out.layout, parallel=parallel, train=train,
                                                           model=model))
    assert_hydra_reads(out.nemo1_overrides, nemo1_settings(parallel=parallel, train=train, model=model))
    for tokens in (out.bridge_overrides, out.nemo2_overrides, out.nemo1_overrides):
        assert_shell_reads(shell_join(tokens), tokens)
    uneven = not is_equal_split(stages, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    assert uneven == any("no per-stage key" in warning for warning in out.warnings)
