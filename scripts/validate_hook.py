"""Predicted vs measured: the schedule hook on real megatron-core schedules (CPU, gloo, 2 ranks).

Runs the engine-test scenarios (tests/test_hook_engine.py) once and prints, per
scenario, the hook's measured bubble fraction next to the simulator's prediction
from the hook's own measured stage times, per-op dispatch overhead and the gloo
ping-pong latency (and, for comparison, without the dispatch overhead), and for
the skewed model (big vocab
head on the last stage) the step-time gain of the optimal layout over the equal
split: predicted by the simulator from nominal stage costs, and measured.

    python scripts/validate_hook.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import _megatron_cpu as mc  # noqa: E402
import test_hook_engine as scenarios  # noqa: E402

from megapipe.monitor.predict import predict_bubble  # noqa: E402
from megapipe.schedules import build  # noqa: E402
from megapipe.simulate import StageTimes, simulate  # noqa: E402


def _nominal_step_ms(fwd_ms, bwd_ms, num_microbatches):
    schedule = build("1f1b", pipeline_model_parallel_size=len(fwd_ms), num_microbatches=num_microbatches)
    return simulate(schedule, StageTimes(fwd_ms=fwd_ms, bwd_ms=bwd_ms, wgrad_ms=(0.0,) * len(fwd_ms))).step_time_ms


def main() -> None:
    ranks = mc.run_ranks(scenarios._scenarios, world_size=2, timeout_s=600)
    m = scenarios.NUM_MICROBATCHES
    print("| scenario | layout | measured bubble | simulated, compute + p2p | rel. diff "
          "| simulated, + dispatch per op | rel. diff | dispatch ms/op charged (rank medians) | p2p ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, layout in (("1f1b", "Et|tL"), ("interleaved", "Et|t|t|tL"), ("skew_equal", "Et*3|t*3L"),
                         ("skew_optimal", "Et*6|L")):
        reports = scenarios._steady(ranks[0][name]["reports"])
        measured = statistics.mean(r.measured_bubble_fraction for r in reports)
        simulated = statistics.mean(r.simulated_bubble_fraction for r in reports)
        plain = statistics.mean(
            predict_bubble(r.pipeline, p2p_latency_ms=r.p2p_latency_ms, charge_dispatch=False,
                           microbatch_group_size_per_vp_stage=2).bubble_fraction
            for r in reports
        )
        dispatch = ", ".join(f"{statistics.mean(r.pipeline.ranks[i].dispatch_ms for r in reports):.2f}" for i in range(2))
        dispatch = f"{statistics.mean(r.dispatch_ms for r in reports):.2f} ({dispatch})"
        print(f"| {name} | `{layout}` | {measured:.3f} | {plain:.3f} | {measured / plain - 1:+.1%} | {simulated:.3f} "
              f"| {measured / simulated - 1:+.1%} | {dispatch} | {reports[0].p2p_latency_ms:.2f} |")
    equal_ms = statistics.median(scenarios._steady_walls(ranks, "skew_equal")) * 1e3
    optimal_ms = statistics.median(scenarios._steady_walls(ranks, "skew_optimal")) * 1e3
    # nominal sleeps per microbatch: decoder layer 10/20 ms, vocab head 60/120 ms (F/B)
    predicted_equal = _nominal_step_ms((30.0, 90.0), (60.0, 180.0), m)
    predicted_optimal = _nominal_step_ms((60.0, 60.0), (120.0, 120.0), m)
    print()
    print("| skewed model, m=4 | equal `Et*3|t*3L` | optimal `Et*6|L` | gain |")
    print("|---|---|---|---|")
    print(f"| predicted step (simulator, nominal costs) | {predicted_equal:.0f} ms | {predicted_optimal:.0f} ms "
          f"| {predicted_equal / predicted_optimal:.3f}x |")
    print(f"| measured step (median, 2 ranks) | {equal_ms:.0f} ms | {optimal_ms:.0f} ms | {equal_ms / optimal_ms:.3f}x |")


if __name__ == "__main__":
    main()
