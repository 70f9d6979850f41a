"""The simulator against real torch.distributed.pipelining runs (4 gloo ranks on CPU).

Every stage is a module whose forward, input-gradient and weight-gradient costs
are fixed, uneven sleeps. Each rank records the interval of every F/B/I/W it
runs. Per measured step, the mean op times, the runtime's dispatch overhead
between ops and the message latency read from that step's timeline go into
megapipe's simulator with megapipe's own schedule (first shown to equal what the
ranks executed); the median predicted step time and bubble must land within 5%
of the measured ones.
"""

from __future__ import annotations

import pytest

from _pipelining_validation import (
    VALIDATION_SCHEDULES,
    compare,
    mean_action_ms,
    megapipe_schedule_for,
    validation_case,
)
from _torch_pipelining import run_pipeline, torch_order

pytestmark = pytest.mark.engine

PP = 4
MICROBATCHES = 8
SLEEP_SCALE = 2.0
STEP_TOLERANCE = 0.05
"""|predicted / measured - 1| of the median step time."""
BUBBLE_TOLERANCE = 0.05
"""|predicted - measured| bubble fraction (share of the ranks' wall time)."""
CONTENDED_P2P_MS = 1.0
"""A gloo ping-pong slower than this (0.1-0.15 ms on an idle 2-core machine) means other
processes compete for the cores, and op times stop being stationary."""


@pytest.fixture(scope="module")
def results():
    cases = [
        validation_case(label, pipeline_model_parallel_size=PP, num_microbatches=MICROBATCHES, scale=SLEEP_SCALE)
        for label in VALIDATION_SCHEDULES
    ]
    return {run.case.label: run for run in run_pipeline(cases, steps=3, warmup_steps=1)}


@pytest.mark.parametrize("label", list(VALIDATION_SCHEDULES))
def test_ranks_execute_megapipe_order(results, label):
    result = results[label]
    executed = result.executed_order(0)
    expected = megapipe_schedule_for(result.case).orders
    assert [[str(a) for a in executed[rank]] for rank in range(PP)] == [[str(a) for a in order] for order in expected]
    for step in range(1, len(result.actions)):
        assert result.executed_order(step) == executed


def test_1f1b_runtime_differs_from_its_ir_on_last_rank_only(results):
    executed = results["1F1B"].executed_order(0)
    ir = torch_order("1F1B", pipeline_model_parallel_size=PP, num_microbatches=MICROBATCHES)
    assert [executed[r] for r in range(PP - 1)] == [ir[r] for r in range(PP - 1)]
    assert executed[PP - 1] != ir[PP - 1]


@pytest.mark.parametrize("label", ["1F1B", "ZBVZeroBubble"])
def test_stage_costs_land_in_their_pass(results, label):
    """The sleeps are the op costs: F, full B = I + W; torch's split puts W's sleep in W,
    except on stage 0 whose input needs no gradient, where torch runs the whole backward as W."""
    case, means = results[label].case, mean_action_ms(results[label])
    # A sleep overruns by scheduler latency, which grows with the sleep under load; a cost in the
    # wrong pass moves at least 2 * min(input_grad_ms) = 6 ms, beyond this slack for every op here.
    contended = results[label].p2p_ms >= CONTENDED_P2P_MS
    for stage in range(case.num_stages):
        expected = {"F": case.fwd_ms[stage]}
        if label == "1F1B":
            expected["B"] = case.input_grad_ms[stage] + case.wgrad_ms[stage]
        elif stage == 0:
            expected.update(I=0.0, W=case.input_grad_ms[0] + case.wgrad_ms[0])
        else:
            expected.update(I=case.input_grad_ms[stage], W=case.wgrad_ms[stage])
        for kind, nominal_ms in expected.items():
            slack_ms = 10.0 if contended else 2.0 + 0.15 * nominal_ms
            assert nominal_ms <= means[stage, kind] <= nominal_ms + slack_ms, (stage, kind, means[stage, kind])


@pytest.mark.parametrize("label", list(VALIDATION_SCHEDULES))
def test_simulator_predicts_step_time_and_bubble(results, label):
    result = results[label]
    comparison = compare(result, megapipe_schedule_for(result.case))
    within = abs(comparison.step_error) <= STEP_TOLERANCE and abs(comparison.bubble_error) <= BUBBLE_TOLERANCE
    if not within and result.p2p_ms > CONTENDED_P2P_MS:
        pytest.skip(f"cores contended (gloo ping-pong {result.p2p_ms:.2f} ms); {comparison}")
    assert abs(comparison.step_error) <= STEP_TOLERANCE, comparison
    assert abs(comparison.bubble_error) <= BUBBLE_TOLERANCE, comparison
