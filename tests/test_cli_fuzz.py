"""Random bad input across every verb ends in exit 0, or one line and exit 2: never a traceback or a hang.

A sample of ``scripts/fuzz_cli.py``'s cases (which runs 1,000+); the named cases are the ones users reported.
"""

from __future__ import annotations

import pytest
from _cli_fuzz import Case, random_cases, run_case

_TINY = ("model=tiny_gpt", "cluster=cpu_gloo", "train.global_batch_size=8")
REPORTED = [
    ("plan", ("train.global_batch_size=0",)),
    ("plan", ("train.micro_batch_size=0",)),
    ("plan", ("cluster.gpu.memory_gib=-1",)),
    ("plan", ("cluster.gpu.memory_gib=inf",)),
    ("plan", ("model.num_layers=999999999",)),
    ("simulate", ("model.num_layers=999999999",)),
    ("plan", ("+train.seq_lenght=32768",)),
    ("plan", ("+search.foo=1",)),
    ("plan", ("train.seq_length=0",)),
    ("plan", ("cluster.gpu.usable_memory_fraction=1.5",)),
    ("plan", ("search.top_k=0",)),
    ("plan", ("search.bubble_target=[0.99,1.0]",)),
    ("plan", ("+parallel.tensor_parallel=2",)),
]


@pytest.mark.parametrize("verb, overrides", REPORTED)
def test_reported_bad_inputs_are_one_line_exit_2(tmp_path, verb, overrides):
    outcome = run_case(Case(verb=verb, overrides=(*_TINY, *overrides)), directory=str(tmp_path), limit_s=60)
    assert outcome.problem == "" and outcome.code == 2, outcome


@pytest.mark.parametrize("seed", range(4))
def test_random_bad_inputs_end_cleanly(tmp_path, seed):
    for index, case in enumerate(random_cases(15, seed=seed)):
        outcome = run_case(case, directory=str(tmp_path / str(index)), limit_s=60)
        assert outcome.problem == "", (outcome.problem, case.argv())
