"""What a new user's trial found accepted in silence now either holds or is refused in one line, exit 2."""

from __future__ import annotations

import json

from megapipe.cli import main

EXACT = ["parallel.tensor_model_parallel_size=4", "parallel.pipeline_model_parallel_size=8",
         "parallel.virtual_pipeline_model_parallel_size=1", "parallel.context_parallel_size=1",
         "parallel.sequence_parallel=true", "train.micro_batch_size=1", "train.recompute_granularity=none",
         "schedule=1f1b", "output.pictures=false"]


def test_num_microbatches_that_cannot_hold_is_refused_naming_the_derived_count(tmp_path, capsys):
    """256 / (1 x DP 4) is 64 microbatches: 7 was ignored; now the error says why and the batch that gives 7."""
    assert main(["plan", *EXACT, "train.num_microbatches=7", f"output.dir={tmp_path / 'seven'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.num_microbatches=7 cannot hold" in err
    assert "= 64" in err and "train.global_batch_size=28" in err
    assert not (tmp_path / "seven").exists()
    assert main(["plan", *EXACT, "train.num_microbatches=64", "output.format=json", f"output.dir={tmp_path / 'ok'}"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["train"]["global_batch_size"] == 256


def test_few_microbatches_per_pipeline_are_warned_on_the_console_with_the_batch_that_helps(tmp_path, capsys):
    """Global batch 32 on 128 GPUs at TP4 PP8 leaves 8 microbatches per pipeline: said on the console, not only
    in plan.yaml, with the global batch that brings the bubble under the goal."""
    exact = [item for item in EXACT if not item.startswith("parallel.pipeline")]
    assert main(["plan", *exact, "parallel.pipeline_model_parallel_size=8", "train.global_batch_size=32",
                 f"output.dir={tmp_path}"]) == 0
    console = capsys.readouterr()
    line = next(line for line in (console.out + console.err).splitlines() if "microbatches per pipeline" in line)
    assert line.startswith("warning: only 8 microbatches per pipeline of 8 stages") and "train.global_batch_size=" in line
