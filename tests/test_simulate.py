"""Simulator: papers' closed forms exactly, invariants on random times, errors, bubble table."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.errors import ScheduleError
from megapipe.schedules import SCHEDULE_NAMES, Action, Kind, Schedule, build, chunks_per_rank
from megapipe.schedules.base import rank_ops_of
from megapipe.simulate import P2PCost, StageTimes, relaxed_step_ms, simulate
from megapipe.simulate.bubble import bubble_rows, closed_form_bubble, matching_microbatches


def _build(name, pp, m, v=2):
    return build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                 virtual_pipeline_model_parallel_size=chunks_per_rank(name, v))


def _uniform(schedule, fwd, igrad, wgrad):
    return StageTimes.uniform(schedule.num_stages, fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad)


@pytest.mark.parametrize("pp", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 7, 16])
def test_gpipe_and_1f1b_bubble(pp, m):
    for name in ("gpipe", "1f1b"):
        result = simulate(_build(name, pp, m), StageTimes.uniform(pp, fwd_ms=1.0, input_grad_ms=2.0))
        assert result.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
        assert result.step_time_ms == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 3, 6), (4, 2, 8), (4, 4, 12), (3, 2, 9), (8, 2, 16)])
def test_interleaved_bubble(pp, v, m):
    schedule = _build("interleaved_1f1b", pp, m, v)
    result = simulate(schedule, _uniform(schedule, 1.0 / v, 2.0 / v, 0.0))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


FBW = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.5, 1.0, 0.7), (2.0, 1.0, 0.25)]


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 13), (6, 12)])
@pytest.mark.parametrize("fbw", FBW)
def test_zb_h1_idle_per_stage(pp, m, fbw):
    """Qi et al. 2024: ZB-H1 idles (p-1)(F+B-W) per stage, 1/3 of 1F1B's when F=B=W."""
    fwd, igrad, wgrad = fbw
    result = simulate(_build("zb_h1", pp, m), StageTimes.uniform(pp, fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad))
    for rank in result.ranks:
        assert rank.idle_ms == pytest.approx((pp - 1) * (fwd + igrad - wgrad))
    one_f_one_b = simulate(_build("1f1b", pp, m), StageTimes.uniform(pp, fwd_ms=fwd, input_grad_ms=igrad,
                                                                      wgrad_ms=wgrad))
    assert one_f_one_b.ranks[0].idle_ms == pytest.approx((pp - 1) * (fwd + igrad + wgrad))


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12), (6, 14)])
@pytest.mark.parametrize("fbw", FBW[:3])
def test_zb_h2_steady_and_flushed(pp, m, fbw):
    """Steady idle (p-1)(F+B-2W) on the first stage with 2p-1 in flight; flushed = ZB-H1 when F=B=W."""
    fwd, igrad, wgrad = fbw
    result = simulate(_build("zb_h2", pp, m), StageTimes.uniform(pp, fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad))
    steady_idle = [rank.span_ms - rank.busy_ms for rank in result.ranks]
    assert max(steady_idle) == pytest.approx((pp - 1) * (fwd + igrad - 2 * wgrad))
    assert max(rank.peak_in_flight for rank in result.ranks) == min(2 * pp - 1, m)
    if fwd == igrad == wgrad:
        assert result.steady_bubble_fraction == pytest.approx(0.0, abs=1e-12)
        assert result.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1))


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 8), (4, 16), (6, 12)])
def test_zb_v_zero_steady_bubble_at_1f1b_memory(pp, m):
    schedule = _build("zb_v", pp, m)
    result = simulate(schedule, _uniform(schedule, 0.5, 0.5, 0.5))
    assert result.steady_bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert closed_form_bubble("zb_v", pipeline_model_parallel_size=pp, num_microbatches=m, steady=True) == 0.0


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 20), (6, 12)])
@pytest.mark.parametrize("fbw", FBW)
def test_dualpipe_v_within_deepseek_bound(pp, m, fbw):
    """DeepSeek's DualPipe idle (P-1)(F&B + B - 3W), B the full backward, F&B = F + B run in sequence."""
    fwd, igrad, wgrad = fbw
    schedule = _build("dualpipe_v", pp, m)
    result = simulate(schedule, _uniform(schedule, fwd, igrad, wgrad))
    full = igrad + wgrad
    bound = (pp - 1) * (fwd + full + full - 3 * wgrad)
    assert max(rank.idle_ms for rank in result.ranks) <= bound + 1e-9
    assert max(rank.peak_in_flight for rank in result.ranks) == 2 * pp + 1  # DeepSeek: PP + 1 activations


