"""Emitters: golden strings, megatron-core's own layout parser, Hydra's override parser."""

from __future__ import annotations

import shlex

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

from megapipe.emit import (
    bridge_settings,
    decoder_counts,
    decoder_offsets,
    emit,
    equal_stage_kinds,
    is_equal_split,
    nemo1_settings,
    nemo2_settings,
    rank_of_stage,
    shell_join,
)
from megapipe.errors import ConfigError
from megapipe.layout import format_layout, parse_layout
from megapipe.records import LayerKind, ParallelSpec, Partition, Recompute, TrainSpec

E, T, M, L = LayerKind.embedding, LayerKind.decoder, LayerKind.mtp, LayerKind.loss
PARSER = OverridesParser.create()


def make_partition(stage_kinds, *, pp: int, vp: int = 1, schedule: str | None = None) -> Partition:
    stage_kinds = tuple(tuple(kinds) for kinds in stage_kinds)
    n = len(stage_kinds)
    return Partition(
        layers_per_stage=tuple(len(kinds) for kinds in stage_kinds),
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


def test_golden_megatron_uneven_full_recompute():
    out = emit(partition=make_partition(UNEVEN, pp=4), parallel=TP4_PP4, train=TRAIN_FULL)
    assert out.layout == "Et*9|t*11|t*11|t*9L"
    assert out.megatron_command == (
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
        "--pipeline-model-parallel-layout 'Et*9|t*11|t*11|t*9L' --context-parallel-size 1 --sequence-parallel "
        "--micro-batch-size 1 --global-batch-size 512 --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1 --use-distributed-optimizer"
    )
    assert_shell_reads(out.megatron_command, out.megatron_args)


def test_golden_bridge_and_nemo_interleaved_selective():
    stages = parse_layout("Et*3|t*4|t*4|t*3|t*3|t*4|t*4|t*3L")
    parallel = ParallelSpec(
        tensor_model_parallel_size=2, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2,
        context_parallel_size=2, use_distributed_optimizer=False, microbatch_group_size_per_vp_stage=4,
    )  # fmt: skip
    train = TrainSpec(micro_batch_size=2, global_batch_size=64, recompute_granularity=Recompute.selective)
    out = emit(partition=make_partition(stages, pp=4, vp=2), parallel=parallel, train=train)
    assert out.megatron_args == (
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
        "--pipeline-model-parallel-layout", "Et*3|t*4|t*4|t*3|t*3|t*4|t*4|t*3L",
        "--microbatch-group-size-per-virtual-pipeline-stage", "4", "--context-parallel-size", "2",
        "--micro-batch-size", "2", "--global-batch-size", "64", "--recompute-granularity", "selective",
    )  # fmt: skip
    assert "--num-virtual-stages-per-pipeline-rank" not in out.megatron_args  # exclusive with a layout
    assert out.bridge_overrides[:4] == (
        "model.tensor_model_parallel_size=2",
        "model.pipeline_model_parallel_size=4",
        "model.virtual_pipeline_model_parallel_size=2",
        "model.pipeline_model_parallel_layout='Et*3|t*4|t*4|t*3|t*3|t*4|t*4|t*3L'",
    )
    assert "train.global_batch_size=64" in out.bridge_overrides
    assert "model.recompute_method=null" in out.bridge_overrides
    assert "trainer.strategy.pipeline_model_parallel_layout='Et*3|t*4|t*4|t*3|t*3|t*4|t*4|t*3L'" in out.nemo2_overrides
    assert "trainer.strategy.microbatch_group_size_per_vp_stage=4" in out.nemo2_overrides
    assert out.nemo1_overrides == (
        "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=4",
        "model.virtual_pipeline_model_parallel_size=2", "++model.context_parallel_size=2",
        "model.sequence_parallel=false", "model.micro_batch_size=2", "model.global_batch_size=64",
        "model.activations_checkpoint_granularity=selective", "model.activations_checkpoint_method=null",
        "model.activations_checkpoint_num_layers=null",
    )  # fmt: skip
    assert out.bridge_command.split(" ")[3] == "\"model.pipeline_model_parallel_layout='Et*3|t*4|t*4|t*3|t*3|t*4|t*4|t*3L'\""
    for tokens, command in [(out.bridge_overrides, out.bridge_command), (out.nemo2_overrides, out.nemo2_command)]:
        assert_shell_reads(command, tokens)


def test_recompute_none_is_omitted_for_megatron_and_null_elsewhere():
    out = emit(partition=make_partition(UNEVEN, pp=4), parallel=TP4_PP4, train=TrainSpec())
    assert not any(arg.startswith("--recompute") for arg in out.megatron_args)
    assert "model.recompute_granularity=null" in out.bridge_overrides
    assert "model.activations_checkpoint_granularity=null" in out.nemo1_overrides


def test_nemo1_warns_on_uneven_split_only():
    uneven = emit(partition=make_partition(UNEVEN, pp=4), parallel=TP4_PP4, train=TrainSpec())
    (warning,) = uneven.warnings
    assert "cannot be expressed" in warning and "9/11/11/9" in warning and "10 decoder layers" in warning
    even = parse_layout("Et*10|t*10|t*10|t*10L")
    assert emit(partition=make_partition(even, pp=4), parallel=TP4_PP4, train=TrainSpec()).warnings == ()
    odd = parse_layout("Et*10|t*10|t*10|t*11L")
    (warning,) = emit(partition=make_partition(odd, pp=4), parallel=TP4_PP4, train=TrainSpec()).warnings
    assert "will reject" in warning


def test_sequence_parallel_without_tensor_parallel_is_dropped_with_warning():
    parallel = ParallelSpec(pipeline_model_parallel_size=4, sequence_parallel=True)
    out = emit(partition=make_partition(parse_layout("Et*2|t*2|t*2|t*2L"), pp=4), parallel=parallel, train=TrainSpec())
    assert "--sequence-parallel" not in out.megatron_args
    assert any("sequence_parallel" in warning for warning in out.warnings)


@pytest.mark.parametrize(("schedule", "vp", "count"), [("1f1b", 1, 0), ("zb_h1", 1, 1), ("gpipe", 1, 1), ("zb_v", 2, 2)])
def test_schedules_megatron_cannot_run_are_warned(schedule, vp, count):
    stages = parse_layout("Et*2|t*2|t*2|t*2L" if vp == 1 else "Et|t|t|t|t|t|t|tL")
    parallel = ParallelSpec(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=vp)
    out = emit(partition=make_partition(stages, pp=4, vp=vp, schedule=schedule), parallel=parallel, train=TrainSpec())
    schedule_warnings = [w for w in out.warnings if "schedule" in w or "V-shaped" in w]
    assert len(schedule_warnings) == count


def test_as_dict_is_json_ready():
    import json

    out = emit(partition=make_partition(UNEVEN, pp=4), parallel=TP4_PP4, train=TRAIN_FULL)
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
        ("Et*4|mtL", 2, 1, "after an MTP layer"),
        ("Et*4|t*4L", 1, 2, "needs pipeline_model_parallel_size > 1"),
    ],
)
def test_invalid_layouts_raise_config_error(layout, pp, vp, match):
    with pytest.raises(ConfigError, match=match):
        emit(partition=make_partition(parse_layout(layout), pp=pp, vp=vp),
             parallel=ParallelSpec(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp),
             train=TrainSpec())  # fmt: skip


