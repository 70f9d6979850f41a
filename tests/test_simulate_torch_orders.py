"""megapipe's schedule orders compared with torch.distributed.pipelining's (torch 2.13).

torch's orders are read without a process group (``_torch_pipelining.torch_order``)
and turned into megapipe Schedules, so megapipe's simulator checks that every
dependency is met (it raises on a deadlock or a missing/duplicate op) and times
both orders with the same op costs. Where the orders differ, docs/schedules.md
("Orders compared with torch.distributed.pipelining") explains why.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _torch_pipelining import to_schedule, torch_order
from megapipe.errors import ScheduleError
from megapipe.schedules import Kind, build
from megapipe.simulate import StageTimes, simulate

pipeline_sizes = st.integers(min_value=2, max_value=6)
op_ms = st.integers(min_value=1, max_value=4)


def _strings(orders) -> list[list[str]]:
    return [[str(action) for action in order] for order in orders]


def _torch_strings(name: str, *, pp: int, m: int, chunks: int = 1) -> list[list[str]]:
    order = torch_order(name, pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=chunks)
    return [[str(action) for action in order[rank]] for rank in range(pp)]


def _round_size(pp: int, m: int) -> int:
    """torch's microbatches_per_round for interleaved schedules: m // max(1, m // P)."""
    return m // max(1, m // pp)


@settings(max_examples=30, deadline=None)
@given(pp=pipeline_sizes, m=st.integers(min_value=1, max_value=16))
def test_gpipe_order_equals_torch(pp, m):
    megapipe = build("gpipe", pipeline_model_parallel_size=pp, num_microbatches=m)
    assert _torch_strings("GPipe", pp=pp, m=m) == _strings(megapipe.orders)


@settings(max_examples=30, deadline=None)
@given(pp=pipeline_sizes, extra=st.integers(min_value=0, max_value=10))
def test_1f1b_ir_equals_megatron_order_except_last_rank_forward_index(pp, extra):
    """torch's Schedule1F1B.pipeline_order names the last rank's forwards 1..m (its runtime
    runs 0..m-1, see the engine test); every other rank matches Megatron's 1F1B exactly."""
    m = pp + extra
    torch_ir = torch_order("1F1B", pipeline_model_parallel_size=pp, num_microbatches=m)
    megatron = build("1f1b", pipeline_model_parallel_size=pp, num_microbatches=m)
    assert _torch_strings("1F1B", pp=pp, m=m)[:-1] == _strings(megatron.orders)[:-1]
    shifted = [
        f"{a.stage_index}{a.kind}{a.microbatch - (a.kind == 'F')}" for a in torch_ir[pp - 1]
    ]
    assert shifted == _strings(megatron.orders)[-1]
    with pytest.raises(ScheduleError, match="invalid"):
        simulate(
            to_schedule("1F1B", pipeline_model_parallel_size=pp, num_microbatches=m),
            StageTimes.uniform(pp, fwd_ms=1, input_grad_ms=1),
        )


