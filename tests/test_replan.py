"""megapipe.plan.replan (attribution, re-solve, gain decision) and ``megapipe replan RUN_DIR``."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megapipe.profile.format import load_profile, save_profile
from megapipe.errors import ConfigError, MegapipeError, ProfileError
from megapipe.layout import format_layout
from megapipe.monitor.jsonl import JsonlWriter
from megapipe.partition import given_split, solve
from megapipe.records import LayerCost, LayerKind, Profile, StageSpec
from megapipe.monitor.measured import measured_run
from megapipe.plan.replan import MeasuredRun, attribute_memory, attribute_times, replan, stage_entries

STAGES2 = (StageSpec(memory_bytes=2**34),) * 2


def _profile(decoder: tuple[float, float], head: tuple[float, float], *, num_layers: int = 8,
             embedding: tuple[float, float] = (0.1, 0.2)) -> Profile:
    def unit(name, kind, fb):
        return LayerCost(name=name, kind=kind, fwd_ms=fb[0], bwd_ms=fb[1], wgrad_ms=fb[1] / 2, static_bytes=1e6,
                         act_bytes=1e5)

    layers = [unit("embedding", LayerKind.embedding, embedding)]
    layers += [unit(f"decoder.{i}", LayerKind.decoder, decoder) for i in range(num_layers)]
    layers.append(unit("loss", LayerKind.loss, head))
    return Profile(layers=tuple(layers), device="cpu")


def _measure(truth: Profile, layout: str, *, pp: int = 2, noise: float = 0.0) -> MeasuredRun:
    """What a run of ``layout`` measures when the true unit costs are ``truth`` (times ``1 + noise`` on stage 0)."""
    counts = stage_entries(truth, layout)
    forward, backward, start = [], [], 0
    for stage, count in enumerate(counts):
        chunk = truth.layers[start:start + count]
        start += count
        factor = 1.0 + (noise if stage == 0 else 0.0)
        forward.append(factor * sum(layer.fwd_ms for layer in chunk))
        backward.append(factor * sum(layer.bwd_ms for layer in chunk))
    return MeasuredRun(layout=layout, pipeline_model_parallel_size=pp, stage_forward_ms=tuple(forward),
                       stage_backward_ms=tuple(backward))


# ----------------------------------------------------------------------------- attribution

@st.composite
def _attribution_case(draw):
    num = draw(st.integers(3, 12))
    times = st.one_of(st.just(0.0), st.floats(1e-3, 50.0))
    layers = tuple(
        LayerCost(name=f"d{i}", kind=LayerKind.decoder, fwd_ms=draw(times), bwd_ms=(b := draw(times)),
                  wgrad_ms=b * draw(st.floats(0.0, 1.0)), static_bytes=1.0, act_bytes=1.0)
        for i in range(num)
    )
    cuts = sorted(draw(st.sets(st.integers(1, num - 1), min_size=1, max_size=min(5, num - 1))))
    counts = [b - a for a, b in zip((0, *cuts), (*cuts, num))]
    measured = [draw(st.floats(0.01, 500.0)) for _ in counts]
    backward = [draw(st.floats(0.01, 500.0)) for _ in counts]
    scales = [draw(st.floats(0.5, 3.0)) for _ in counts]
    return Profile(layers=layers), counts, measured, backward, scales


@settings(max_examples=150, deadline=None)
@given(_attribution_case())
def test_attribution_is_exact_and_keeps_proportions(case):
    profile, counts, forward, backward, scales = case
    for attribution in ("stage", "kind"):  # one kind here: both keep every proportion within a stage
        _check_attribution(profile, counts, forward, backward, scales, attribution)


def _check_attribution(profile, counts, forward, backward, scales, attribution):
    corrected = attribute_times(profile, entries_per_stage=counts, stage_forward_ms=forward,
                                stage_backward_ms=backward, stage_time_scale=scales, attribution=attribution)
    start = 0
    for stage, count in enumerate(counts):
        old, new = profile.layers[start:start + count], corrected.layers[start:start + count]
        start += count
        assert math.fsum(e.fwd_ms for e in new) * scales[stage] == pytest.approx(forward[stage], rel=1e-9)
        assert math.fsum(e.bwd_ms for e in new) * scales[stage] == pytest.approx(backward[stage], rel=1e-9)
        for attr in ("fwd_ms", "bwd_ms"):
            total = math.fsum(getattr(e, attr) for e in old)
            for a, b in zip(old, new):  # the profile's shares within the stage (even when it had none)
                share = getattr(a, attr) / total if total > 0 else 1 / count
                assert getattr(b, attr) / math.fsum(getattr(e, attr) for e in new) == pytest.approx(share, abs=1e-9)
        for a, b in zip(old, new):
            assert b.wgrad_ms <= b.bwd_ms
            if a.bwd_ms > 0:
                assert b.wgrad_ms / b.bwd_ms == pytest.approx(a.wgrad_ms / a.bwd_ms, abs=1e-9)
            assert (b.static_bytes, b.act_bytes, b.kind, b.name) == (a.static_bytes, a.act_bytes, a.kind, a.name)


def test_memory_attribution_reproduces_measured_rank_peaks():
    profile = _profile((2.0, 4.0), (2.0, 4.0))
    old = given_split(profile, STAGES2, entries_per_stage=[5, 5], num_microbatches=8, schedule="1f1b")
    peaks = (old.rank_memory_bytes[0] * 1.7, old.rank_memory_bytes[1] * 0.6)
    corrected = attribute_memory(profile, old=old, rank_peak_bytes=peaks)
    again = given_split(corrected, STAGES2, entries_per_stage=[5, 5], num_microbatches=8, schedule="1f1b")
    assert again.rank_memory_bytes == pytest.approx(peaks, rel=1e-12)
    assert corrected.layers[1].act_bytes / corrected.layers[1].static_bytes == pytest.approx(0.1)


# ------------------------------------------------------------------------------- re-solve

def test_replan_moves_layers_off_the_measured_bottleneck():
    wrong = _profile((2.0, 4.0), (2.0, 4.0))  # claims the vocab head costs a decoder layer
    truth = _profile((2.0, 4.0), (12.0, 24.0))
    planned = solve(wrong, STAGES2, num_microbatches=8).layout
    assert planned == "Et*4|t*4L"
    result = replan(wrong, _measure(truth, planned), stages=STAGES2, schedule="1f1b", num_microbatches=8)
    # stage 1 measured 60 ms for 5 units the profile rated 6 ms each: each is charged 12 ms
    assert [e.fwd_ms + e.bwd_ms for e in result.corrected.layers[5:]] == pytest.approx([12.0] * 5)
    assert [e.fwd_ms + e.bwd_ms for e in result.corrected.layers[1:5]] == pytest.approx([6.0] * 4)
    assert result.new.layout == "Et*5|t*3L" and result.new.bottleneck_ms == pytest.approx(48.0)
    # 1F1B without p2p cost: (m - 1) * bottleneck + sum of stages (Narayanan et al. 2021)
    assert result.old_step_ms == pytest.approx(7 * 60.0 + 84.3)
    assert result.new_step_ms == pytest.approx(7 * 48.0 + 84.3)
    assert result.gain == pytest.approx(result.old_step_ms / result.new_step_ms - 1) and result.gain > 0.15
    assert result.suggest and "min_gain" in result.reason
    true_new = given_split(truth, STAGES2, entries_per_stage=result.new.entries_per_stage, num_microbatches=8)
    assert true_new.bottleneck_ms < 60.0  # the true costs of the new layout are better too


def test_kind_attribution_finds_the_expensive_head():
    wrong = _profile((2.0, 4.0), (2.0, 4.0))
    truth = _profile((2.0, 4.0), (12.0, 24.0))
    run = _measure(truth, "Et*4|t*4L")
    result = replan(wrong, run, stages=STAGES2, schedule="1f1b", num_microbatches=8, attribution="kind")
    assert result.new.layout == solve(truth, STAGES2, num_microbatches=8).layout == "Et*7|tL"
    head, decoder = result.corrected.layers[-1], result.corrected.layers[5]
    assert head.fwd_ms + head.bwd_ms == pytest.approx(36.0, rel=0.02)
    assert decoder.fwd_ms + decoder.bwd_ms == pytest.approx(6.0, rel=0.02)
    assert dict(result.corrected.meta)["attribution"] == "kind"
    start = 0
    for stage, count in enumerate(result.old.entries_per_stage):  # still exact per stage
        chunk = result.corrected.layers[start:start + count]
        start += count
        assert sum(e.fwd_ms for e in chunk) == pytest.approx(run.stage_forward_ms[stage])
    with pytest.raises(ConfigError, match="attribution='layer'"):
        replan(wrong, run, stages=STAGES2, schedule="1f1b", num_microbatches=8, attribution="layer")


def test_no_change_when_layout_is_already_optimal():
    truth = _profile((2.0, 4.0), (12.0, 24.0))
    layout = solve(truth, STAGES2, num_microbatches=8).layout
    result = replan(truth, _measure(truth, layout), stages=STAGES2, schedule="1f1b", num_microbatches=8)
    assert result.new.layout == layout and not result.suggest and result.gain == pytest.approx(0.0)


def test_gain_below_min_gain_is_refused():
    truth = _profile((2.0, 4.0), (2.0, 4.0), num_layers=48, embedding=(0.0, 0.0))
    layout = format_layout([[LayerKind.embedding] + [LayerKind.decoder] * 24,
                            [LayerKind.decoder] * 24 + [LayerKind.loss]])
    run = _measure(truth, layout, noise=0.1)  # stage 0 measured 10% slow: moving one layer gains about 1.2%
    loose = replan(truth, run, stages=STAGES2, schedule="1f1b", num_microbatches=8, min_gain=0.001)
    assert loose.new.layout != layout and 0.001 <= loose.gain < 0.02 and loose.suggest
    strict = replan(truth, run, stages=STAGES2, schedule="1f1b", num_microbatches=8)
    assert strict.gain == pytest.approx(loose.gain) and not strict.suggest
    assert "below search.min_gain=2.0%" in strict.reason


def test_errors_name_the_value():
    profile = _profile((2.0, 4.0), (2.0, 4.0))
    with pytest.raises(ProfileError, match="Et\\*3\\|t\\*3L"):
        stage_entries(profile, "Et*3|t*3L")  # 6 decoder layers against a profile of 8
    run = _measure(profile, "Et*4|t*4L")
    with pytest.raises(ConfigError, match="min_gain=-0.1"):
        replan(profile, run, stages=STAGES2, schedule="1f1b", num_microbatches=8, min_gain=-0.1)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=2"):
        replan(profile, run, stages=STAGES2 * 2, schedule="1f1b", num_microbatches=8)
    with pytest.raises(ConfigError, match="3 measured stages"):
        attribute_times(profile, entries_per_stage=[5, 5], stage_forward_ms=[1, 1, 1], stage_backward_ms=[1, 1, 1])
    with pytest.raises(ConfigError, match="no pipeline records"):
        measured_run([{"kind": "rank", "step": 1}])


# -------------------------------------------------------------------------- monitor records

def _write_run(directory, *, layout: str | None, forward, backward, steps: int = 3, capacity=None, peaks=(1e9, 1e9)):
    """Monitor logs as a 2-rank run writes them (start, rank and rank-0 pipeline records)."""
    for rank in (0, 1):
        writer = JsonlWriter(str(directory), rank=rank)
        writer.write("start", 0, {"pipeline_rank": rank, "pipeline_model_parallel_size": 2, "layout": layout})
        for step in range(1, steps + 1):
            writer.write("rank", step, {"pipeline_rank": rank, "num_microbatches": 8.0, "capacity_bytes": capacity,
                                        "step_time_ms": 100.0 + step})
            if rank == 0:
                warm = 3.0 if step == 1 else 1.0  # the first logged step is warm-up, dropped
                writer.write("pipeline", step, {
                    "layout": layout, "step_time_ms": 100.0 + step, "stage_peak_bytes": list(peaks),
                    "stage_forward_ms": [warm * f for f in forward], "stage_backward_ms": [warm * b for b in backward]})
        writer.close()


def test_measured_run_from_monitor_logs(tmp_path):
    from megapipe.monitor.jsonl import read_monitor

    _write_run(tmp_path, layout="Et*4|t*4L", forward=[8.0, 20.0], backward=[16.0, 40.0])
    run = measured_run(read_monitor(str(tmp_path)))
    assert run.layout == "Et*4|t*4L" and run.pipeline_model_parallel_size == 2 and run.num_steps == 2
    assert run.stage_forward_ms == (8.0, 20.0) and run.stage_backward_ms == (16.0, 40.0)
    assert run.step_time_ms == pytest.approx(102.5) and run.num_microbatches == 8
    assert run.rank_peak_bytes == () and run.compute_spread_ms == pytest.approx(36.0)  # CPU: RSS not used
    gpu = tmp_path / "gpu"
    _write_run(gpu, layout=None, forward=[8.0, 20.0], backward=[16.0, 40.0], capacity=8e10, peaks=(3e9, 2e9))
    run = measured_run(read_monitor(str(gpu)), layout="Et*4|t*4L")
    assert run.rank_peak_bytes == (3e9, 2e9) and run.layout == "Et*4|t*4L"
    with pytest.raises(ConfigError, match="records no layout"):
        measured_run(read_monitor(str(gpu)))


# ------------------------------------------------------------------------------- command

CFG = ["model=tiny_gpt", "cluster=cpu_gloo", "model.num_layers=8", "parallel.tensor_model_parallel_size=1",
       "schedule=1f1b"]


def _run_dir(tmp_path, *, layout="Et*4|t*4L", profile=None):
    run_dir = tmp_path / "run"
    _write_run(run_dir, layout=layout, forward=[8.2, 20.2], backward=[16.4, 40.4])
    save_profile(profile or _profile((2.0, 4.0), (2.0, 4.0)), run_dir / "profile.yaml")
    return run_dir


def _replan_json(run_dir, out, capsys, *extra) -> dict:
    from megapipe.commands import replan as command
    from megapipe.config import compose

    cfg = compose([*CFG, f"input={run_dir}", f"output.dir={out}", "output.format=json", *extra])
    command.run(command.prepare(cfg), directory=str(out))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_command_writes_corrected_profile_and_suggests(tmp_path, capsys):
    run_dir, out = _run_dir(tmp_path), tmp_path / "out"
    result = _replan_json(run_dir, out, capsys)
    assert result["old_layout"] == "Et*4|t*4L" and result["new_layout"] == "Et*5|t*3L" and result["suggest"]
    assert result["num_microbatches"] == 8 and result["predicted_gain"] > 0.15
    assert any("Et*5|t*3L" in override for override in result["bridge_overrides"])
    assert "--pipeline-model-parallel-layout" in result["megatron_args"]
    assert "--global-batch-size 8" in result["megatron_args"]  # 8 microbatches from the log, DP 1
    corrected = load_profile(out / "profile.yaml")
    assert sum(e.fwd_ms for e in corrected.layers[:5]) == pytest.approx(8.2)
    assert sum(e.bwd_ms for e in corrected.layers[5:]) == pytest.approx(40.4)
    assert yaml.safe_load((out / "replan.yaml").read_text())["new_layout"] == "Et*5|t*3L"
    refused = _replan_json(run_dir, tmp_path / "out2", capsys, "search.min_gain=0.9")
    assert not refused["suggest"] and "megatron_args" not in refused and "below search.min_gain" in refused["reason"]


def test_command_uses_plan_yaml_and_rejects_another_layout(tmp_path, capsys):
    run_dir = _run_dir(tmp_path, layout="Et*3|t*5L")
    from megapipe.config import compose

    inputs = {k: v for k, v in yaml.safe_load(json.dumps(_container(compose(CFG)))).items() if k != "output"}
    best = {"layout": "Et*4|t*4L", "schedule": "1f1b", "parallel": {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 1,
        "context_parallel_size": 1, "data_parallel_size": 1, "sequence_parallel": False},
        "train": {"micro_batch_size": 1, "global_batch_size": 8, "seq_length": 32, "recompute_granularity": "none",
                  "num_microbatches": 8}}
    (run_dir / "plan.yaml").write_text(yaml.safe_dump({"format": "megapipe-plan/1", "best": best, "inputs": inputs}))
    with pytest.raises(ConfigError, match="layout 'Et\\*3\\|t\\*5L' but plan.yaml planned 'Et\\*4\\|t\\*4L'"):
        _replan_json(run_dir, tmp_path / "out", capsys)


def _container(cfg):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def test_command_errors_are_one_line_exit_2(tmp_path, capsys):
    from megapipe.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["replan", str(empty), *CFG, f"output.dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no rank-*.jsonl" in err[0]
    other = _run_dir(tmp_path, profile=_profile((2.0, 4.0), (2.0, 4.0), num_layers=6))
    assert main(["replan", str(other), *CFG, f"output.dir={tmp_path / 'o'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "profile has 6 decoder layers" in err[0] and "num_layers=8" in err[0]
    assert main(["replan", str(other), *CFG, "search.replan_attribution=layer"]) == 2
    assert "search.replan_attribution='layer'" in capsys.readouterr().err
    assert main(["replan", *CFG]) == 2
    assert "megapipe replan RUN_DIR" in capsys.readouterr().err
    with pytest.raises(MegapipeError):
        measured_run([])