def test_gpipe_with_p2p_closed_form():
    pp, m, fwd, bwd, message = 5, 7, 1.0, 2.0, 0.25
    result = simulate(_build("gpipe", pp, m), StageTimes.uniform(pp, fwd_ms=fwd, input_grad_ms=bwd),
                      p2p=P2PCost(latency_ms=message))
    assert result.step_time_ms == pytest.approx(m * (fwd + bwd) + (pp - 1) * (fwd + bwd + 2 * message))


def test_p2p_from_link_and_boundaries():
    from megapipe.records import LinkSpec

    link = LinkSpec(kind="ib", bandwidth_gbytes_per_s=50.0, latency_us=5.0, bandwidth_efficiency=0.8)
    cost = P2PCost.from_link(link, p2p_bytes=1e8)
    assert cost.message_ms == pytest.approx(0.005 + 2.0 / 0.8)  # at the bandwidth NCCL achieves
    assert P2PCost.from_link(link, p2p_bytes=1e8, efficiency_scale=0.5).message_ms == pytest.approx(0.005 + 5.0)
    slow_middle = P2PCost(boundary_ms=(0.0, 1.0, 0.0))
    result = simulate(_build("gpipe", 4, 3), StageTimes.uniform(4, fwd_ms=1.0, input_grad_ms=1.0), p2p=slow_middle)
    assert result.step_time_ms == pytest.approx(3 * 2 + 3 * 2 + 2 * 1.0)


def test_activation_bytes_follow_1f1b_in_flight():
    pp, m = 4, 8
    times = StageTimes.uniform(pp, fwd_ms=1.0, input_grad_ms=1.0, act_bytes=10.0)
    result = simulate(_build("1f1b", pp, m), times)
    assert [r.peak_activation_bytes for r in result.ranks] == [40.0, 30.0, 20.0, 10.0]
    assert result.stage_peak_in_flight == (4, 3, 2, 1)


def _times(draw, count):
    values = st.floats(0.0, 5.0, allow_nan=False)
    fwd = tuple(draw(values) for _ in range(count))
    igrad = tuple(draw(values) for _ in range(count))
    wgrad = tuple(draw(values) for _ in range(count))
    act = tuple(draw(st.floats(0.0, 1e9)) for _ in range(count))
    return StageTimes.split(fwd_ms=fwd, input_grad_ms=igrad, wgrad_ms=wgrad, act_bytes=act)


@st.composite
def _cases(draw):
    name = draw(st.sampled_from(SCHEDULE_NAMES))
    pp, m = draw(st.integers(1, 5)), draw(st.integers(1, 12))
    v = draw(st.integers(2, 3))
    try:
        schedule = _build(name, pp, m, v)
    except ScheduleError:
        schedule = _build("1f1b", pp, m)
    return schedule, _times(draw, schedule.num_stages), draw(st.floats(0.0, 2.0))


def _check_dependencies(schedule, result, message):
    timing = {(a.stage, a.kind, a.microbatch): (a, t.start_ms, t.end_ms)
              for t in result.timeline() for a in [t.action]}
    last = schedule.num_stages - 1

    def end_of(stage, kinds, mb):
        return next(timing[(stage, k, mb)] for k in kinds if (stage, k, mb) in timing)

    for action, start, _ in timing.values():
        needs = []
        if action.kind is Kind.F and action.stage:
            needs.append(end_of(action.stage - 1, (Kind.F,), action.microbatch))
        if action.kind in (Kind.I, Kind.B):
            needs.append(end_of(action.stage, (Kind.F,), action.microbatch))
            if action.stage < last:
                needs.append(end_of(action.stage + 1, (Kind.I, Kind.B), action.microbatch))
        if action.kind is Kind.W:
            needs.append(end_of(action.stage, (Kind.I,), action.microbatch))
        for dep, _, dep_end in needs:
            delay = message if dep.rank != action.rank else 0.0
            assert start >= dep_end + delay - 1e-9


