"""Schedule builders: Megatron's orders, op coverage, in-flight counts, errors."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.errors import ScheduleError
from megapipe.schedules import SCHEDULE_NAMES, Kind, build, chunks_per_rank, peak_in_flight
from megapipe.schedules.interleaved import schedule_table


def _build(name, pp, m, v=None, group=None):
    return build(
        name, pipeline_model_parallel_size=pp, num_microbatches=m,
        virtual_pipeline_model_parallel_size=v or chunks_per_rank(name, 2),
        microbatch_group_size_per_vp_stage=group,
    )


def test_action_notation_matches_torch():
    schedule = _build("1f1b", 4, 8)
    assert [str(a) for a in schedule.orders[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert [str(a) for a in schedule.orders[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    assert schedule.format().splitlines()[3].startswith("rank 3: 3F0 3B0")


def _megatron_rank_counts(pp, rank, m, v, group):
    """megatron-core's own warm-up count, with a stand-in for the process group it reads size/rank from."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    group_handle = types.SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    communicator = types.SimpleNamespace(pp_group=group_handle, virtual_pipeline_model_parallel_size=v)
    _, _, warmup, remaining = get_pp_rank_microbatches(m, v or 1, group, p2p_communicator=communicator)
    return warmup, remaining


@pytest.mark.parametrize("pp,m,v,group", [(4, 8, None, 4), (4, 3, None, 4), (2, 5, 2, 3), (4, 8, 2, 4), (3, 8, 3, 4)])
def test_orders_follow_megatron(pp, m, v, group):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    name = "1f1b" if v is None else "interleaved_1f1b"
    schedule = _build(name, pp, m, v or 1, group if v else None)
    table = get_schedule_table(m, v or 1, group) if v else [(mb, 0) for mb in range(m)]
    assert (schedule_table(num_microbatches=m, num_model_chunks=v, microbatch_group_size_per_vp_stage=group)
            == tuple(table)) if v else True
    chunks = v or 1
    for rank, order in enumerate(schedule.orders):
        warmup, remaining = _megatron_rank_counts(pp, rank, m, v, group)
        kinds = "".join(a.kind.value for a in order)
        assert kinds == "F" * warmup + "FB" * remaining + "B" * warmup
        forwards = [(a.microbatch, a.chunk) for a in order if a.kind is Kind.F]
        backwards = [(a.microbatch, chunks - 1 - a.chunk) for a in order if a.kind is Kind.B]
        assert forwards == list(table) and backwards == list(table)
        assert all(a.stage == a.chunk * pp + rank for a in order)


def test_megatron_interleaved_example_table():
    """The PP2 N3 M5 VP2 example in Megatron's source comment."""
    table = schedule_table(num_microbatches=5, num_model_chunks=2, microbatch_group_size_per_vp_stage=3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [chunk for _, chunk in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(SCHEDULE_NAMES), pp=st.integers(1, 6), m=st.integers(1, 16), v=st.integers(2, 3),
)
def test_every_op_once_on_its_rank(name, pp, m, v):
    try:
        schedule = _build(name, pp, m, v)
    except ScheduleError:
        return
    seen = {}
    for rank, order in enumerate(schedule.orders):
        for action in order:
            assert schedule.stage_to_rank[action.stage] == rank == action.rank
            key = (action.stage, action.microbatch, action.kind)
            assert key not in seen
            seen[key] = action
    for stage in range(schedule.num_stages):
        for mb in range(m):
            assert (stage, mb, Kind.F) in seen
            fused = (stage, mb, Kind.B) in seen
            split = (stage, mb, Kind.I) in seen and (stage, mb, Kind.W) in seen
            assert fused != split
    assert schedule.num_ops == len(seen)


def _rank_peak(order):
    held = peak = 0
    for action in order:
        held += {Kind.F: 1, Kind.I: 0, Kind.W: -1, Kind.B: -1}[action.kind]
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 3), (6, 24)])
def test_peak_in_flight_closed_forms(pp, m):
    def peak(name, v=1):
        return peak_in_flight(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                              virtual_pipeline_model_parallel_size=v)

    assert peak("1f1b") == tuple(min(pp - s, m) for s in range(pp))
    assert peak("gpipe") == (m,) * pp
    assert peak("zb_h1") == (min(pp, m),) * pp  # 1F1B's first-stage peak on every stage
    if m >= 2 * pp:
        assert peak("zb_h2") == (2 * pp - 1,) * pp
        rank_peaks = [_rank_peak(order) for order in _build("zb_v", pp, m, 2).orders]
        assert rank_peaks == [2 * pp] * pp  # two half-size chunks at once: 1F1B's P microbatches
    if m % pp == 0:
        v = 2
        first_rank = _build("interleaved_1f1b", pp, m, v).orders[0]
        warmup = min(m * v, 2 * (pp - 1) + (v - 1) * pp)
        assert _rank_peak(first_rank) == min(warmup + 1, m * v)  # Megatron's warm-up plus the steady F


