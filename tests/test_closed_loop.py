"""The closed loop on real megatron-core 0.16.1 (CPU, gloo, 2 ranks): plan -> monitored run -> replan -> run.

A tiny GPT whose vocab head is deliberately expensive (UnitDelays sleeps: 20 ms
forward, 40 ms backward per microbatch against 2 / 4 ms per decoder layer) is
planned from a profile that claims the head costs a decoder layer. The first run
uses that plan's layout with the training monitor attached; ``megapipe replan``
reads its logs and proposes a layout; the second run uses it. The measured step
time must drop and the per-rank compute spread must shrink. A third run uses the
layout replanned with ``search.replan_attribution=kind`` from the same first run.
"""

from __future__ import annotations

import json

import pytest

import _megatron_cpu as mc

pytestmark = pytest.mark.engine

NUM_LAYERS = 8
MICROBATCHES = 4
STEPS = 5
DELAYS = mc.UnitDelays(embedding=(0.0, 0.0), decoder=(2.0, 4.0), loss=(20.0, 40.0))
REPLAN_CFG = ["model=tiny_gpt", "cluster=cpu_gloo", f"model.num_layers={NUM_LAYERS}",
              "parallel.tensor_model_parallel_size=1", "schedule=1f1b"]


def _wrong_profile():
    from megapipe.records import LayerCost, LayerKind, Profile

    def unit(name, kind, fwd_ms, bwd_ms):
        return LayerCost(name=name, kind=kind, fwd_ms=fwd_ms, bwd_ms=bwd_ms, wgrad_ms=bwd_ms / 2,
                         static_bytes=1e6, act_bytes=1e5)

    layers = [unit("embedding", LayerKind.embedding, 0.1, 0.2)]
    layers += [unit(f"decoder.{i}", LayerKind.decoder, 2.0, 4.0) for i in range(NUM_LAYERS)]
    layers.append(unit("loss", LayerKind.loss, 2.0, 4.0))  # wrong: the head is 10x a decoder layer
    return Profile(layers=tuple(layers), device="cpu", meta=(("source", "hand-written, head underestimated"),))


def _monitored_run(layout: str, log_dir: str) -> list[float]:
    from megapipe.monitor.monitor import attach_monitor

    mc.init_model_parallel(pipeline_model_parallel_size=2)
    models = mc.build_gpt_chunks(layout=layout, num_layers=NUM_LAYERS, delays_ms=DELAYS)
    mon = attach_monitor(models, log_dir=log_dir, layout=layout, topology_check=False, warmup_steps=1, log_every=1)
    mon.train_start()
    run = mc.train_steps(models, num_steps=STEPS, num_microbatches=MICROBATCHES,
                         between_steps=lambda step: mon.step_end(step))
    mon.train_end()
    return run.wall_s


def _loop(rank, world_size, layout, run1, run2, run3, out):
    import torch.distributed as dist

    with mc.megatron_cpu():
        first = _monitored_run(layout, run1)
        dist.barrier()
        summary = [None, None]
        if rank == 0:
            summary = [_replan(run1, out), _replan(run1, f"{out}-kind", "search.replan_attribution=kind")]
        dist.broadcast_object_list(summary, src=0)
        second = _monitored_run(summary[0]["new_layout"], run2)
        third = _monitored_run(summary[1]["new_layout"], run3)
    return {"first": first, "second": second, "third": third, "summary": summary[0], "kind": summary[1]}


def _replan(run_dir: str, out: str, *extra: str) -> dict:
    import yaml

    from megapipe.commands import replan
    from megapipe.config import compose

    cfg = compose([*REPLAN_CFG, f"input={run_dir}", f"output.dir={out}", "output.format=json", *extra])
    replan.run(replan.prepare(cfg), directory=out)
    with open(f"{out}/replan.yaml", encoding="utf-8") as handle:
        return yaml.safe_load(handle)