@settings(max_examples=40, deadline=None)
@given(case=_cases())
def test_invariants_on_random_times(case):
    schedule, times, message = case
    result = simulate(schedule, times, p2p=P2PCost(latency_ms=message))
    _check_dependencies(schedule, result, message)
    for rank, (starts, ends) in enumerate(zip(result.start_ms, result.end_ms)):
        assert all(e0 <= s1 + 1e-12 for e0, s1 in zip(ends, starts[1:]))  # one op at a time, in order
        assert all(s >= 0 and e >= s for s, e in zip(starts, ends))
        stats = result.ranks[rank]
        assert stats.busy_ms == pytest.approx(sum(e - s for s, e in zip(starts, ends)), rel=1e-9, abs=1e-9)
        assert stats.peak_activation_bytes >= 0 and stats.peak_in_flight >= 0
    assert result.step_time_ms >= max(r.busy_ms for r in result.ranks) - 1e-9
    assert 0.0 <= result.bubble_fraction <= 1.0 and 0.0 <= result.steady_bubble_fraction <= 1.0 + 1e-12
    assert all(1 <= peak <= schedule.num_microbatches for peak in result.stage_peak_in_flight)
    if result.step_time_ms > 0:
        _check_critical_path(result, message)


@settings(max_examples=60, deadline=None)
@given(case=_cases())
def test_relaxed_step_bounds_the_simulated_step(case):
    """Each rank timed exactly with the others unbounded never ends after the simulation, on every schedule."""
    schedule, times, message = case
    p2p = P2PCost(latency_ms=message)
    step = simulate(schedule, times, p2p=p2p).step_time_ms
    bound = _relaxed(schedule, times, p2p)
    assert bound <= step * (1 + 1e-12) + 1e-12
    assert bound >= max(sum(times.fwd_ms[a.stage] for a in order if a.kind is Kind.F) for order in schedule.orders)


def test_relaxed_step_sees_a_stall_the_work_floor_misses():
    """Interleaved 1F1B with the heavy chunks last: each rank's work and first wait (the partition floor) say
    63 ms, but rank 0 waits for rank 1's heavy chunk in every microbatch group; the relaxation counts it."""
    from megapipe.plan.bounds import pipeline_floor_ms

    schedule = build("interleaved_1f1b", pipeline_model_parallel_size=2, num_microbatches=4,
                     virtual_pipeline_model_parallel_size=2)
    fwd = (1.0, 1.0, 4.0, 4.0)  # stage = chunk * 2 + rank
    times = StageTimes(fwd_ms=fwd, bwd_ms=tuple(2 * f for f in fwd), wgrad_ms=(0.0,) * 4)
    floor = pipeline_floor_ms(schedule="interleaved_1f1b", stage_to_rank=schedule.stage_to_rank, fwd_ms=fwd,
                              bwd_ms=times.bwd_ms, num_microbatches=4)
    assert (floor, _relaxed(schedule, times), simulate(schedule, times).step_time_ms) == (63.0, 76.0, 78.0)


def test_relaxed_step_stops_at_enough_with_a_bound_still():
    """Asked only whether the bound reaches a value, the relaxation stops at the first rank (busiest first) whose end
    reaches it: the answer is then at least that value and never above the full bound; below it, the full bound."""
    schedule = build("interleaved_1f1b", pipeline_model_parallel_size=2, num_microbatches=4,
                     virtual_pipeline_model_parallel_size=2)
    fwd = (1.0, 1.0, 4.0, 4.0)
    times = StageTimes(fwd_ms=fwd, bwd_ms=tuple(2 * f for f in fwd), wgrad_ms=(0.0,) * 4)
    full = _relaxed(schedule, times)
    ops = rank_ops_of(schedule.orders)
    for enough in (1.0, 60.0, full, full + 1.0):
        found = relaxed_step_ms(ops, schedule.stage_to_rank, times, num_microbatches=4, enough_ms=enough)
        assert found <= full and (found >= enough or found == full)
    # the ranks tie on work, so rank 0 is timed first: it ends before rank 1 (71 against 76 ms), and the count stops
    assert relaxed_step_ms(ops, schedule.stage_to_rank, times, num_microbatches=4, enough_ms=1.0) < full


def _relaxed(schedule, times, p2p=None):
    return relaxed_step_ms(rank_ops_of(schedule.orders), schedule.stage_to_rank, times,
                           num_microbatches=schedule.num_microbatches, p2p=p2p)


def _check_critical_path(result, message):
    timing = {t.action: t for t in result.timeline()}
    path = result.critical_path
    assert timing[path[0]].start_ms == 0.0
    assert timing[path[-1]].end_ms == pytest.approx(result.step_time_ms)
    for before, after in zip(path, path[1:]):
        gap = message if before.rank != after.rank else 0.0
        assert timing[after].start_ms == pytest.approx(timing[before].end_ms + gap)


