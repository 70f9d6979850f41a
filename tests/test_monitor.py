"""Pure parts of the training monitor: link fit, memory spread, throughput, drift, JSONL records."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.errors import ConfigError
from megapipe.monitor import drift, jsonl, memory, throughput, topology


@settings(max_examples=60, deadline=None)
@given(bandwidth=st.floats(0.01, 1000.0), latency_us=st.floats(0.0, 500.0),
       sizes=st.lists(st.integers(1, 1 << 26), min_size=2, max_size=5, unique=True))
def test_fit_link_recovers_hockney_line(bandwidth, latency_us, sizes):
    times = [latency_us * 1e-6 + n / (bandwidth * 1e9) for n in sizes]
    got_bw, got_lat = topology.fit_link(sizes, times)
    assert got_bw == pytest.approx(bandwidth, rel=1e-6)
    assert got_lat == pytest.approx(latency_us, rel=1e-6, abs=1e-6 * (1 + max(times) * 1e6))


def test_fit_link_noisy_slope_falls_back_to_largest_message():
    bw, lat = topology.fit_link([1000, 2000], [2e-6, 1e-6])  # bigger message faster: no line
    assert bw == pytest.approx(2000 / 1e-6 / 1e9) and lat == pytest.approx(2.0)


@given(st.floats(0.0, 5000.0), st.floats(0.0, 5000.0))
def test_like_kind_is_monotone(a, b):
    order = [kind for _, kind in topology._KINDS][::-1]
    lo, hi = sorted((a, b))
    assert order.index(topology.like_kind(lo)) <= order.index(topology.like_kind(hi))


def test_compare_link_threshold_and_message():
    link = topology.LinkMeasurement(peer=1, bandwidth_gbytes_per_s=2.1, latency_us=30.0, sizes=(1,), one_way_s=(1.0,))
    ib = {"kind": "infiniband", "bandwidth_gbytes_per_s": 50.0, "latency_us": 10.0}
    message = topology.compare_link(link, expected=ib)
    assert "plan assumed infiniband 50 GB/s" in message and "2.1 GB/s" in message and "like ethernet/loopback" in message
    assert topology.compare_link(link, expected={**ib, "bandwidth_gbytes_per_s": 2.5}) is None  # 16% < 20%
    assert topology.compare_link(link, expected={**ib, "bandwidth_gbytes_per_s": 2.5}, threshold=0.1) is not None


def test_expected_link_by_node():
    topo = {"intra_node": {"kind": "nvlink"}, "inter_node": {"kind": "infiniband"}, "gpus_per_node": 8}
    assert topology.expected_link(topo, rank=3, peer=7)["kind"] == "nvlink"
    assert topology.expected_link(topo, rank=7, peer=8)["kind"] == "infiniband"


@given(st.lists(st.floats(1.0, 1e12), min_size=1, max_size=8))
def test_spread_closed_form(values):
    got = memory.spread(values + [math.nan])
    mean = sum(values) / len(values)
    assert got.count == len(values)
    assert got.spread == pytest.approx((max(values) - min(values)) / mean)
    assert got.cv == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean, abs=1e-9)
    assert 0.0 <= got.cv <= got.spread + 1e-12 or len(values) == 1


def test_spread_empty_and_sample():
    assert memory.spread([math.nan, 0.0]) is None
    sample = memory.sample_memory()
    assert sample.device == "cpu" and sample.peak_bytes == sample.rss_bytes > 10 * 2**20


def test_throughput_against_planner_convention():
    tp = throughput.throughput(tokens_per_step=4096 * 8, step_time_s=2.0, num_gpus=8, flops_per_token=6e9,
                               peak_tflops_per_gpu=989.0)
    assert tp.tokens_per_s == 16384 and tp.tokens_per_s_per_gpu == 2048
    assert tp.tflops_per_gpu == pytest.approx(2048 * 6e9 / 1e12) and tp.mfu == pytest.approx(tp.tflops_per_gpu / 989)
    assert throughput.throughput(tokens_per_step=1, step_time_s=math.nan, num_gpus=1) is None
    assert throughput.throughput(tokens_per_step=1, step_time_s=1.0, num_gpus=1).mfu is None
    with pytest.raises(ConfigError, match="num_gpus=0"):
        throughput.throughput(tokens_per_step=1, step_time_s=1.0, num_gpus=0)


def _plan() -> dict:
    stage = {"time_ms": 10.0, "total_bytes": 100.0}
    return {"format": "megapipe-plan/1", "topology": {"gpus_per_node": 8},
            "best": {"step_time_s": 2.0, "bubble_fraction": 0.25, "stages": [stage, {**stage, "total_bytes": 200.0}],
                     "layout": "Et|tL", "layers_per_stage": [1, 1], "schedule": "1f1b",
                     "parallel": {"pipeline_model_parallel_size": 2}, "train": {"num_microbatches": 4}}}


def test_drift_figures_and_advice():
    plan = drift.expectation(_plan())
    found = {d.figure: d for d in drift.drifts(plan, step_time_s=2.5, bubble_fraction=0.3, stage_peak_bytes=[100.0, 150.0])}
    assert found["step_time_s"].drift == pytest.approx(0.25)
    assert found["bubble_fraction"].drift == pytest.approx(0.05) and not found["bubble_fraction"].relative
    assert found["stage_memory_bytes"].drift == pytest.approx(0.25) and found["stage_memory_bytes"].predicted == 200.0
    text = drift.advice(found["step_time_s"], threshold=0.1, run_dir="runs/a")
    assert "megapipe replan runs/a" in text and "profile=" in text
    assert [d.figure for d in drift.drifts(plan, step_time_s=None, bubble_fraction=math.nan, stage_peak_bytes=None)] == []
    with pytest.raises(ConfigError, match="megapipe-plan/1"):
        drift.expectation({"format": "megapipe-profile/1"})


def test_jsonl_round_trip_and_errors(tmp_path):
    for rank in (1, 0):
        writer = jsonl.JsonlWriter(str(tmp_path), rank=rank)
        writer.write("rank", 2, {"x": math.nan, "y": [1.0, math.inf]})
        writer.write("pipeline", 1, {"stage_forward_ms": [1.0, 2.0], "stage_backward_ms": [2.0, 4.0]})
        writer.write("pipeline", 2, {"stage_forward_ms": [3.0, 4.0], "stage_backward_ms": [6.0, 8.0]})
        writer.close()
    with open(jsonl.rank_file(str(tmp_path), 0), "a") as handle:
        handle.write('{"format": "megapipe-mon')  # a line cut by a killed run
    records = jsonl.read_monitor(str(tmp_path))
    assert [(r["step"], r["kind"], r["rank"]) for r in records][:3] == [(1, "pipeline", 0), (1, "pipeline", 1), (2, "rank", 0)]
    assert records[2]["x"] is None and records[2]["y"] == [1.0, None]
    assert jsonl.stage_times(records) == [[3.0, 6.0, 0.0], [4.0, 8.0, 0.0]]  # the first (warm-up) step dropped
    assert jsonl.stage_times(records, skip_steps=0)[0] == [2.0, 4.0, 0.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"format": "other"}) + "\n")
    with pytest.raises(ConfigError, match="expected 'megapipe-monitor/1'"):
        jsonl.read_monitor(str(bad))
    with pytest.raises(ConfigError, match="does not exist"):
        jsonl.read_monitor(str(tmp_path / "missing"))


def test_attach_monitor_rejects_bad_arguments():
    from megapipe.monitor.monitor import attach_monitor

    with pytest.raises(ConfigError, match="log_every=0"):
        attach_monitor(log_every=0)
    with pytest.raises(ConfigError, match="drift_threshold=-1"):
        attach_monitor(drift_threshold=-1)
    with pytest.raises(ConfigError, match="does not exist"):
        attach_monitor(plan="/nonexistent/plan.yaml")


def test_single_rank_monitor_without_model(tmp_path):
    from megapipe.monitor.monitor import attach_monitor

    seen = []
    mon = attach_monitor(log_dir=str(tmp_path), tokens_per_step=1000, warmup_steps=0, log_every=1,
                         sinks=[lambda metrics, step: seen.append((step, metrics))])
    mon.train_start()
    for step in range(3):
        mon.step_end(step)
    mon.train_end()
    assert [s for s, _ in seen] == [0, 1, 2]
    assert seen[-1][1]["megapipe/tokens_per_s"] == pytest.approx(1000 / (seen[-1][1]["megapipe/step_time_ms"] / 1e3))
    assert {r["kind"] for r in jsonl.read_monitor(str(tmp_path))} == {"start", "rank", "pipeline"}
