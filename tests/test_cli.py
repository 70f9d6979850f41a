"""The CLI end to end, as a user runs it: subprocesses, exit codes, one-line errors, JSON output."""

import json
import os
import subprocess
import sys

import pytest

from megapipe.io import save_profile
from megapipe.config import compose, to_setup
from megapipe.emit import emit
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
        (["partition", "parallel.tensor_model_parallel_size=3"], "not divisible"),
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
    setup = to_setup(compose(overrides))
    from megapipe.commands.common import setup_profile, setup_stage_specs

    part = solve(setup_profile(setup), list(setup_stage_specs(setup, pipeline_model_parallel_size=8)),
                 num_microbatches=setup.num_microbatches, schedule="1f1b")
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
    from megapipe.commands.common import setup_profile

    tiny = to_setup(compose(["model=tiny_gpt", "cluster=cpu_gloo", "parallel.tensor_model_parallel_size=1",
                             "parallel.pipeline_model_parallel_size=2"]))
    path = tmp_path / "tiny.yaml"
    save_profile(setup_profile(tiny), path)
    out = megapipe(command, "model=llama3_8b", f"profile={path}", cwd=tmp_path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "decoder layers" in out.stderr and "num_layers=32" in out.stderr


def test_mixed_cluster_time_scales_agree_with_the_planner():
    """partition/simulate and the planner price a slower GPU type the same way: modelled layer-time ratios."""
    from megapipe.commands.common import setup_stage_specs
    from megapipe.plan.evaluator import Evaluator
    from megapipe.plan.plans import Candidate

    setup = to_setup(compose(["cluster=mixed_h100_a100"]))
    specs = setup_stage_specs(setup)
    evaluator = Evaluator(model=setup.model, cluster=setup.cluster)
    cand = Candidate(parallel=setup.parallel, train=setup.train, schedule="1f1b")
    planner = evaluator.costs.stage_specs(cand, tuple(g.gpu for g in setup.cluster.node_groups
                                                for _ in range(4)))  # 8 stages: 4 per node group
    assert [s.gpu_name for s in specs] == [s.gpu_name for s in planner]
    assert [s.time_scale for s in specs] == pytest.approx([s.time_scale for s in planner], rel=1e-9)
    assert specs[0].time_scale == pytest.approx(1.0) and specs[-1].time_scale > 1.5