def test_deadlock_is_detected():
    def act(rank, kind, mb):
        return Action(rank, kind, mb, 0, rank)

    orders = (
        (act(0, Kind.F, 0), act(0, Kind.B, 0), act(0, Kind.F, 1), act(0, Kind.B, 1)),
        (act(1, Kind.F, 1), act(1, Kind.F, 0), act(1, Kind.B, 0), act(1, Kind.B, 1)),
    )
    schedule = Schedule(name="custom", pipeline_model_parallel_size=2, num_microbatches=2,
                        virtual_pipeline_model_parallel_size=1, microbatch_group_size_per_vp_stage=None,
                        stage_to_rank=(0, 1), orders=orders)
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0B0, rank 1 at 1F1"):
        simulate(schedule, StageTimes.uniform(2, fwd_ms=1.0, input_grad_ms=1.0))


@pytest.mark.parametrize(
    "orders,match",
    [
        (((Action(0, Kind.F, 0, 0, 0), Action(0, Kind.F, 0, 0, 0)),), "occurs twice"),
        (((Action(0, Kind.B, 0, 0, 0), Action(0, Kind.F, 0, 0, 0)),), "its F comes later"),
        (((Action(0, Kind.F, 0, 0, 0),),), "never runs the backward"),
        (((Action(0, Kind.F, 0, 0, 0), Action(0, Kind.I, 0, 0, 0)),), "never runs the W"),
        (((Action(0, Kind.F, 0, 0, 1),),), "out of range"),
    ],
)
def test_malformed_orders_raise(orders, match):
    schedule = Schedule(name="custom", pipeline_model_parallel_size=1, num_microbatches=1,
                        virtual_pipeline_model_parallel_size=1, microbatch_group_size_per_vp_stage=None,
                        stage_to_rank=(0,), orders=orders)
    with pytest.raises(ScheduleError, match=match):
        simulate(schedule, StageTimes.uniform(1, fwd_ms=1.0, input_grad_ms=1.0))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(fwd_ms=(1.0, -1.0), bwd_ms=(1.0, 1.0), wgrad_ms=(0.0, 0.0)), r"fwd_ms\[1\]=-1.0 must be a finite"),
        (dict(fwd_ms=(1.0, math.nan), bwd_ms=(1.0, 1.0), wgrad_ms=(0.0, 0.0)), r"fwd_ms\[1\]=nan"),
        (dict(fwd_ms=(1.0, math.inf), bwd_ms=(1.0, 1.0), wgrad_ms=(0.0, 0.0)), r"fwd_ms\[1\]=inf"),
        (dict(fwd_ms=(1.0,), bwd_ms=(1.0, 1.0), wgrad_ms=(0.0, 0.0)), "bwd_ms has 2 entries"),
        (dict(fwd_ms=(1.0,), bwd_ms=(1.0,), wgrad_ms=(2.0,)), "wgrad_ms.0.=2.0 exceeds bwd_ms"),
    ],
)
def test_bad_times_raise(kwargs, match):
    with pytest.raises(ScheduleError, match=match):
        StageTimes(**kwargs)


def test_times_must_match_the_schedule():
    with pytest.raises(ScheduleError, match="StageTimes has 4 stages but schedule zb_v has 8 layout stages"):
        simulate(_build("zb_v", 4, 8), StageTimes.uniform(4, fwd_ms=1.0, input_grad_ms=1.0))
    with pytest.raises(ScheduleError, match="latency_ms=-1"):
        P2PCost(latency_ms=-1.0)


def test_bubble_rows_agree_with_closed_forms():
    for pp in (8, 32):
        rows = {row.schedule: row for row in bubble_rows(pipeline_model_parallel_size=pp, num_microbatches=2 * pp)}
        assert set(rows) == set(SCHEDULE_NAMES)
        for row in rows.values():
            if row.closed_form is not None:
                assert row.simulated == pytest.approx(row.closed_form, abs=1e-12)
        assert rows["gpipe"].simulated == pytest.approx(rows["1f1b"].simulated)
        assert rows["gpipe"].peak_in_flight == 2 * pp and rows["1f1b"].peak_in_flight == pp
        assert rows["zb_h2"].simulated_steady == pytest.approx(0.0, abs=1e-12)


