"""Layouts build the planned mixture-of-experts layers in real megatron-core GPTModels, and train.

Four gloo ranks = PP2 x DP2 with EP2 (TP1, so the expert-parallel group is the
data-parallel group: ranks {0, 1} hold pp rank 0, {2, 3} pp rank 1). One spawn
builds every scenario; the plan each build is checked against comes from the
layout string through megapipe's own parser, not from megatron-core.
"""

from __future__ import annotations

import math

import pytest

from _mcore_build import SEQ_LENGTH, destroy_parallel, init_parallel, spawn_ranks
from _mcore_moe import (
    HIDDEN_SIZE,
    SHIMS,
    build_moe_gpt_chunks,
    describe_moe_chunks,
    gradient_report,
    moe_cpu_shims,
    run_moe_schedule,
)
from megapipe.emit import decoder_offsets, rank_of_stage
from megapipe.layout import parse_layout
from megapipe.records import LayerKind

pytestmark = pytest.mark.engine

WORLD_SIZE = 4
PP = 2
EP = 2
NUM_MICROBATCHES = 4
NUM_EXPERTS = 4
MOE_FFN_HIDDEN_SIZE = 32
MOE_LAYER_FREQ = [0, 1, 1, 1, 1, 1]  # first layer dense
MODEL = dict(
    num_layers=len(MOE_LAYER_FREQ), num_moe_experts=NUM_EXPERTS, moe_router_topk=2,
    moe_ffn_hidden_size=MOE_FFN_HIDDEN_SIZE, moe_layer_freq=MOE_LAYER_FREQ,
    moe_shared_expert_intermediate_size=32, mtp_num_layers=1,
)  # fmt: skip
EXPERT_PARAMS = 2 * HIDDEN_SIZE * MOE_FFN_HIDDEN_SIZE  # linear_fc1 + linear_fc2 of one expert, no bias
SCENARIOS = {  # name: (layout, virtual_pipeline_model_parallel_size, dispatcher)
    "pp2_alltoall": ("Et*2|t*4mL", None, "alltoall"),
    "pp2_vp2_alltoall": ("Et|t*2|t*2|tmL", 2, "alltoall"),
    "pp2_allgather": ("Et*2|t*4mL", None, "allgather"),
}
def megapipe_layout(*, pp: int, vp: int = 1, num_microbatches: int = NUM_MICROBATCHES) -> str:
    """The layout megapipe plans for MODEL: its cost model's units, the exact solver, then emission."""
    from megapipe.emit import emit
    from megapipe.partition import StageSpec, solve
    from megapipe.records import ClusterSpec, GpuSpec, LinkSpec, ModelSpec, NodeGroup, ParallelSpec, TrainSpec
    from megapipe.cost.layers import layer_costs

    from _mcore_moe import FFN_HIDDEN_SIZE, NUM_ATTENTION_HEADS
    from _mcore_build import VOCAB_SIZE

    model = ModelSpec(
        name="tiny-moe", num_layers=MODEL["num_layers"], hidden_size=HIDDEN_SIZE, num_attention_heads=NUM_ATTENTION_HEADS,
        num_query_groups=NUM_ATTENTION_HEADS, ffn_hidden_size=FFN_HIDDEN_SIZE, vocab_size=VOCAB_SIZE,
        seq_length=SEQ_LENGTH, num_moe_experts=NUM_EXPERTS, moe_router_topk=MODEL["moe_router_topk"],
        moe_ffn_hidden_size=MOE_FFN_HIDDEN_SIZE, moe_layer_freq=tuple(MOE_LAYER_FREQ),
        moe_shared_expert_intermediate_size=MODEL["moe_shared_expert_intermediate_size"],
        mtp_num_layers=MODEL["mtp_num_layers"], add_bias_linear=False,
    )  # fmt: skip
    cpu = GpuSpec(name="cpu", bf16_tflops=0.1, hbm_gbytes_per_s=50, memory_gib=8, architecture="cpu")
    link = LinkSpec(kind="loopback", bandwidth_gbytes_per_s=10.0, latency_us=10.0)
    cluster = ClusterSpec(name="gloo", gpus_per_node=WORLD_SIZE, price_per_gpu_hour=0.0, intra_node=link,
                          inter_node=link, node_groups=(NodeGroup(gpu=cpu, num_nodes=1),))
    parallel = ParallelSpec(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                            data_parallel_size=WORLD_SIZE // pp, expert_model_parallel_size=EP)
    train = TrainSpec(micro_batch_size=2, global_batch_size=2 * num_microbatches * WORLD_SIZE // pp,
                      seq_length=SEQ_LENGTH)
    profile = layer_costs(model=model, gpu=cpu, cluster=cluster, parallel=parallel, train=train)
    partition = solve(profile, [StageSpec(memory_bytes=8 * 2**30)] * pp, num_microbatches=num_microbatches,
                      schedule="interleaved_1f1b" if vp > 1 else "1f1b", virtual_pipeline_model_parallel_size=vp)
    return emit(partition=partition, parallel=parallel, train=train, model=model, gpus=(cpu,) * pp).layout


SCENARIOS["megapipe_pp2"] = (megapipe_layout(pp=2), None, "alltoall")
SCENARIOS["megapipe_pp2_vp2"] = (megapipe_layout(pp=2, vp=2), 2, "alltoall")
STANDALONE_MTP = "Et*3|t*3|m|L"  # m alone on (pp rank 0, vp 1): refused before the build hangs


def planned(layout: str, *, pp: int) -> dict[int, list[dict]]:
    """pp_rank -> per vp_stage what the layout string asks for."""
    stages = parse_layout(layout)
    offsets = decoder_offsets(stages)
    plan: dict[int, list[dict]] = {rank: [] for rank in range(pp)}
    for index, kinds in enumerate(stages):
        pp_rank, _ = rank_of_stage(index, pipeline_model_parallel_size=pp)
        numbers = list(range(offsets[index] + 1, offsets[index] + kinds.count(LayerKind.decoder) + 1))
        plan[pp_rank].append({
            "layer_numbers": numbers,
            "is_moe": [bool(MOE_LAYER_FREQ[number - 1]) for number in numbers],
            "has_embedding": LayerKind.embedding in kinds,
            "has_output_layer": LayerKind.loss in kinds,
            "num_mtp_layers": kinds.count(LayerKind.mtp),
        })  # fmt: skip
    return plan


def _shim_failures() -> dict:
    """Each shim switched off in turn: the error a MoE layer build or forward/backward then raises.

    Layer-local calls only (no pipeline p2p), and symmetric within each EP pair,
    so a failing rank never leaves a peer waiting in a collective. A bare MoE
    backward leaves megatron-core's aux-loss scale as a 0-d tensor, which the
    schedule's ``set_loss_scale`` (a 1-element tensor) cannot ``copy_`` into: reset it.
    """
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    failures = {}
    for shim in (*SHIMS, None):
        with moe_cpu_shims(disable={shim} - {None}):
            try:
                chunks = build_moe_gpt_chunks(layout=None, num_layers=2, num_moe_experts=NUM_EXPERTS,
                                              moe_router_topk=2, moe_ffn_hidden_size=MOE_FFN_HIDDEN_SIZE)
                output, _ = chunks[0].decoder.layers[0].mlp(torch.randn(SEQ_LENGTH, 2, HIDDEN_SIZE))
                output.sum().backward()
            except Exception as error:  # noqa: BLE001 - the error is the result
                failures[shim] = f"{type(error).__name__}: {error}"
            else:
                failures[shim] = None
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    return failures


def _standalone_mtp_refusal() -> str | None:
    with moe_cpu_shims():
        try:
            build_moe_gpt_chunks(layout=STANDALONE_MTP, **MODEL)
        except NotImplementedError as error:
            return str(error)
    return None


A2A_DELAY_S = 0.01
A2A_PER_LAYER = 6
MONITORED_STEPS = 3


def _monitored(layout: str) -> dict:
    """The monitor on a MoE run whose every all-to-all is slowed by A2A_DELAY_S (and counted)."""
    import time

    import torch.distributed as dist

    from megapipe.monitor.monitor import attach_monitor

    calls = {"count": 0}
    real = dist.all_to_all_single

    def slow_all_to_all(*args, **kwargs):
        calls["count"] += 1
        time.sleep(A2A_DELAY_S)
        return real(*args, **kwargs)

    chunks = build_moe_gpt_chunks(layout=layout, **MODEL)
    mon = attach_monitor(chunks, tokens_per_step=NUM_MICROBATCHES * 2 * SEQ_LENGTH * EP, log_every=1,
                         topology_check=False)
    mon.train_start()
    logged = []
    dist.all_to_all_single = slow_all_to_all
    try:
        for step in range(MONITORED_STEPS):
            run_moe_schedule(chunks, num_microbatches=NUM_MICROBATCHES)
            logged.append(mon.step_end(step))
    finally:
        dist.all_to_all_single = real
    enabled = mon.enabled
    mon.train_end()
    return {"logged": logged, "a2a_calls": calls["count"], "enabled": enabled}


def _all_scenarios(rank, world_size):
    reports = {}
    init_parallel(pipeline_model_parallel_size=PP, expert_model_parallel_size=EP)
    reports["shim_failures"] = _shim_failures()  # first: before any schedule patches torch.cuda for good
    destroy_parallel()
    for name, (layout, vp, dispatcher) in SCENARIOS.items():
        init_parallel(pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=vp,
                      expert_model_parallel_size=EP)  # fmt: skip
        if vp == 2 and "standalone_mtp" not in reports:
            reports["standalone_mtp"] = _standalone_mtp_refusal()
        with moe_cpu_shims():
            chunks = build_moe_gpt_chunks(layout=layout, dispatcher=dispatcher, **MODEL)
            built = describe_moe_chunks(chunks)
            losses = run_moe_schedule(chunks, num_microbatches=NUM_MICROBATCHES)
        reports[name] = {"built": built, "losses": losses, "grads": gradient_report(chunks)}
        destroy_parallel()
    init_parallel(pipeline_model_parallel_size=PP, expert_model_parallel_size=EP)
    with moe_cpu_shims():
        reports["monitored"] = _monitored(SCENARIOS["megapipe_pp2"][0])
    destroy_parallel()
    return reports


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    """One spawn of four gloo ranks runs every scenario."""
    return spawn_ranks(_all_scenarios, world_size=WORLD_SIZE, timeout_s=240)


@pytest.mark.parametrize("name", SCENARIOS)
def test_layout_builds_the_planned_moe_layers(reports, name):
    layout = SCENARIOS[name][0]
    plan = planned(layout, pp=PP)
    for report in reports:
        built = report[name]["built"]
        assert len(built["chunks"]) == len(plan[built["pp_rank"]])
        for chunk, want in zip(built["chunks"], plan[built["pp_rank"]], strict=True):
            got = {
                "layer_numbers": chunk["layer_numbers"],
                "is_moe": [layer["is_moe"] for layer in chunk["layers"]],
                "has_embedding": chunk["has_embedding"],
                "has_output_layer": chunk["has_output_layer"],
                "num_mtp_layers": chunk["num_mtp_layers"],
            }
            assert got == want, (name, built["pp_rank"])
            assert chunk["has_mtp"] == (want["num_mtp_layers"] > 0)


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_expert_rank_holds_its_share_of_the_experts(reports, name):
    local = NUM_EXPERTS // EP
    by_stage: dict[int, list[dict]] = {}
    for rank, report in enumerate(reports):
        built = report[name]["built"]
        assert (built["pp_rank"], built["ep_rank"], built["ep_size"]) == (rank // EP, rank % EP, EP)
        assert built["ep_rank"] == built["dp_rank"]  # TP1: expert parallelism folds into data parallelism
        by_stage.setdefault(built["pp_rank"], []).append(built)
        for chunk in built["chunks"]:
            moe_layers = [layer for layer in (*chunk["layers"], *chunk["mtp_layers"]) if layer["is_moe"]]
            for layer in moe_layers:
                assert layer["num_local_experts"] == local
                assert layer["local_expert_indices"] == list(range(built["ep_rank"] * local, (built["ep_rank"] + 1) * local))
                assert layer["has_shared_expert"]
            assert [layer["is_moe"] for layer in chunk["mtp_layers"]] == [True] * chunk["num_mtp_layers"]
            assert chunk["expert_param_count"] == len(moe_layers) * local * EXPERT_PARAMS
    for stage in by_stage.values():  # the two EP ranks of a stage: disjoint experts, same dense parameters
        assert sorted(built["ep_rank"] for built in stage) == list(range(EP))
        dense = {tuple(chunk["dense_param_count"] for chunk in built["chunks"]) for built in stage}
        assert len(dense) == 1


@pytest.mark.parametrize("name", SCENARIOS)
def test_moe_model_trains_under_the_megatron_schedule(reports, name):
    for report in reports:
        built, losses, grads = report[name]["built"], report[name]["losses"], report[name]["grads"]
        if built["pp_rank"] == PP - 1:  # both EP/DP ranks of the last stage report their losses
            assert len(losses) == NUM_MICROBATCHES
            for loss in losses:  # ln(vocab 128) = 4.85 at initialisation, divided by num_microbatches
                assert math.isfinite(loss) and abs(loss * NUM_MICROBATCHES - 4.85) < 0.5
        else:
            assert losses == []
        for kind in ("expert", "dense"):
            assert grads[kind]["params"] > 0, kind
            assert grads[kind]["missing"] == [] and grads[kind]["nonfinite"] == [], kind
            assert grads[kind]["abs_sum"] > 0, kind


def test_allgather_dispatcher_matches_alltoall(reports):
    """Same seed, same data: both dispatchers compute the same experts on the same tokens."""
    for report in reports:
        alltoall, allgather = report["pp2_alltoall"], report["pp2_allgather"]
        assert allgather["built"] == alltoall["built"]
        assert allgather["losses"] == pytest.approx(alltoall["losses"], rel=1e-6, abs=0)
        for kind in ("expert", "dense"):
            assert allgather["grads"][kind]["abs_sum"] == pytest.approx(alltoall["grads"][kind]["abs_sum"], rel=1e-5)


EXPECTED_FAILURES = {
    "cuda_stream": "RuntimeError: torch.cuda.Stream requires CUDA support",
    "te_general_gemm": "NameError: name 'te_general_gemm' is not defined",
    "split_sizes": "TypeError: all_to_all_single(): incompatible function arguments",
    "cuda_calls": "AssertionError: Torch not compiled with CUDA enabled",
}


def test_each_cpu_shim_is_needed(reports):
    assert set(EXPECTED_FAILURES) == set(SHIMS)
    for report in reports:
        failures = report["shim_failures"]
        assert failures[None] is None  # every shim on: the MoE layer runs forward and backward
        for shim, expected in EXPECTED_FAILURES.items():
            assert failures[shim] is not None and failures[shim].startswith(expected), (shim, failures[shim])


def test_standalone_mtp_on_the_first_rank_is_refused(reports):
    for report in reports:
        assert "hangs megatron-core" in (report["standalone_mtp"] or "")


def test_monitor_counts_all_to_all_as_compute_not_bubble(reports):
    """Slowed all-to-alls sit inside forward/backward compute: the measured stage times carry them, and the
    bubble stays what the hook's simulator gives for those stage times."""
    plan = planned(SCENARIOS["megapipe_pp2"][0], pp=PP)
    for rank, report in enumerate(reports):
        monitored = report["monitored"]
        assert monitored["enabled"], rank
        moe_layers = sum(sum(chunk["is_moe"]) + chunk["num_mtp_layers"] for chunk in plan[rank // EP])
        # per MoE layer and microbatch the alltoall dispatcher exchanges tokens and their routing
        # probabilities, then combines: three all-to-alls forward, three backward
        assert monitored["a2a_calls"] == MONITORED_STEPS * NUM_MICROBATCHES * moe_layers * A2A_PER_LAYER, rank
    metrics = reports[0]["monitored"]["logged"][-1]
    forward = [metrics[f"megapipe/stage{i}_forward_ms"] for i in range(PP)]
    backward = [metrics[f"megapipe/stage{i}_backward_ms"] for i in range(PP)]
    for stage in range(PP):
        moe_layers = sum(sum(chunk["is_moe"]) + chunk["num_mtp_layers"] for chunk in plan[stage])
        delay_ms = A2A_PER_LAYER // 2 * moe_layers * A2A_DELAY_S * 1e3  # per microbatch, each direction
        assert forward[stage] >= 0.95 * delay_ms and backward[stage] >= 0.95 * delay_ms, stage
    bubble = metrics["megapipe/bubble_fraction"]
    assert 0.0 < bubble < 0.5
    assert metrics["megapipe/simulated_bubble_fraction"] == pytest.approx(bubble, rel=0.3, abs=0.05)
