"""The training monitor on real megatron-core 0.16.1 schedules (CPU, gloo, 2 ranks).

All scenarios run in ONE spawn of two ranks (imports dominate the cost); the
tests check what each scenario returned. Weights stay fixed (no optimizer), so
every run's per-step losses depend only on the data: a monitored run must give
the unmonitored run's losses exactly, whatever the monitor does or fails to do.
"""

from __future__ import annotations

import math

import pytest

import _megatron_cpu as mc

pytestmark = pytest.mark.engine

STEPS = 4
MICROBATCHES = 4
DELAYS = mc.UnitDelays(decoder=(4.0, 8.0), loss=(12.0, 24.0))
TOKENS = MICROBATCHES * 2 * 16  # microbatches x micro_batch_size x seq_length


def _plan(step_time_s: float) -> dict:
    """A megapipe-plan/1 document with the fields the monitor reads (a deliberately wrong step time)."""
    stage = {"time_ms": 10.0, "static_bytes": 1.0, "activation_bytes": 1.0, "total_bytes": 2.0}
    return {
        "format": "megapipe-plan/1",
        "topology": {"intra_node": {"kind": "loopback", "bandwidth_gbytes_per_s": 2.0, "latency_us": 50.0},
                     "inter_node": {"kind": "loopback", "bandwidth_gbytes_per_s": 2.0, "latency_us": 50.0},
                     "gpus_per_node": 2},
        "best": {"step_time_s": step_time_s, "bubble_fraction": 0.2, "stages": [stage, stage],
                 "layout": "Et*2|t*2L", "decoder_layers_per_stage": [2, 2], "schedule": "1f1b",
                 "parallel": {"pipeline_model_parallel_size": 2}, "train": {"num_microbatches": MICROBATCHES}},
    }


def _run(*, monitor_kwargs: dict | None, inject=None, steps: int = STEPS):
    from megapipe.monitor.monitor import attach_monitor

    mc.init_model_parallel(pipeline_model_parallel_size=2)
    models = mc.build_gpt_chunks(layout="Et*2|t*2L", num_layers=4, delays_ms=DELAYS)
    mon = None
    if monitor_kwargs is not None:
        mon = attach_monitor(models, tokens_per_step=TOKENS, log_every=1, **monitor_kwargs)
        if inject is not None:
            inject(mon)
        mon.train_start()
    logged = []

    def between(step):
        if mon is not None:
            logged.append(mon.step_end(step))

    run = mc.train_steps(models, num_steps=steps, num_microbatches=MICROBATCHES, between_steps=between)
    enabled = mon.enabled if mon is not None else None
    if mon is not None:
        mon.train_end()
    restored = all(not type(m.config.timers).__name__.endswith("TimersProxy") for m in models)
    return {"losses": run.losses, "logged": logged, "messages": list(mon.messages) if mon else [],
            "enabled": enabled, "restored": restored,
            "hook_latency_ms": mon.hook.p2p_latency_ms if mon is not None and mon.hook is not None else None,
            "links": [(l.peer, l.bandwidth_gbytes_per_s, l.latency_us) for l in (mon.links if mon else [])]}


def _raise_after(count: int, exc: Exception):
    calls = [0]

    def fn(*args, **kwargs):
        calls[0] += 1
        if calls[0] > count:
            raise exc
        return 0.0
    return fn


def _scenarios(rank, world_size, log_dir):
    with mc.megatron_cpu():
        return _all(rank, log_dir)


def _all(rank, log_dir):
    out = {"reference": _run(monitor_kwargs=None)}
    out["monitored"] = _run(monitor_kwargs=dict(
        log_dir=f"{log_dir}/main", plan=_plan(step_time_s=1e-4), run_dir=log_dir,
        expected_link={"kind": "infiniband", "bandwidth_gbytes_per_s": 1e3, "latency_us": 1.0}))
    measured = out["monitored"]["links"][0][1]
    out["matching"] = _run(monitor_kwargs=dict(
        expected_link={"kind": "loopback", "bandwidth_gbytes_per_s": measured, "latency_us": 50.0},
        topology_threshold=4.0))  # loopback bandwidth swings several-fold when other processes share the cores

    def hook_fault(mon):  # the schedule hook's clock raises on rank 0 from its 30th mark on
        if rank == 0:
            clock = mon.hook._clock
            real = clock.now
            calls = [0]

            def now():
                calls[0] += 1
                if calls[0] > 30:
                    raise RuntimeError("injected clock failure")
                return real()
            clock.now = now

    def sink_fault(mon):
        if rank == 1:
            mon.sinks.append(_raise_after(1, RuntimeError("injected logger failure")))

    def gather_fault(mon):  # a failing collective fails on every rank
        mon._exchange = _raise_after(1, RuntimeError("injected gather failure"))

    def nan_metric(mon):
        if rank == 1:
            import megapipe.monitor.monitor as module

            real = module.sample_memory

            def nan_sample(**kwargs):
                sample = real(**kwargs)
                return type(sample)(device=sample.device, peak_allocated_bytes=math.nan,
                                    peak_reserved_bytes=sample.peak_reserved_bytes, rss_bytes=sample.rss_bytes,
                                    capacity_bytes=sample.capacity_bytes)
            module.sample_memory = nan_sample

    for name, inject in (("hook_fault", hook_fault), ("sink_fault", sink_fault), ("gather_fault", gather_fault),
                         ("nan", nan_metric)):
        out[name] = _run(monitor_kwargs=dict(log_dir=f"{log_dir}/{name}", topology_check=False), inject=inject)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("monitor"))
    return mc.run_ranks(_scenarios, world_size=2, args=(log_dir,), timeout_s=240), log_dir


