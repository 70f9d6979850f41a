"""The search's JSON output equals the one recorded before the bound step was regrouped.

tests/golden/plan_*.json were written by the per-candidate search (one Candidate record and one
closed-form bound per enumerated point); the grouped bounds and lazily built candidates must
reproduce every plan, baseline, reference and search count byte for byte. The only change
since is on purpose: each plan now also carries the emitters' Megatron schedule warnings, after
its own.
"""

from __future__ import annotations

import json
import os

import pytest
from _plan_golden import SCENARIOS, dump, scenario_summary

from megapipe.emit.emitted import megatron_schedule_warnings

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def _with_schedule_warnings(plan: dict | None) -> dict | None:
    if plan is None:
        return None
    par = plan["parallel"]
    extra = megatron_schedule_warnings(
        schedule=plan["schedule"], pipeline_model_parallel_size=par["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=par["virtual_pipeline_model_parallel_size"])
    return {**plan, "warnings": plan["warnings"] + list(extra)}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_search_output_equals_golden(name):
    with open(os.path.join(GOLDEN, f"plan_{name}.json"), encoding="utf-8") as handle:
        expected = json.load(handle)
    expected["plans"] = [_with_schedule_warnings(plan) for plan in expected["plans"]]
    expected["baseline"] = _with_schedule_warnings(expected["baseline"])
    expected["reference"] = _with_schedule_warnings(expected["reference"])
    assert dump(scenario_summary(name)) == dump(expected)


def test_golden_scenarios_rank_schedules_megatron_cannot_run():
    """The comparison covers the new warnings: some recorded plan uses a schedule megatron-core lacks."""
    schedules = set()
    for name in SCENARIOS:
        with open(os.path.join(GOLDEN, f"plan_{name}.json"), encoding="utf-8") as handle:
            schedules.update(plan["schedule"] for plan in json.load(handle)["plans"])
    assert schedules - {"1f1b", "interleaved_1f1b"}
