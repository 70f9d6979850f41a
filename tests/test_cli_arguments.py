"""Arguments a command does not take are refused with exit 2, one line, and the key the user likely means."""

from __future__ import annotations

import pytest

from megapipe.cli import main


@pytest.mark.parametrize(("argv", "expected"), [
    (["plan", "--tensor-model-parallel-size", "2", "--num-layers", "40"],
     "parallel.tensor_model_parallel_size=2 model.num_layers=40"),
    (["plan", "--micro-batch-size=2"], "train.micro_batch_size=2"),
    (["plan", "--use-distributed-optimizer"], "parallel.use_distributed_optimizer=true"),
    (["plan", "--num-experts", "8"], "model.num_moe_experts=8"),
    (["plan", "--bf16", "--fp8-format", "hybrid"], "train.precision=bf16 train.precision=fp8"),
    (["plan", "--foo"], "plan takes no flag --foo"),
    (["plan", "2:40"], "plan takes no positional argument '2:40'"),
    (["simulate", "llama3_70b"], "simulate takes no positional argument 'llama3_70b'"),
    (["pack", "--jobs", "x"], "pack takes no flag --jobs"),
    (["plan", "train.seq_lenght=8192"], "did you mean train.seq_length?"),
    (["plan", "+train.seq_lenght=8192"], "did you mean train.seq_length?"),
    (["plan", "tensor_model_parallel_size=2"], "did you mean parallel.tensor_model_parallel_size=2?"),
    (["plan", "model.tensor_model_parallel_size=2"], "did you mean parallel.tensor_model_parallel_size?"),
    (["plan", "cluster.gpu.memory_gb=80"], "did you mean cluster.gpu.memory_gib?"),
    (["partition", "frobnicate=1"], "frobnicate is not a megapipe setting"),
    (["report", "a", "b"], "report takes one DIR, not 2 ('a', 'b')"),
    (["plan", "parallel.data_parallel_size=4"], "parallel.data_parallel_size=4: DP is not set but derived"),
    (["plan", "data_parallel_size=4"], "data_parallel_size=4: DP is not set but derived"),
    (["plan", "cluster.num_gpus=64"], "cluster.num_nodes x cluster.gpus_per_node"),
])
def test_what_a_command_does_not_take_is_refused(argv, expected, capsys, tmp_path):
    assert main([*argv, f"output.dir={tmp_path}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert captured.out == ""


def test_commands_that_take_paths_still_take_them(capsys, tmp_path):
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "positional" not in err and "missing" in err  # the path reached the command, which names it


def test_keys_of_open_groups_and_list_items_pass(tmp_path):
    assert main(["plan", "model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8", "output.pictures=false",
                 "cluster.node_groups=[]", f"output.dir={tmp_path}"]) == 0