def test_writeup_numbers_need_different_microbatch_counts():
    """1F1B 14.3%/24.2% and interleaved 7.1%/12.1% fit (p-1)/m with m = 49 and 128; GPipe 28.6% fits none."""
    assert matching_microbatches(14.3, schedule="1f1b", pipeline_model_parallel_size=8, ideal=True) == (49,)
    assert matching_microbatches(24.2, schedule="1f1b", pipeline_model_parallel_size=32, ideal=True) == (128,)
    assert 49 in matching_microbatches(7.1, schedule="interleaved_1f1b", pipeline_model_parallel_size=8,
                                       virtual_pipeline_model_parallel_size=2, ideal=True)
    assert matching_microbatches(28.6, schedule="gpipe", pipeline_model_parallel_size=8) == ()
    assert matching_microbatches(28.6, schedule="gpipe", pipeline_model_parallel_size=8, ideal=True) == ()
    zb1 = matching_microbatches(3.5, schedule="zb_h1", pipeline_model_parallel_size=8)
    assert zb1 and 49 not in zb1


def test_trace_is_perfetto_json_and_deterministic(tmp_path):
    import json

    from megapipe.report.trace import trace_json, write_trace

    schedule = _build("zb_h1", 3, 4)
    result = simulate(schedule, StageTimes.uniform(3, fwd_ms=1.0, input_grad_ms=1.0, wgrad_ms=0.5))
    document = json.loads(trace_json(result))
    ops = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == schedule.num_ops
    first = next(e for e in ops if e["name"] == "2F0")
    assert first["tid"] == 2 and first["ts"] == 2000.0 and first["dur"] == 1000.0
    assert {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"} == {
        "rank 0", "rank 1", "rank 2"}
    path_a, path_b = write_trace(result, tmp_path / "a.json"), write_trace(result, tmp_path / "b.json")
    assert open(path_a, "rb").read() == open(path_b, "rb").read()


