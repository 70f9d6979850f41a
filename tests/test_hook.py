"""Schedule hook: pure metric derivation, and the timer proxy driven in one process."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.errors import ConfigError
from megapipe.monitor import attach
from megapipe.monitor.metrics import (
    EventKind,
    StepMetrics,
    combine_rows,
    derive_step,
    mean_steps,
    pack_row,
    schedule_chunks,
    unpack_row,
)
from megapipe.monitor.predict import predict_bubble
from megapipe.simulate.bubble import closed_form_bubble


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), chunks=st.integers(1, 4), group=st.integers(1, 6))
def test_schedule_chunks_match_megatron_schedule_table(m, chunks, group):
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    table = get_schedule_table(m, chunks, group)
    assert schedule_chunks(num_microbatches=m, num_model_chunks=chunks, microbatch_group_size=group) == tuple(
        chunk for _, chunk in table
    )


_interval = st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 5.0), st.sampled_from(list(EventKind)))


@settings(max_examples=100, deadline=None)
@given(intervals=st.lists(_interval, max_size=40), tail=st.floats(0.0, 5.0))
def test_derived_step_partitions_the_wall(intervals, tail):
    starts, ends, kinds, now = [], [], [], 10.0
    for gap, duration, kind in intervals:
        starts.append(now + gap)
        ends.append(now + gap + duration)
        kinds.append(int(kind))
        now = ends[-1]
    step = derive_step(step_start=10.0, step_end=now + tail, starts=starts, ends=ends, kinds=kinds)
    tol = 1e-9 * max(1.0, step.wall_ms)
    assert step.bubble_ms >= -tol and step.other_ms >= -tol
    assert step.compute_ms + step.p2p_wait_ms + step.other_ms == pytest.approx(step.wall_ms)
    compute = [(s, e) for s, e, k in zip(starts, ends, kinds) if k <= EventKind.backward]
    last_end = compute[-1][1] if compute else 10.0
    assert sum(step.gaps_ms) + step.compute_ms + (now + tail - last_end) == pytest.approx(step.wall_ms)
    assert step.num_forward == kinds.count(EventKind.forward)
    if step.gaps_ms:
        at_most = sum(g <= step.dispatch_ms for g in step.gaps_ms)
        at_least = sum(g >= step.dispatch_ms for g in step.gaps_ms)
        assert min(at_most, at_least) >= len(step.gaps_ms) / 2  # the median stretch
    assert step.num_backward == kinds.count(EventKind.backward)
    assert step.warmup_idle_ms <= step.bubble_ms + tol and step.cooldown_idle_ms <= step.bubble_ms + tol
    assert unpack_row(pack_row(step, 1), 1) == StepMetrics(**{**_fields(step), "gaps_ms": ()})
    assert mean_steps([step, step]).wall_ms == pytest.approx(step.wall_ms)


def _fields(step):
    return {name: getattr(step, name) for name in StepMetrics.__slots__}


def _one_f_one_b_rank(*, rank, pp, m, fwd, bwd, dispatch=0.0):
    """A rank's metrics in the ideal 1F1B step with equal stages: idle (p-1)(F+B)."""
    wall = (m + pp - 1) * (fwd + bwd)
    return StepMetrics(
        wall_ms=wall, forward_ms=m * fwd, backward_ms=m * bwd, send_ms=0, recv_ms=0, exchange_ms=0,
        warmup_idle_ms=0, cooldown_idle_ms=0, max_gap_ms=0, num_forward=m, num_backward=m,
        chunk_forward_ms=(fwd,), chunk_backward_ms=(bwd,), dispatch_ms=dispatch,
    )


@pytest.mark.parametrize("pp, m, dispatch", [(2, 4, 0.5), (4, 8, 0.25), (3, 3, 1.0)])
def test_dispatch_overhead_closed_form(pp, m, dispatch):
    # equal stages, every op F + d and B + d: step (m + P - 1)(F + B + 2d); the bubble
    # counts only the measured compute m(F + B) per rank as busy
    fwd, bwd = 1.0, 2.0
    ranks = [_one_f_one_b_rank(rank=r, pp=pp, m=m, fwd=fwd, bwd=bwd, dispatch=dispatch + r) for r in range(pp)]
    prediction = predict_bubble(combine_rows(ranks, num_model_chunks=1), p2p_latency_ms=0.0)
    step = (m + pp - 1) * (fwd + bwd + 2 * dispatch)  # the smallest rank median is charged
    assert prediction.dispatch_ms == dispatch and prediction.step_time_ms == pytest.approx(step)
    assert prediction.bubble_fraction == pytest.approx(1 - m * (fwd + bwd) / step)
    plain = predict_bubble(combine_rows(ranks, num_model_chunks=1), charge_dispatch=False)
    assert plain.bubble_fraction == pytest.approx(closed_form_bubble("1f1b", pipeline_model_parallel_size=pp, num_microbatches=m))


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (3, 3)])
def test_combined_bubble_equals_closed_form_and_simulator(pp, m):
    ranks = [_one_f_one_b_rank(rank=r, pp=pp, m=m, fwd=1.0, bwd=2.0) for r in range(pp)]
    pipeline = combine_rows(ranks, num_model_chunks=1)
    closed = closed_form_bubble("1f1b", pipeline_model_parallel_size=pp, num_microbatches=m)
    assert pipeline.bubble_fraction == pytest.approx(closed)
    assert predict_bubble(pipeline).bubble_fraction == pytest.approx(closed)