def test_peak_in_flight_accepts_a_schedule():
    schedule = _build("zb_h2", 4, 8)
    assert peak_in_flight(schedule, pipeline_model_parallel_size=4, num_microbatches=8) == (7, 7, 7, 7)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="pipedream", pp=4, m=8), "unknown schedule 'pipedream'; choose one of gpipe, 1f1b"),
        (dict(name="interleaved_1f1b", pp=4, m=8, v=1), "virtual_pipeline_model_parallel_size >= 2"),
        (dict(name="interleaved_1f1b", pp=4, m=6, v=2), r"6 % microbatch_group_size_per_vp_stage=4 = 2"),
        (dict(name="interleaved_1f1b", pp=4, m=3, v=2), r"must lie in \[pipeline_model_parallel_size=4"),
        (dict(name="interleaved_1f1b", pp=4, m=8, v=2, group=9), "must lie in"),
        (dict(name="dualpipe_v", pp=4, m=7, v=2), "num_microbatches >= 2 \\* pipeline_model_parallel_size = 8"),
        (dict(name="zb_v", pp=4, m=8, v=3), "exactly 2 model chunks per rank"),
        (dict(name="1f1b", pp=4, m=8, v=2), "use schedule=interleaved_1f1b"),
        (dict(name="1f1b", pp=0, m=8), "pipeline_model_parallel_size=0"),
        (dict(name="gpipe", pp=2, m=0), "num_microbatches=0"),
    ],
)
def test_bad_sizes_raise_with_the_fix(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        _build(kwargs["name"], kwargs["pp"], kwargs["m"], kwargs.get("v", 1), kwargs.get("group"))


def test_interleaved_uneven_last_group_allowed_when_megatron_allows():
    schedule = _build("interleaved_1f1b", 4, 13, 2, group=9)  # last group 4 >= P
    assert schedule.num_ops == 2 * 13 * 2 * 4


def test_closed_form_schedules_build_their_actions_only_when_read():
    """A schedule with closed-form rank ops simulates without building its actions (a planner search simulates
    schedules of a hundred thousand ops); read, they are the builder's orders, and they compare, hash and pickle as
    the tuple."""
    import pickle

    from megapipe.schedules import registry
    from megapipe.schedules.base import LazyOrders
    from megapipe.schedules.interleaved import interleaved_orders
    from megapipe.simulate import simulate
    from megapipe.simulate.result import StageTimes

    registry.build.cache_clear()
    schedule = registry.build("interleaved_1f1b", pipeline_model_parallel_size=4, num_microbatches=8,
                              virtual_pipeline_model_parallel_size=2)
    assert isinstance(schedule.orders, LazyOrders) and len(schedule.orders) == 4
    stages = 8
    result = simulate(schedule, StageTimes(fwd_ms=(1.0,) * stages, bwd_ms=(2.0,) * stages, wgrad_ms=(0.0,) * stages))
    assert schedule.orders._orders is None  # simulated, critical path found, no action built
    built = interleaved_orders(pipeline_model_parallel_size=4, num_microbatches=8,
                               virtual_pipeline_model_parallel_size=2, microbatch_group_size_per_vp_stage=4)
    assert schedule.orders == built and hash(schedule.orders) == hash(built)
    assert pickle.loads(pickle.dumps(schedule)).orders == built
    path = result.critical_path
    assert path and all(action == built[rank][index] for action, (rank, index) in zip(path, result.critical_steps))