def test_gantt_png_is_written_and_deterministic(tmp_path):
    from megapipe.report.gantt import gantt_png

    result = simulate(_build("1f1b", 4, 6), StageTimes.uniform(4, fwd_ms=1.0, input_grad_ms=2.0))
    first = gantt_png(result, str(tmp_path / "a.png"))
    second = gantt_png(result, str(tmp_path / "b.png"))
    data = open(first, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert data == open(second, "rb").read()


def _run_command(tmp_path, capsys, *overrides):
    from megapipe.commands import painter
    from megapipe.commands.simulate import prepare, run
    from megapipe.config import compose

    cfg = compose(["output.format=json", f"output.dir={tmp_path}", *overrides])
    run(prepare(cfg), directory=str(tmp_path))
    painter.finish()  # the pictures, as the CLI draws them after the answer
    import json

    return json.loads(capsys.readouterr().out)


def test_command_with_stage_times_all_schedules(tmp_path, capsys):
    document = _run_command(tmp_path, capsys, "schedule=all", "parallel.pipeline_model_parallel_size=4",
                            "train.num_microbatches=8", "stage_times=[[1,1,1],[1,1,1],[1,1,1],[1,1,1]]")
    assert set(document) == set(SCHEDULE_NAMES)
    assert document["1f1b"]["bubble_fraction"] == pytest.approx(3 / 11, abs=1e-6)
    assert document["zb_h2"]["steady_bubble_fraction"] == 0.0
    assert document["zb_v"]["stages"][0]["peak_in_flight"] == 8
    assert {"busy_ms", "idle_ms", "bubble_fraction", "peak_in_flight", "peak_activation_bytes"} <= set(
        document["gpipe"]["stages"][0])
    assert (tmp_path / "zb_v_gantt.png").exists() and (tmp_path / "dualpipe_v_trace.json").exists()


def test_command_from_the_cost_model(tmp_path, capsys):
    document = _run_command(tmp_path, capsys, "schedule=1f1b", "parallel.pipeline_model_parallel_size=8",
                            "train.num_microbatches=32", "output.pictures=false")
    assert document["schedule"] == "1f1b" and len(document["stages"]) == 8
    assert document["step_time_ms"] > 0 and document["bubble_fraction"] >= document["closed_form_bubble_equal_stages"]
    assert [s["peak_in_flight"] for s in document["stages"]] == [8, 7, 6, 5, 4, 3, 2, 1]
    assert not list(tmp_path.iterdir())


def test_command_rejects_bad_stage_times(tmp_path, capsys):
    from megapipe.errors import ConfigError

    with pytest.raises(ConfigError, match="stage_times has 2 triples; zb_v with pipeline_model_parallel_size=4"):
        _run_command(tmp_path, capsys, "schedule=zb_v", "parallel.pipeline_model_parallel_size=4",
                     "train.num_microbatches=8", "stage_times=[[1,1,1],[1,1,1]]")
    with pytest.raises(ScheduleError, match="interleaved_1f1b needs virtual_pipeline_model_parallel_size >= 2"):
        _run_command(tmp_path, capsys, "schedule=interleaved_1f1b", "parallel.pipeline_model_parallel_size=4",
                     "parallel.virtual_pipeline_model_parallel_size=1", "train.num_microbatches=8",
                     "stage_times=[[1,1,1],[1,1,1],[1,1,1],[1,1,1]]")


def test_stage_times_set_the_pipeline_size_and_bad_times_are_one_line(tmp_path, capsys):
    import json

    from megapipe.cli import main

    triples = "stage_times=[[1,1,1],[1,1,1],[1,1,1],[1,1,1]]"
    assert main(["simulate", "schedule=zb_h1", triples, "train.num_microbatches=8", f"output.dir={tmp_path}",
                 "output.format=json", "output.pictures=false"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Four equal stages, F = B = W = 1: ZB-H1 idles (p - 1)(F + B - W) = 3 ms per rank over m(F + B + W) = 24 ms.
    assert result["pipeline_model_parallel_size"] == 4
    assert result["step_time_ms"] == pytest.approx(27.0)
    assert result["bubble_fraction"] == pytest.approx(3 / 27)
    for bad, fragment in (("[[1,-1,1],[1,1,1]]", "B=-1.0"), ("[[1,nan,1],[1,1,1]]", "B=nan")):
        assert main(["simulate", f"stage_times={bad}", "train.num_microbatches=4", f"output.dir={tmp_path}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0]


def test_gantt_blends_ops_thinner_than_a_pixel():
    """A thousand microbatches on 32 ranks: each rank's row is one image of blended pixel columns (drawing each op
    at a pixel would paint stripes that are not there), and the legend says how to read it."""
    from matplotlib.image import AxesImage

    from megapipe.report.gantt import gantt_figure

    result = simulate(_build("1f1b", 32, 1024), StageTimes.uniform(32, fwd_ms=1.0, input_grad_ms=2.0))
    figure = gantt_figure(result)
    axes = figure.axes[0]
    assert sum(isinstance(child, AxesImage) for child in axes.get_children()) == 32
    assert any("mixes the colours" in text.get_text() for legend in figure.legends for text in legend.get_texts())
    few = gantt_figure(simulate(_build("1f1b", 4, 6), StageTimes.uniform(4, fwd_ms=1.0, input_grad_ms=2.0)))
    assert not any(isinstance(child, AxesImage) for child in few.axes[0].get_children())


def test_closed_form_lowering_equals_the_checked_one():
    """1F1B and interleaved 1F1B orders from the builder's closed form lower to the same program, field by field,
    as checking every action does."""
    import dataclasses

    from megapipe.schedules import registry
    from megapipe.simulate import program

    compared = 0
    for name in ("1f1b", "interleaved_1f1b"):
        for pp in (1, 2, 3, 4, 8):
            for v in (1, 2, 3, 5):
                for m in sorted({pp, 2 * pp, 3 * pp, 16, 24}):
                    try:
                        schedule = registry.build(name, pipeline_model_parallel_size=pp, num_microbatches=m,
                                                  virtual_pipeline_model_parallel_size=v)
                    except ScheduleError:
                        continue
                    assert schedule.rank_ops is not None
                    fast, checked = program._lower_closed_form(schedule), program._lower_checked(schedule)
                    for field in dataclasses.fields(program.Program):
                        ours, theirs = getattr(fast, field.name), getattr(checked, field.name)
                        assert [list(x) if isinstance(x, (list, tuple)) else x for x in ours] == \
                            [list(x) if isinstance(x, (list, tuple)) else x for x in theirs], field.name
                    compared += 1
    assert compared > 50


def test_sorted_unique_and_counts_are_numpys():
    import numpy as np

    from megapipe.arrays import sorted_unique, unique_counts

    rng = np.random.default_rng(0)
    for _ in range(200):
        values = rng.integers(-3, 7, size=int(rng.integers(0, 40)))
        assert np.array_equal(sorted_unique(values * 0.1), np.unique(values * 0.1))
        assert all(np.array_equal(a, b) for a, b in zip(unique_counts(values), np.unique(values, return_counts=True)))