@st.composite
def interleaved_sizes(draw):
    pp = draw(st.integers(min_value=2, max_value=5))
    chunks = draw(st.integers(min_value=2, max_value=4))
    m = draw(st.integers(min_value=pp, max_value=4 * pp).filter(lambda m: m % max(1, m // pp) == 0))
    return pp, chunks, m


@settings(max_examples=40, deadline=None)
@given(sizes=interleaved_sizes())
def test_interleaved_order_equals_megatron_with_torch_round_as_group(sizes):
    """torch groups microbatches in rounds of m // max(1, m // P); with that as Megatron's
    microbatch_group_size_per_vp_stage the two interleaved orders are identical."""
    pp, chunks, m = sizes
    megatron = build(
        "interleaved_1f1b", pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks, microbatch_group_size_per_vp_stage=_round_size(pp, m),
    )
    assert _torch_strings("Interleaved1F1B", pp=pp, m=m, chunks=chunks) == _strings(megatron.orders)


@pytest.mark.parametrize(("pp", "m"), [(3, 2), (4, 3), (4, 1)])
def test_interleaved_torch_runs_fewer_microbatches_than_ranks_megatron_does_not(pp, m):
    torch_schedule = to_schedule(
        "Interleaved1F1B", pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=2
    )
    result = simulate(torch_schedule, StageTimes.uniform(2 * pp, fwd_ms=1, input_grad_ms=2))
    assert result.step_time_ms > 0
    with pytest.raises(ScheduleError, match="microbatch_group_size_per_vp_stage"):
        build(
            "interleaved_1f1b", pipeline_model_parallel_size=pp, num_microbatches=m,
            virtual_pipeline_model_parallel_size=2,
        )


@pytest.mark.parametrize(("torch_name", "name"), [("ZBVZeroBubble", "zb_v"), ("DualPipeV", "dualpipe_v")])
@settings(max_examples=25, deadline=None)
@given(pp=st.integers(min_value=2, max_value=5), m=st.integers(min_value=1, max_value=20))
def test_v_schedules_equal_torch_or_both_reject(torch_name, name, pp, m):
    try:
        torch_schedule = to_schedule(
            torch_name, pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=2
        )
    except ValueError:
        with pytest.raises(ScheduleError):
            build(name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=2)
        return
    megapipe = build(name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=2)
    assert torch_schedule.stage_to_rank == megapipe.stage_to_rank
    assert torch_schedule.orders == megapipe.orders


@st.composite
def zero_bubble_case(draw):
    pp = draw(pipeline_sizes)
    m = draw(st.integers(min_value=1, max_value=4 * pp).filter(lambda m: m % max(1, m // pp) == 0))
    return pp, m, draw(op_ms), draw(op_ms), draw(op_ms)


@settings(max_examples=60, deadline=None)
@given(case=zero_bubble_case())
def test_torch_zb1p_one_chunk_equals_zb_h1(case):
    """torch's InterleavedZeroBubble with one stage per rank is ZB-H1: megapipe's zb_h1 order
    exactly, with step time m(F+B+W) + (P-1)(F+B-W) (Qi et al. 2024) when W <= min(F, B) and
    m >= P, and never below that bound."""
    pp, m, fwd, igrad, wgrad = case
    torch_schedule = to_schedule("InterleavedZeroBubble", pipeline_model_parallel_size=pp, num_microbatches=m)
    assert torch_schedule.orders == build("zb_h1", pipeline_model_parallel_size=pp, num_microbatches=m).orders
    times = StageTimes.uniform(pp, fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad)
    torch_ms = simulate(torch_schedule, times).step_time_ms
    closed_form = m * (fwd + igrad + wgrad) + (pp - 1) * (fwd + igrad - wgrad)
    if m >= pp:
        assert torch_ms >= closed_form - 1e-9
    if m >= pp and wgrad <= min(fwd, igrad):
        assert torch_ms == pytest.approx(closed_form)


@settings(max_examples=40, deadline=None)
@given(sizes=interleaved_sizes(), fwd=op_ms, igrad=op_ms, wgrad=op_ms)
def test_torch_interleaved_zero_bubble_never_slower_than_interleaved_1f1b(sizes, fwd, igrad, wgrad):
    """torch's interleaved ZB1P has no megapipe builder; it runs every F, I and W once per
    stage and microbatch, and splitting W off never lengthens Megatron's interleaved order."""
    pp, chunks, m = sizes
    torch_schedule = to_schedule(
        "InterleavedZeroBubble", pipeline_model_parallel_size=pp, num_microbatches=m, num_stages_per_rank=chunks
    )
    for rank, order in enumerate(torch_schedule.orders):
        kinds = Counter((action.stage, action.kind) for action in order)
        stages = [s for s, r in enumerate(torch_schedule.stage_to_rank) if r == rank]
        assert kinds == {(s, kind): m for s in stages for kind in (Kind.F, Kind.I, Kind.W)}
    megatron = build(
        "interleaved_1f1b", pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=chunks, microbatch_group_size_per_vp_stage=_round_size(pp, m),
    )
    times = StageTimes.uniform(pp * chunks, fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad)
    assert simulate(torch_schedule, times).step_time_ms <= simulate(megatron, times).step_time_ms + 1e-9
