"""Emitted layouts build the planned layers in real megatron-core GPTModels (gloo, CPU)."""

from __future__ import annotations

import pytest

from _mcore_build import build_gpt_chunks, describe_chunks, destroy_parallel, init_parallel
from _mcore_build import run_schedule, spawn_ranks
from megapipe.emit import decoder_offsets, emit, rank_of_stage
from megapipe.layout import format_layout, parse_layout
from megapipe.records import GpuSpec, LayerKind, ModelSpec, ParallelSpec, Partition, TrainSpec

pytestmark = pytest.mark.engine

WORLD_SIZE = 2
NUM_LAYERS = 8
NUM_MICROBATCHES = 4


def emitted_layout(layout: str, *, pp: int, vp: int = 1) -> str:
    stages = parse_layout(layout)
    n = len(stages)
    partition = Partition(
        entries_per_stage=tuple(map(len, stages)), stage_kinds=stages, stage_time_ms=(1.0,) * n,
        stage_static_bytes=(0.0,) * n, stage_act_bytes=(0.0,) * n, stage_in_flight=(1,) * n,
        stage_memory_bytes=(0.0,) * n, layout=format_layout(stages), pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp, schedule="interleaved_1f1b" if vp > 1 else "1f1b",
    )  # fmt: skip
    parallel = ParallelSpec(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    flat = [kind for kinds in stages for kind in kinds]
    model = ModelSpec(name="tiny", num_layers=flat.count(LayerKind.decoder), hidden_size=64, num_attention_heads=4,
                      num_query_groups=4, ffn_hidden_size=256, vocab_size=512, seq_length=32,
                      mtp_num_layers=flat.count(LayerKind.mtp))
    cpu = GpuSpec(name="cpu", bf16_tflops=0.1, hbm_gbytes_per_s=50, memory_gib=8, architecture="cpu")
    return emit(partition=partition, parallel=parallel, train=TrainSpec(), model=model, gpus=(cpu,) * pp).layout


def planned(layout: str, *, pp: int) -> dict[int, list[dict]]:
    """pp_rank -> per vp_stage what megapipe planned, in describe_chunks' form."""
    stages = parse_layout(layout)
    offsets = decoder_offsets(stages)
    plan: dict[int, list[dict]] = {rank: [] for rank in range(pp)}
    for index, kinds in enumerate(stages):
        pp_rank, _ = rank_of_stage(index, pipeline_model_parallel_size=pp)
        count = kinds.count(LayerKind.decoder)
        plan[pp_rank].append({
            "layer_numbers": list(range(offsets[index] + 1, offsets[index] + count + 1)),
            "has_embedding": LayerKind.embedding in kinds,
            "has_output_layer": LayerKind.loss in kinds,
        })  # fmt: skip
    return plan


LONE_ENDS = "E|t*4|t*4|L"  # pp=2, vp=2: E alone on (rank 0, chunk 0), L alone on (rank 1, chunk 1)
SCENARIOS = {
    "uneven_pp2": (emitted_layout("Et*3|t*5L", pp=2), 2, None),
    "equal_pp2": (emitted_layout("Et*4|t*4L", pp=2), 2, None),
    "default_pp2": (None, 2, None),
    "interleaved_pp2_vp2": (emitted_layout("Et|t*2|t*3|t*2L", pp=2, vp=2), 2, 2),
    "lone_embedding_and_loss_pp2_vp2": (emitted_layout(LONE_ENDS, pp=2, vp=2), 2, 2),
}


def _build_all(rank, world_size):
    reports = {}
    for name, (layout, pp, vp) in SCENARIOS.items():
        init_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
        chunks = build_gpt_chunks(layout=layout, num_layers=NUM_LAYERS)
        reports[name] = describe_chunks(chunks)
        if layout == LONE_ENDS:
            reports["step"] = _schedule_step(chunks)
        destroy_parallel()
    return reports


def _schedule_step(chunks: list) -> dict:
    """megatron-core's own schedule (interleaved 1F1B here) over lone E / lone L chunks."""
    from megatron.core import parallel_state

    losses = run_schedule(chunks, num_microbatches=NUM_MICROBATCHES)
    return {
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "losses": losses,
        "grads": {f"{i}.{name}": float(p.grad.abs().sum()) for i, chunk in enumerate(chunks)
                  for name, p in chunk.named_parameters() if p.grad is not None},
        "missing": [name for chunk in chunks for name, p in chunk.named_parameters() if p.grad is None],
    }  # fmt: skip


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    """One spawn of WORLD_SIZE gloo ranks builds every scenario."""
    return spawn_ranks(_build_all, world_size=WORLD_SIZE, timeout_s=150)


def test_emitted_layouts_build_the_planned_layers(reports):
    for name, (layout, pp, vp) in SCENARIOS.items():
        plan = planned(layout or "Et*4|t*4L", pp=pp)
        for report in reports:
            built = report[name]
            assert built["chunks"] == plan[built["pp_rank"]], (name, built["pp_rank"])


def test_lone_embedding_and_loss_stages_train(reports):
    """Stages holding only E, or only L (zero decoder layers), run megatron-core's interleaved schedule."""
    steps = {step["pp_rank"]: step for step in (report["step"] for report in reports)}
    assert all(not step["missing"] for step in steps.values())  # every parameter received a gradient
    assert len(steps[1]["losses"]) == NUM_MICROBATCHES
    for loss in steps[1]["losses"]:  # ln(VOCAB_SIZE=128) = 4.85 at initialisation, divided by num_microbatches
        assert abs(loss * NUM_MICROBATCHES - 4.85) < 0.5
    assert steps[0]["grads"]["0.embedding.word_embeddings.weight"] > 0  # lone E chunk
    assert steps[1]["grads"]["1.output_layer.weight"] > 0  # lone L chunk
    assert steps[1]["grads"]["1.decoder.final_layernorm.weight"] > 0