def test_partition_for_other_sizes_raises():
    with pytest.raises(ConfigError, match="re-partition"):
        emit(partition=make_partition(UNEVEN, pp=4), parallel=ParallelSpec(pipeline_model_parallel_size=2),
             train=TrainSpec())  # fmt: skip


def test_zero_decoder_stages_with_embedding_or_loss_are_emitted(vp_world_size):
    """E alone and L alone are valid megatron-core stages; only a stage with nothing is refused."""
    for layout in ("E|t*4|t*4L", "Et*4|t*4|L"):
        stages = parse_layout(layout)
        out = emit(partition=make_partition(stages, pp=3), parallel=ParallelSpec(pipeline_model_parallel_size=3),
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
    out = emit(partition=make_partition(stages, pp=pp, vp=vp), parallel=parallel, train=train)
    assert parse_layout(out.layout) == stages
    assert_megatron_reads(out.layout, stages, pp=pp, vp=vp)
    args = out.megatron_args
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == out.layout
    assert_shell_reads(out.megatron_command, args)
    assert_hydra_reads(out.bridge_overrides, bridge_settings(layout=out.layout, parallel=parallel, train=train))
    assert_hydra_reads(out.nemo2_overrides, nemo2_settings(layout=out.layout, parallel=parallel, train=train))
    assert_hydra_reads(out.nemo1_overrides, nemo1_settings(parallel=parallel, train=train))
    for tokens in (out.bridge_overrides, out.nemo2_overrides, out.nemo1_overrides):
        assert_shell_reads(shell_join(tokens), tokens)
    uneven = not is_equal_split(stages, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    assert uneven == any("no per-stage key" in warning for warning in out.warnings)
