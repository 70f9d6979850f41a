"""The search's JSON output equals the one recorded before the bound step was regrouped.

tests/golden/plan_*.json were written by the per-candidate search (one Candidate record and one
closed-form bound per enumerated point); the grouped bounds and lazily built candidates must
reproduce every plan, baseline, reference and search count byte for byte.
"""

from __future__ import annotations

import os

import pytest

from _plan_golden import SCENARIOS, dump, scenario_summary

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_search_output_equals_golden(name):
    with open(os.path.join(GOLDEN, f"plan_{name}.json"), encoding="utf-8") as handle:
        expected = handle.read()
    assert dump(scenario_summary(name)) == expected