BALANCED = ("Et*7|tL", "Et*8|L")
"""The two best splits of the true costs, within noise of each other."""


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    from megapipe.profile.format import save_profile
    from megapipe.partition import solve
    from megapipe.records import StageSpec

    # Real runs on a shared 2-core machine: when the OS delays a rank during the measured run, the measured
    # kinds are skewed and the replan lands elsewhere (seen once, under load: Et*6|t*2L); such a disturbed
    # loop is run again, once.
    for _ in range(2):
        root = tmp_path_factory.mktemp("loop")
        wrong = _wrong_profile()
        run1, run2, run3, out = root / "run1", root / "run2", root / "run3", root / "replan1"
        run1.mkdir()
        save_profile(wrong, run1 / "profile.yaml")
        layout = solve(wrong, [StageSpec()] * 2, num_microbatches=MICROBATCHES).layout
        ranks = mc.run_ranks(_loop, world_size=2, args=(layout, str(run1), str(run2), str(run3), str(out)),
                             timeout_s=240)
        if ranks[0]["kind"]["new_layout"] in BALANCED:
            break
    return {"layout": layout, "ranks": ranks, "run1": str(run1), "run2": str(run2),
            "run3": str(run3)}


def _measured(run_dir: str):
    from megapipe.monitor.jsonl import read_monitor
    from megapipe.monitor.measured import measured_run

    return measured_run(read_monitor(run_dir))


def test_replan_improves_the_measured_run(loop):
    summary = loop["ranks"][0]["summary"]
    assert loop["layout"] == "Et*4|t*4L"  # what the wrong profile plans
    assert summary["old_layout"] == loop["layout"] and summary["suggest"]
    assert summary["new_layout"] != loop["layout"] and summary["predicted_gain"] >= 0.02
    first, second = _measured(loop["run1"]), _measured(loop["run2"])
    assert second.layout == summary["new_layout"]
    assert second.step_time_ms < first.step_time_ms
    assert second.compute_spread_ms < first.compute_spread_ms
    for rank in loop["ranks"]:  # the schedule's own wall time, after the warm-up step
        assert sorted(rank["second"][1:])[STEPS // 2 - 1] < sorted(rank["first"][1:])[STEPS // 2 - 1]
    print(json.dumps({  # the figures docs/validation.md records (pytest -s shows them)
        "run1_layout": first.layout, "run1_step_ms": round(first.step_time_ms, 1),
        "run1_rank_compute_ms": [round(t, 2) for t in first.rank_compute_ms],
        "predicted_gain": summary["predicted_gain"], "predicted_old_ms": summary["old_step_time_ms"],
        "predicted_new_ms": summary["new_step_time_ms"],
        "run2_layout": second.layout, "run2_step_ms": round(second.step_time_ms, 1),
        "run2_rank_compute_ms": [round(t, 2) for t in second.rank_compute_ms],
        "measured_gain": round(first.step_time_ms / second.step_time_ms - 1, 4)}))


def test_kind_attribution_reaches_the_balanced_layout(loop):
    kind = loop["ranks"][0]["kind"]
    first, third = _measured(loop["run1"]), _measured(loop["run3"])
    # Decoders cost 6 ms and the head 60 ms per microbatch plus real compute, so the two best splits,
    # 42 | 6 + 60 and 48 | 60, are within noise of each other; either moves the head's whole excess.
    assert kind["new_layout"] == third.layout and third.layout in BALANCED
    assert third.step_time_ms < first.step_time_ms and third.compute_spread_ms < first.compute_spread_ms
    assert kind["new_step_time_ms"] == pytest.approx(third.step_time_ms, rel=0.15)
    print(json.dumps({
        "kind_predicted_gain": kind["predicted_gain"], "kind_predicted_new_ms": kind["new_step_time_ms"],
        "run3_layout": third.layout, "run3_step_ms": round(third.step_time_ms, 1),
        "run3_rank_compute_ms": [round(t, 2) for t in third.rank_compute_ms],
        "measured_gain": round(first.step_time_ms / third.step_time_ms - 1, 4)}))


def test_prediction_on_the_corrected_profile_matches_the_runs(loop):
    """The corrected profile reproduces run 1 per stage exactly and its step within 10%.

    Run 2's prediction is looser (25%): proportional attribution charges the head's
    excess to the decoder layers sharing its stage, and run 2 moves two of them.
    """
    summary = loop["ranks"][0]["summary"]
    first, second = _measured(loop["run1"]), _measured(loop["run2"])
    assert summary["old_stage_time_ms"] == pytest.approx(list(first.stage_compute_ms), rel=1e-6)
    assert summary["old_step_time_ms"] == pytest.approx(first.step_time_ms, rel=0.10)
    assert summary["new_step_time_ms"] == pytest.approx(second.step_time_ms, rel=0.25)
