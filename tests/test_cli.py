"""The CLI end to end, as a user runs it: subprocesses, exit codes, one-line errors, JSON output."""

import json
import os
import subprocess
import sys
import time

import pytest

from megapipe.profile.format import save_profile
from megapipe.config import compose, to_scenario
from megapipe.partition import solve


def megapipe(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megapipe.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["partition", "model=llama9"], "model/llama9"),
        (["partition", "model.num_layerz=3"], "num_layerz"),
        (["partition", "train.recompute_granularity=sometimes"], "expected one of"),
        (["partition", "parallel.pipeline_model_parallel_size=2"], "over by"),
        (["partition", "cluster.gpu.memory_gib=0"], "memory_gib=0"),
        (["partition", "parallel.tensor_model_parallel_size=3"], "does not divide the cluster's 128 GPUs"),
        (["plan", "parallel.tensor_model_parallel_size=3"],
         "parallel.tensor_model_parallel_size=3 does not divide the cluster's 128 GPUs"),
        (["frobnicate"], "unknown command"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, fragment):
    out = megapipe(*args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert fragment in lines[0]


def test_corrupt_profile_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("format: megapipe-profile/9\nlayers: []\n")
    out = megapipe("partition", f"profile={bad}", cwd=tmp_path)
    assert out.returncode == 2 and "megapipe-profile/9" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_partition_json_matches_the_library(tmp_path):
    overrides = ["model=llama3_70b", "cluster=h100_80gb", "parallel.pipeline_model_parallel_size=8"]
    out = megapipe("partition", *overrides, "output.format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    scenario = to_scenario(compose(overrides))
    from megapipe.commands.common import scenario_profile, stage_specs_of

    part = solve(scenario_profile(scenario, None), list(stage_specs_of(scenario, pipeline_model_parallel_size=8)),
                 num_microbatches=scenario.num_microbatches, schedule="1f1b")
    assert result["entries_per_stage"] == list(part.entries_per_stage)
    assert result["layout"] == part.layout
    assert result["bottleneck_ms"] == pytest.approx(part.bottleneck_ms)
    assert sum(result["decoder_layers_per_stage"]) == 80
    assert "--pipeline-model-parallel-layout" in result["megatron_args"]
    assert any(o.startswith("model.pipeline_model_parallel_layout='") for o in result["bridge_overrides"])
    assert result["equal"]["bottleneck_ms"] >= result["bottleneck_ms"]
    assert result["predicted_gain"] >= 0


def test_partition_table(tmp_path):
    out = megapipe("partition", "parallel.pipeline_model_parallel_size=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "layout:" in out.stdout and "headroom" in out.stdout and "equal split" in out.stdout


def test_help(tmp_path):
    out = megapipe("--help", cwd=tmp_path)
    assert out.returncode == 0 and "megapipe plan" in out.stdout


@pytest.mark.parametrize("command", ["plan", "partition"])
def test_profile_of_another_model_is_refused(tmp_path, command):
    from megapipe.commands.common import scenario_profile

    tiny = to_scenario(compose(["model=tiny_gpt", "cluster=cpu_gloo", "parallel.tensor_model_parallel_size=1",
                                "parallel.pipeline_model_parallel_size=2"]))
    path = tmp_path / "tiny.yaml"
    save_profile(scenario_profile(tiny, None), path)
    out = megapipe(command, "model=llama3_8b", f"profile={path}", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "decoder layers" in out.stderr and "num_layers=32" in out.stderr


def test_mixed_cluster_time_scales_agree_with_the_planner():
    """partition/simulate and the planner price a slower GPU type the same way: modelled layer-time ratios."""
    from megapipe.commands.common import stage_specs_of
    from megapipe.plan.evaluator import Evaluator
    from megapipe.plan.plans import Candidate

    scenario = to_scenario(compose(["cluster=mixed_h100_a100"]))
    specs = stage_specs_of(scenario)
    evaluator = Evaluator(model=scenario.model, cluster=scenario.cluster)
    cand = Candidate(parallel=scenario.parallel, train=scenario.train, schedule="1f1b")
    planner = evaluator.costs.stage_specs(cand, tuple(g.gpu for g in scenario.cluster.node_groups
                                                for _ in range(4)))  # 8 stages: 4 per node group
    assert [s.gpu_name for s in specs] == [s.gpu_name for s in planner]
    assert [s.time_scale for s in specs] == pytest.approx([s.time_scale for s in planner], rel=1e-9)
    assert specs[0].time_scale == pytest.approx(1.0) and specs[-1].time_scale > 1.5


@pytest.mark.parametrize("command", ["plan", "simulate", "partition", "replan", "report", "validate", "calibrate",
                                     "profile"])
def test_help_lists_the_config_keys_the_command_reads_with_the_schemas_meanings(command, capsys):
    import importlib

    from megapipe.cli import main
    from megapipe.config.keys import config_keys

    assert main([command, "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = config_keys(importlib.import_module(f"megapipe.commands.{command}").CONFIG_KEYS)
    for key, meaning in rows:
        line = next((line for line in lines if line.split()[:1] == [key]), None)
        assert line is not None and meaning and line.split(None, 1)[1] == meaning[:len(line.split(None, 1)[1])], key
    keys = {key for key, _ in rows}
    reads = {"plan": {"train.micro_batch_size", "parallel.tensor_model_parallel_size", "search.objective",
                      "output.dir", "profile", "model.num_layers", "cluster.gpu.memory_gib"},
             "simulate": {"stage_times", "schedule.name", "output.pictures"}, "partition": {"output.bridge_keys"},
             "replan": {"input", "search.min_gain"}, "report": {"input", "output.dir"},
             "validate": {"validate.ids", "runtime.step_overhead_ms"}, "calibrate": {"input", "cluster.gpu.name"},
             "profile": {"extra", "model.num_layers"}}[command]
    assert reads <= keys
    assert ("search.min_gain" in keys) == (command == "replan")  # another command's search key is not listed


def test_help_meanings_are_the_records_docstrings(capsys):
    """One declaration per setting: the help quotes the record's field docstring (its first sentence)."""
    from megapipe.cli import main
    from megapipe.config.keys import field_docs
    from megapipe.records import ParallelSpec, TrainSpec

    assert main(["plan", "--help"]) == 0
    text = capsys.readouterr().out
    assert field_docs(TrainSpec)["micro_batch_size"] in text
    assert field_docs(ParallelSpec)["virtual_pipeline_model_parallel_size"].split(";")[0] in text
    assert "model=NAME" in text and "llama3_70b (default)" in text and "usage: megapipe plan [key=value" in text


def test_command_help_is_the_commands_own(tmp_path):
    plan, partition = (megapipe(command, "--help", cwd=tmp_path) for command in ("plan", "partition"))
    assert plan.returncode == partition.returncode == 0
    assert "usage: megapipe plan" in plan.stdout and "usage: megapipe partition" in partition.stdout
    assert plan.stdout != partition.stdout


TINY = ["model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8"]


def test_output_dir_holds_the_run_record_beside_the_files(tmp_path, capsys):
    """The run's .hydra record goes beside what it wrote; a log file only once something is logged (a plan logs
    nothing); a command that writes nothing (partition) leaves no directory, not even output.dir."""
    from megapipe.cli import main

    assert main(["plan", *TINY, f"output.dir={tmp_path / 'p'}", "output.pictures=false"]) == 0
    assert (tmp_path / "p" / ".hydra" / "config.yaml").is_file() and (tmp_path / "p" / ".hydra" / "overrides.yaml").is_file()
    assert (tmp_path / "p" / "plan.yaml").is_file() and not (tmp_path / "p" / "plan.log").exists()
    assert main(["partition", *TINY, f"output.dir={tmp_path / 'q' / 'r'}", "output.format=json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["layout"]
    assert not (tmp_path / "q").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("argv", [
    ["plan", "model=llama3_70b", "cluster.num_nodes=1"],  # no feasible plan: found in run, after the directory
    ["plan", *TINY, "cluster.gpu.memory_gib=0.001"],
    ["report", "no-such-sweep"],  # a path that is not a directory, found in run
])
def test_a_failed_run_leaves_no_directory(tmp_path, capsys, argv):
    from megapipe.cli import main

    assert main([*argv, "output.pictures=false"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert main([*argv, f"output.dir={tmp_path / 'given' / 'dir'}"]) == 2
    assert sorted(os.listdir(tmp_path)) == []


def test_report_writes_into_the_sweep_and_leaves_no_run_directory(tmp_path, capsys):
    from megapipe.cli import main

    assert main(["plan", *TINY, f"output.dir={tmp_path / 'sweep' / '0'}", "output.pictures=false"]) == 0
    assert main(["report", str(tmp_path / "sweep"), "output.pictures=false"]) == 0
    assert "sweep.csv" in capsys.readouterr().out
    assert (tmp_path / "sweep" / "sweep.csv").is_file() and not (tmp_path / "outputs").exists()


def test_runs_started_together_get_their_own_directories(tmp_path):
    args = [sys.executable, "-m", "megapipe.cli", "plan", "model=tiny_gpt", "cluster=cpu_gloo",
            "train.global_batch_size=8", "output.pictures=false", "output.format=json"]
    runs = [subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(3)]
    dirs = set()
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr
        dirs.add(json.loads(stdout.strip().splitlines()[-1])["plan_dir"])
    assert len(dirs) == 3 and all(os.path.isfile(os.path.join(tmp_path, d, "plan.yaml")) for d in dirs)


def test_plan_files_respect_the_umask(tmp_path):
    out = subprocess.run(["bash", "-c", f"umask 022 && {sys.executable} -m megapipe.cli plan model=tiny_gpt "
                          f"cluster=cpu_gloo train.global_batch_size=8 output.dir={tmp_path / 'p'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "p").iterdir() if path.is_file()}
    assert modes["plan.yaml"] == modes["megatron_args.txt"] == modes["memory.png"] == 0o644
    assert modes["launch_megatron.sh"] == 0o755


def test_a_failed_sweep_job_fails_the_sweep_and_report_marks_it(tmp_path):
    out = megapipe("plan", "-m", "model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8",
                   "cluster.gpu.memory_gib=8,0.001", "output.pictures=false", cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "1 sweep job(s) failed" in out.stderr.strip().splitlines()[-1]
    (sweep,) = (tmp_path / "multirun" / "plan").iterdir()
    report = megapipe("report", str(sweep), "output.format=json", "output.pictures=false", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert len(summary["rows"]) == 1 and len(summary["failed"]) == 1
    assert "no feasible plan" in summary["failed"][0]["error"]


def test_simulate_says_what_it_timed_what_write_up_means_and_where_the_files_went(tmp_path, capsys):
    from megapipe.cli import main

    assert main(["simulate", "schedule=1f1b", "stage_times=[[1,1,1],[1,1,1],[1,1,1],[1,1,1]]",
                 "train.num_microbatches=8", f"output.dir={tmp_path / 's'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("megapipe simulate: the stage_times given, PP=4, 8 microbatches")
    assert any(line.startswith("write-up: the bubble the write-ups' table prints") for line in lines)
    assert lines[-1].startswith(f"files in {tmp_path / 's'}: 1f1b_gantt.png, 1f1b_trace.json")
    assert sorted(path.name for path in (tmp_path / "s").iterdir()) == [".hydra", "1f1b_gantt.png", "1f1b_trace.json"]
    assert main(["simulate", "schedule=1f1b", "parallel.pipeline_model_parallel_size=8", "train.num_microbatches=32",
                 "output.pictures=false"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("megapipe simulate: llama3_70b on 128 h100_80gb GPUs (16 nodes of 8) (cost model), TP=4 CP=1 DP=4 PP=8, "
                               "32 microbatches")
    assert not any(line.startswith("files in") for line in lines) and not (tmp_path / "outputs").exists()


def _drawn(path, mark):
    with open(path, "a") as handle:
        handle.write(mark)


def _broken(path):
    raise ValueError(f"cannot draw {path}")


def test_without_a_painter_pictures_are_drawn_at_finish_in_order_and_a_failure_is_one_line(tmp_path):
    from megapipe.commands import painter
    from megapipe.errors import MegapipeError

    target = tmp_path / "drawn.txt"
    painter.draw(_drawn, str(target), "a")
    painter.draw(_drawn, str(target), "b")
    assert not target.exists()  # nothing yet: the command prints its answer first
    painter.finish()
    assert target.read_text() == "ab"
    painter.draw(_broken, "x.png")
    with pytest.raises(MegapipeError, match="drawing a picture failed: ValueError: cannot draw x.png"):
        painter.finish()
    painter.draw(_drawn, str(target), "c")
    painter.stop()  # a failed run's pictures are dropped, never drawn by a later command
    painter.finish()
    assert target.read_text() == "ab"


_CLUSTER_MAP = """
import sys
from megapipe.report import canvas
from megapipe.report.cluster_map import cluster_map, node_owners
if sys.argv[2] == "warm":
    canvas.warm_up()
owners = node_owners([16, 8], [("a", 0, 6), ("b", 0, 10), ("c", 1, 5)], failed=[0, 2])
cluster_map([("packed", owners)], ["h100", "a100"], sys.argv[1])
"""


def test_the_painters_warm_up_changes_no_picture(tmp_path):
    """A fresh process that draws a throwaway picture first (the painter's warm-up) writes the same bytes as one that
    does not."""
    written = []
    for mode in ("cold", "warm"):
        path = tmp_path / f"{mode}.png"
        subprocess.run([sys.executable, "-c", _CLUSTER_MAP, str(path), mode], check=True)
        written.append(path.read_bytes())
    assert written[0] == written[1] and written[0].startswith(b"\x89PNG")


_MARK = {"set": False}


def _set_mark() -> None:
    _MARK["set"] = True


def _seen_mark(value: int) -> tuple[int, bool]:
    if value == 0:
        time.sleep(0.6)  # the first task outlasts the rest: the other process runs out of tasks meanwhile
    return value * value, _MARK["set"]


def test_process_map_runs_meanwhile_once_a_process_is_idle_and_later_maps_see_it():
    """``meanwhile`` runs once in the calling process, during the first map, as soon as one of its processes has no
    task left (here before the slow first task's result comes back); that map's processes were forked before it (they
    do not see what it did), each later map's after it (they do). The answers are the built-in map's, in order, and an
    empty map forks nothing and runs nothing."""
    from megapipe.commands.common import process_map, process_workers

    _MARK["set"] = False
    try:
        with process_map(4, one_at_a_time=True, meanwhile=_set_mark) as mapper:
            assert list(mapper(_seen_mark, [])) == []
            assert not _MARK["set"]
            results = mapper(_seen_mark, range(4))
            first = [next(results)]
            assert _MARK["set"]
            first += list(results)
            second = list(mapper(_seen_mark, range(4, 8)))
        pooled = process_workers(4) > 1
        assert first == [(value * value, not pooled) for value in range(4)]
        assert second == [(value * value, True) for value in range(4, 8)]
    finally:
        _MARK["set"] = False


def _collecting(value: int) -> tuple[int, bool]:
    import gc

    return value, gc.isenabled()


def test_process_map_runs_its_processes_without_the_collector_when_asked():
    """``collect=False``: the pool's processes run with the cycle collector off (pack's searches); by default they keep
    it, and the calling process's is left as it was either way."""
    import gc

    from megapipe.commands.common import process_map, process_workers

    pooled = process_workers(4) > 1
    for collect in (True, False):
        with process_map(4, one_at_a_time=True, collect=collect) as mapper:
            seen = list(mapper(_collecting, range(4)))
        assert seen == [(value, collect or not pooled) for value in range(4)]
        assert gc.isenabled()


def test_an_in_process_main_leaves_the_collector_unfrozen(tmp_path, capsys):
    """Only the console script's process, which ends after the command, freezes the collector's objects at the end;
    a caller of ``main(argv)`` (a test, a notebook) goes on with a collector that sees every object."""
    import gc

    from megapipe.cli import main

    before = gc.get_freeze_count()
    assert main(["partition", f"output.dir={tmp_path}"]) == 0
    assert gc.get_freeze_count() == before