def test_combine_orders_virtual_stages_vp_major():
    ranks = [
        StepMetrics(wall_ms=10, forward_ms=2, backward_ms=4, send_ms=0, recv_ms=0, exchange_ms=0, warmup_idle_ms=0,
                    cooldown_idle_ms=0, max_gap_ms=0, num_forward=4, num_backward=4,
                    chunk_forward_ms=(10.0 * r, 10.0 * r + 1), chunk_backward_ms=(0.0, 0.0))
        for r in range(3)
    ]
    pipeline = combine_rows(ranks, num_model_chunks=2)
    assert pipeline.stage_forward_ms == (0.0, 10.0, 20.0, 1.0, 11.0, 21.0)
    assert pipeline.num_microbatches == 2


# ----------------------------------------------------------------- timer proxy


def _config():
    from megatron.core.timers import Timers
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2)
    config.timers = Timers(log_level=0, log_option="minmax")
    return config


def _megatron_like_step(config, *, m, sleep_s=0.0):
    """The timer calls forward_backward_no_pipelining makes (schedules.py, 0.16.1)."""
    config.timers("forward-backward", log_level=1).start(barrier=False)
    for _ in range(m):
        config.timers("forward-compute", log_level=2).start()
        time.sleep(sleep_s)
        config.timers("forward-compute").stop()
        config.timers("backward-compute", log_level=2).start()
        time.sleep(2 * sleep_s)
        config.timers("backward-compute").stop()
    config.timers("forward-backward").stop()


def test_pipeline_size_one_measures_without_bubble():
    config = _config()
    hook = attach([config], gather_every=1, plan=0.25)
    _megatron_like_step(config, m=3, sleep_s=0.002)
    report = hook.last_report
    assert report.pipeline is None and report.measured_bubble_fraction is None
    assert report.plan_bubble_fraction == 0.25
    assert report.rank.num_forward == 3 == report.rank.num_backward
    assert report.rank.forward_ms >= 6.0 and report.rank.backward_ms >= 12.0
    assert report.rank.compute_ms <= report.rank.wall_ms


def test_unknown_timer_names_pass_through_to_wrapped_timers():
    config = _config()
    original = config.timers
    attach(config)
    assert config.timers("interval-time", log_level=0) is original("interval-time", log_level=0)
    assert config.timers("some-new-timer") is original("some-new-timer")
    assert config.timers.log == original.log  # everything else is delegated (same bound method)


def test_fault_inside_hook_is_logged_once_and_restores_timers(caplog):
    config = _config()
    original = config.timers
    calls = []

    def broken(report):
        calls.append(report)
        raise ValueError("broken consumer")

    hook = attach(config, gather_every=1, on_report=broken)
    with caplog.at_level(logging.ERROR, logger="megapipe.monitor"):
        for _ in range(3):
            _megatron_like_step(config, m=2)
    assert len(calls) == 1 and not hook.enabled
    assert config.timers is original
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_capacity_overflow_skips_the_step_and_warns_once(caplog):
    config = _config()
    hook = attach(config, gather_every=1, capacity=16)
    with caplog.at_level(logging.WARNING, logger="megapipe.monitor"):
        _megatron_like_step(config, m=20)
        _megatron_like_step(config, m=20)
        _megatron_like_step(config, m=4)
    assert hook.enabled and len(hook.reports) == 1 and hook.last_report.rank.num_forward == 4
    assert len([r for r in caplog.records if "capacity" in r.getMessage()]) == 1


def test_gather_every_averages_a_window():
    config = _config()
    hook = attach(config, gather_every=2)
    for m in (2, 4, 6):
        _megatron_like_step(config, m=m)
    assert len(hook.reports) == 1
    assert hook.last_report.rank.num_forward == 3 and hook.last_report.rank.num_steps == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [({"gather_every": 0}, "gather_every"), ({"capacity": 2}, "capacity"), ({"timing": "wall"}, "timing"),
     ({"p2p_latency_ms": -1}, "p2p_latency_ms"), ({"plan": 1.5}, "plan bubble fraction")],
)
def test_bad_arguments_raise_config_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        attach(_config(), **kwargs)


def test_detach_restores_original_timers():
    config = _config()
    original = config.timers
    hook = attach(config)
    hook.detach()
    assert config.timers is original
