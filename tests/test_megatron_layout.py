"""Emitted layouts build the planned layers in real megatron-core GPTModels (gloo, CPU)."""

from __future__ import annotations

import pytest

from _mcore_build import SEQ_LENGTH, VOCAB_SIZE, build_gpt_chunks, describe_chunks, destroy_parallel, init_parallel
from _mcore_build import route_cuda_buffers_to_cpu, spawn_ranks
from megapipe.emit import decoder_offsets, emit, rank_of_stage
from megapipe.layout import format_layout, parse_layout
from megapipe.records import LayerKind, ParallelSpec, Partition, TrainSpec

pytestmark = pytest.mark.engine

WORLD_SIZE = 2
NUM_LAYERS = 8


def emitted_layout(layout: str, *, pp: int, vp: int = 1) -> str:
    stages = parse_layout(layout)
    n = len(stages)
    partition = Partition(
        layers_per_stage=tuple(map(len, stages)), stage_kinds=stages, stage_time_ms=(1.0,) * n,
        stage_static_bytes=(0.0,) * n, stage_act_bytes=(0.0,) * n, stage_in_flight=(1,) * n,
        stage_memory_bytes=(0.0,) * n, layout=format_layout(stages), pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
    )  # fmt: skip
    parallel = ParallelSpec(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
    return emit(partition=partition, parallel=parallel, train=TrainSpec()).layout


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
    route_cuda_buffers_to_cpu()
    reports = {}
    for name, (layout, pp, vp) in SCENARIOS.items():
        init_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
        chunks = build_gpt_chunks(layout=layout, num_layers=NUM_LAYERS)
        reports[name] = describe_chunks(chunks)
        if layout == LONE_ENDS:
            reports["step"] = _pipeline_step(chunks, pp=pp)
        destroy_parallel()
    return reports


def _inputs():
    import torch

    tokens = torch.randint(VOCAB_SIZE, (2, SEQ_LENGTH + 1), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(SEQ_LENGTH).expand(2, -1)
    mask = torch.ones(1, 1, SEQ_LENGTH, SEQ_LENGTH).triu(1).bool()
    return tokens[:, :-1], position_ids, mask, tokens[:, 1:]


def _pipeline_step(chunks: list, *, pp: int) -> dict:
    """One forward/backward through every layout stage in model order, plain gloo send/recv between ranks."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, num_stages = parallel_state.get_pipeline_model_parallel_rank(), pp * len(chunks)
    input_ids, position_ids, mask, labels = _inputs()
    inputs, outputs = {}, {}
    for index in range(num_stages):
        if index % pp != rank:
            continue
        chunk = chunks[index // pp]
        if index > 0:
            inputs[index] = torch.empty(SEQ_LENGTH, 2, chunk.config.hidden_size)
            dist.recv(inputs[index], src=(index - 1) % pp)
            chunk.set_input_tensor(inputs[index].requires_grad_(True))
        outputs[index] = chunk(input_ids, position_ids, mask, labels=labels if index == num_stages - 1 else None)
        if index < num_stages - 1:
            dist.send(outputs[index].detach().contiguous(), dst=(index + 1) % pp)
    loss = outputs[num_stages - 1].float().mean() if num_stages - 1 in outputs else None
    for index in reversed(range(num_stages)):
        if index % pp != rank:
            continue
        if index == num_stages - 1:
            loss.backward()
        else:
            grad = torch.empty_like(outputs[index])
            dist.recv(grad, src=(index + 1) % pp)
            torch.autograd.backward(outputs[index], grad)
        if index > 0:
            dist.send(inputs[index].grad.contiguous(), dst=(index - 1) % pp)
    return {
        "pp_rank": rank,
        "loss": None if loss is None else float(loss),
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
    """A stage holding only E, or only L (zero decoder layers), runs forward and backward."""
    steps = {step["pp_rank"]: step for step in (report["step"] for report in reports)}
    assert all(not step["missing"] for step in steps.values())
    assert abs(steps[1]["loss"] - 4.85) < 0.5  # ln(VOCAB_SIZE=128) = 4.85 at initialisation
    assert steps[0]["grads"]["0.embedding.word_embeddings.weight"] > 0  # lone E chunk gets its gradient
    assert steps[1]["grads"]["1.output_layer.weight"] > 0  # lone L chunk trains its output layer
    assert steps[1]["grads"]["1.decoder.final_layernorm.weight"] > 0