def test_training_unchanged_by_monitor_and_its_faults(results):
    ranks, _ = results
    for rank in ranks:
        for name in ("monitored", "matching", "hook_fault", "sink_fault", "gather_fault", "nan"):
            assert rank[name]["losses"] == rank["reference"]["losses"], name
            assert len(rank[name]["losses"]) == STEPS
            assert rank[name]["restored"], name


def test_faults_turn_monitor_off_on_every_rank_once(results):
    ranks, _ = results
    for name in ("hook_fault", "sink_fault", "gather_fault"):
        for rank in ranks:
            offs = [m for m in rank[name]["messages"] if "turned off" in m]
            assert len(offs) == 1, (name, rank[name]["messages"])
            assert rank[name]["enabled"] is False
            assert rank[name]["logged"][-1] == {}, name


def test_nan_rank_is_flagged_and_left_out(results):
    from megapipe.monitor.jsonl import read_monitor

    ranks, log_dir = results
    assert ranks[0]["nan"]["enabled"] is True and ranks[1]["nan"]["enabled"] is True, ranks[0]["nan"]["messages"]
    pipeline = [r for r in read_monitor(f"{log_dir}/nan") if r["kind"] == "pipeline"]
    assert len(pipeline) == STEPS
    for record in pipeline:
        assert record["nan_ranks"] == [1]
        assert record["stage_peak_bytes"][1] is None and record["stage_peak_bytes"][0] > 0
        assert record["memory_spread"] == 0.0  # one finite stage left


def test_metrics_and_jsonl_records(results):
    from megapipe.monitor.jsonl import read_monitor, stage_times

    ranks, log_dir = results
    metrics = ranks[0]["monitored"]["logged"][-1]
    assert 0.0 < metrics["megapipe/bubble_fraction"] < 1.0
    assert metrics["megapipe/simulated_bubble_fraction"] == pytest.approx(metrics["megapipe/bubble_fraction"], rel=0.25)
    assert 0.0 < metrics["megapipe/dispatch_ms"] < 0.1 * metrics["megapipe/simulated_step_ms"]
    assert metrics["megapipe/memory_spread"] >= 0.0 and metrics["megapipe/memory_cv"] >= 0.0
    step_s = metrics["megapipe/step_time_ms"] / 1e3
    # stage 1 sleeps 2 x 4 + 12 ms forward, 2 x 8 + 24 ms backward per microbatch: a lower bound on the step
    assert step_s >= MICROBATCHES * (20 + 40) / 1e3
    assert metrics["megapipe/tokens_per_s"] == pytest.approx(TOKENS / step_s)
    assert metrics["megapipe/tokens_per_s_per_gpu"] == pytest.approx(TOKENS / step_s / 2)
    assert "megapipe/bubble_fraction" not in ranks[1]["monitored"]["logged"][-1]  # aggregates on rank 0 only
    records = read_monitor(f"{log_dir}/main")
    kinds = [r["kind"] for r in records]
    assert kinds.count("start") == 2 and kinds.count("rank") == 2 * STEPS and kinds.count("pipeline") == STEPS
    times = stage_times(records)
    assert len(times) == 2
    assert times[1][0] >= 20.0 * 0.95 and times[1][1] >= 40.0 * 0.95  # at least the sleeps (real compute on top)
    assert times[1][0] > times[0][0]  # the loss head's sleep sits on stage 1


def test_layout_logged_from_megatron_config_and_replan_reads_it(results):
    from megapipe.monitor.jsonl import read_monitor
    from megapipe.monitor.measured import measured_run

    _, log_dir = results
    records = read_monitor(f"{log_dir}/nan")  # no plan and no layout= given: megatron-core's layout object
    assert {r["layout"] for r in records if r["kind"] in ("start", "pipeline")} == {"Et*2|t*2L"}
    run = measured_run(records)
    assert run.layout == "Et*2|t*2L" and len(run.stage_forward_ms) == 2


def test_link_latency_feeds_the_hook_simulator(results):
    ranks, _ = results
    for rank in ranks:
        peer, _, latency_us = rank["monitored"]["links"][0]
        assert rank["monitored"]["hook_latency_ms"] == pytest.approx(latency_us / 1e3)
        assert rank["nan"]["hook_latency_ms"] == 0.0  # no link check, no latency given


def test_drift_and_topology_warnings(results):
    ranks, log_dir = results
    messages = ranks[0]["monitored"]["messages"]
    drift = [m for m in messages if m.startswith("drift: measured step_time_s")]
    assert len(drift) == 1, messages  # warned once though every step drifts
    assert f"megapipe replan {log_dir}" in drift[0]
    topo = [m for m in messages if m.startswith("topology:")]
    assert len(topo) == 1 and "plan assumed infiniband 1000 GB/s" in topo[0] and "like" in topo[0]
    assert not [m for m in ranks[1]["monitored"]["messages"] if m.startswith("topology:")]  # lower rank reports
    assert not [m for r in ranks for m in r["matching"]["messages"] if m.startswith("topology:")]
    peer, bandwidth, latency = ranks[0]["monitored"]["links"][0]
    assert peer == 1 and bandwidth > 0 and latency >= 0
