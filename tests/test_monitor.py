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
                     "layout": "Et|tL", "decoder_layers_per_stage": [1, 1], "schedule": "1f1b",
                     "parallel": {"pipeline_model_parallel_size": 2}, "train": {"num_microbatches": 4}}}


def test_drift_figures_and_advice():
    plan = drift.expectation(_plan())
    found = {d.figure: d for d in drift.drifts(plan, step_time_s=2.5, bubble_fraction=0.3, stage_peak_bytes=[100.0, 150.0])}
    assert found["step_time_s"].drift == pytest.approx(0.25)
    assert found["bubble_fraction"].drift == pytest.approx(0.05) and not found["bubble_fraction"].relative
    assert found["stage_memory_bytes"].drift == pytest.approx(0.25) and found["stage_memory_bytes"].predicted == 200.0
    text = drift.advice(found["step_time_s"], threshold=0.1, run_dir="runs/a")
    assert "megapipe replan runs/a" in text and "profile=" in text
    _check_suggested_commands(text)
    assert [d.figure for d in drift.drifts(plan, step_time_s=None, bubble_fraction=math.nan, stage_peak_bytes=None)] == []
    from megapipe.plandir import checked_plan_document

    with pytest.raises(ConfigError, match="megapipe-plan/1"):
        checked_plan_document({"format": "megapipe-profile/1"})


def _check_suggested_commands(text):
    """Each command the advice names is a CLI subcommand, and its key=value words compose as overrides."""
    import importlib
    import re

    from megapipe.config import compose

    commands = re.findall(r"`(megapipe [^`]+)`", text)
    assert [c.split()[1] for c in commands] == ["replan", "plan"]
    for command in commands:
        module = importlib.import_module(f"megapipe.commands.{command.split()[1]}")
        assert callable(module.run)
        overrides = [word for word in command.split()[2:] if "=" in word]
        cfg = compose(["model=tiny_gpt", "cluster=cpu_gloo",
                       *(f"{word.split('=')[0]}=measured.yaml" for word in overrides)])
        assert all(cfg[word.split("=")[0]] == "measured.yaml" for word in overrides)


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


# ------------------------------------------------------- layout and MFU without extra arguments


@pytest.mark.parametrize("layout, pp, vp, expected", [
    ("Et|(t|)*2,tL", 2, 2, "Et|t|t|tL"),
    ("Et*2|t*2L", 2, None, "Et*2|t*2L"),
    ([["embedding", "decoder"], ["decoder"] * 3 + ["loss"]], 2, None, "Et|t*3L"),
])
def test_layout_read_back_from_megatron_config(layout, pp, vp, expected):
    import torch
    from megatron.core.transformer import TransformerConfig

    from megapipe.layout import parse_layout
    from megapipe.monitor.run_layout import layout_string

    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=pp,
                               virtual_pipeline_model_parallel_size=vp, pipeline_dtype=torch.float32,
                               pipeline_model_parallel_layout=layout)
    value = config.pipeline_model_parallel_layout
    assert type(value).__name__ == "PipelineParallelLayerLayout"  # what megatron-core keeps after __post_init__
    text = layout_string(value)
    assert text == expected
    # the same units in Megatron's layer-id order (flatten_layout)
    kinds = [kind.value for stage in parse_layout(text) for kind in stage]
    assert kinds == [t.name for t in value.flatten_layout]


def test_monitor_log_records_layout_from_config(tmp_path):
    import torch
    from megatron.core.transformer import TransformerConfig

    from megapipe.monitor.monitor import attach_monitor

    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, pipeline_model_parallel_layout="E(t)*3|tL")
    mon = attach_monitor([config], log_dir=str(tmp_path), pipeline_group=None, schedule_hook=False)
    mon.train_start()
    mon.train_end()
    start = [r for r in jsonl.read_monitor(str(tmp_path)) if r["kind"] == "start"]
    assert start[0]["layout"] == "Et*3|tL"


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from megapipe.cli import main

    out = tmp_path_factory.mktemp("plan")
    assert main(["plan", "model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8", f"output.dir={out}",
                 "output.format=json"]) == 0
    return str(out / "plan.yaml")


def test_plan_rates_reproduce_the_planners_mfu(tiny_plan, capsys):
    import yaml

    from megapipe.monitor.throughput import plan_rates, throughput

    with open(tiny_plan, encoding="utf-8") as handle:
        document = yaml.safe_load(handle)
    best = document["best"]
    rates = plan_rates(document)
    assert rates.tokens_per_step == best["train"]["global_batch_size"] * best["train"]["seq_length"]
    # at the plan's own step time the monitor's convention gives the plan's throughput and MFU
    tp = throughput(tokens_per_step=rates.tokens_per_step, step_time_s=best["step_time_s"],
                    num_gpus=document["cluster"]["num_gpus"], flops_per_token=rates.flops_per_token,
                    peak_tflops_per_gpu=rates.peak_tflops_per_gpu)
    assert tp.tokens_per_s == pytest.approx(best["tokens_per_s"], rel=1e-9)
    assert tp.mfu == pytest.approx(best["mfu"], rel=1e-9)
    assert plan_rates({**document, "model": None}) is None
    with pytest.raises(ConfigError, match="plan.yaml model/train section"):
        plan_rates({**document, "model": {"name": "broken"}})


def test_monitor_reports_mfu_from_plan_alone(tiny_plan, tmp_path):
    import time

    import yaml

    from megapipe.monitor.monitor import attach_monitor
    from megapipe.monitor.throughput import plan_rates

    with open(tiny_plan, encoding="utf-8") as handle:
        rates = plan_rates(yaml.safe_load(handle))
    mon = attach_monitor(log_dir=str(tmp_path), plan=tiny_plan, warmup_steps=0, log_every=1, topology_check=False)
    mon.train_start()
    time.sleep(0.01)
    metrics = mon.step_end(0)
    mon.train_end()
    step_s = metrics["megapipe/step_time_ms"] / 1e3
    expected = rates.tokens_per_step * rates.flops_per_token / step_s / (rates.peak_tflops_per_gpu * 1e12)
    assert metrics["megapipe/mfu"] == pytest.approx(expected, rel=1e-9)
    assert metrics["megapipe/tflops_per_gpu"] == pytest.approx(expected * rates.peak_tflops_per_gpu, rel=1e-9)
    start = [r for r in jsonl.read_monitor(str(tmp_path)) if r["kind"] == "start"][0]
    assert start["flops_per_token"] == rates.flops_per_token and start["tokens_per_step"] == rates.tokens_per_step
