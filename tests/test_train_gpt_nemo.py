"""scripts/train_gpt.py under NeMo's hydra_runner, fed by a real `megapipe plan` (opt-in: -m nemo).

Needs nemo_toolkit[core]==3.0.0 and megatron-core in a separate venv
whose interpreter is given by the ``NEMO_PYTHON`` environment variable.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megapipe.monitor.jsonl import read_monitor, stage_times

pytestmark = pytest.mark.nemo

ROOT = os.path.join(os.path.dirname(__file__), "..")
NEMO_PYTHON = os.environ.get("NEMO_PYTHON", "")


def test_train_gpt_with_plan_and_nemo1_overrides(tmp_path):
    if not NEMO_PYTHON or not os.path.exists(NEMO_PYTHON):
        pytest.skip(f"no NeMo python at NEMO_PYTHON={NEMO_PYTHON!r}; point it at a venv with nemo_toolkit[core]")
    plan_dir = tmp_path / "plan"
    subprocess.run([sys.executable, "-m", "megapipe.cli", "plan", "model=tiny_gpt", "cluster=cpu_gloo",
                    "parallel.pipeline_model_parallel_size=2", "parallel.tensor_model_parallel_size=1",
                    f"hydra.run.dir={plan_dir}"], check=True, cwd=ROOT, capture_output=True)
    run_dir = tmp_path / "run"
    out = subprocess.run([NEMO_PYTHON, "scripts/train_gpt.py", f"megapipe.plan={plan_dir}/plan.yaml",
                          f"megapipe.overrides={plan_dir}/nemo1_overrides.txt", f"exp_dir={run_dir}",
                          "trainer.max_steps=3"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "megapipe: applied" in out.stdout and "rank 1: losses" in out.stdout
    records = read_monitor(str(run_dir / "monitor"))
    start = [r for r in records if r["kind"] == "start"]
    assert len(start) == 2 and start[0]["layout"] and start[0]["links"][0]["bandwidth_gbytes_per_s"] > 0
    assert sum(r["kind"] == "pipeline" for r in records) == 3
    assert all(f > 0 and b > 0 for f, b, _ in stage_times(records))
