"""Predicted vs measured step time and bubble for real torch.distributed.pipelining runs.

Runs every schedule of the validation set on P gloo ranks (CPU) over stage modules
whose F, I and W costs are uneven sleeps, records every op's interval, feeds the
measured mean op times, the runtime's dispatch overhead per op and the gloo p2p
latency into megapipe's simulator with megapipe's schedule, and prints one row per
schedule. The yardstick is the measured step time of the same run; the ratio
column is predicted / measured.

    python scripts/validate_simulator.py [--pp 4] [--microbatches 8] [--steps 3] [--scale 2.0] [--megatron]

--megatron adds rows for megatron-core's real 1F1B and interleaved schedules (2 gloo
ranks, GPT units with sleeps, the tests' CPU shim), measured by megapipe.monitor's hook.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _pipelining_validation import (  # noqa: E402
    VALIDATION_SCHEDULES,
    compare,
    megapipe_schedule_for,
    runtime_gaps_ms,
    validation_case,
)
from _torch_pipelining import run_pipeline  # noqa: E402


MEGATRON_CASES = (
    # label, layout (vp-major stages), num_layers, virtual stages per rank
    ("megatron-core 1F1B", "Et*3|tL", 4, None),
    ("megatron-core interleaved", "Et|t*2|t|L", 4, 2),
)
MEGATRON_MICROBATCHES = 8


def _megatron_body(rank: int, world_size: int, num_steps: int) -> list:
    """Inside a spawned rank: per case, the hook's per-step PipelineMetrics and a ping-pong latency."""
    import _megatron_cpu as mc
    from megapipe.monitor import attach

    delays = mc.UnitDelays(embedding=(2.0, 4.0), decoder=(6.0, 12.0), loss=(4.0, 8.0))
    out = []
    with mc.megatron_cpu():
        for _, layout, num_layers, vp in MEGATRON_CASES:
            mc.init_model_parallel(pipeline_model_parallel_size=world_size, virtual_pipeline_model_parallel_size=vp)
            models = mc.build_gpt_chunks(layout=layout, num_layers=num_layers, delays_ms=delays)
            latency = mc.p2p_latency_ms()
            hook = attach(models, gather_every=1)
            mc.train_steps(models, num_steps=num_steps + 1, num_microbatches=MEGATRON_MICROBATCHES)
            out.append({"latency_ms": latency, "steps": [r.pipeline for r in list(hook.reports)[1:]]})
            hook.detach()
    return out


def _megatron_rows(*, steps: int) -> list[tuple]:
    """(label, measured step, predicted step, measured bubble, predicted bubble, dispatch ms/op, p2p ms).

    Measured step = the longest rank's ``forward-backward`` wall. Dispatch per op = each
    rank's wall not spent in compute or p2p timers, over its op count (the analogue of the
    torch rows' dispatch overhead), charged to every F and B of the simulator."""
    import statistics

    import _megatron_cpu as mc
    from megapipe.schedules import build
    from megapipe.simulate import P2PCost, StageTimes, simulate

    per_rank = mc.run_ranks(_megatron_body, world_size=2, args=(steps,), timeout_s=600)
    rows = []
    for index, (label, _, _, vp) in enumerate(MEGATRON_CASES):
        latency = per_rank[0][index]["latency_ms"]
        columns = []
        for metrics in per_rank[0][index]["steps"]:
            ops = [r.num_forward + r.num_backward for r in metrics.ranks]
            overhead = statistics.fmean(r.other_ms / n for r, n in zip(metrics.ranks, ops))
            schedule = build(
                "interleaved_1f1b" if vp else "1f1b", pipeline_model_parallel_size=metrics.pipeline_model_parallel_size,
                num_microbatches=metrics.num_microbatches, virtual_pipeline_model_parallel_size=vp or 1,
            )
            times = StageTimes(
                fwd_ms=tuple(f + overhead for f in metrics.stage_forward_ms),
                bwd_ms=tuple(b + overhead for b in metrics.stage_backward_ms),
                wgrad_ms=(0.0,) * len(metrics.stage_forward_ms),
            )
            sim = simulate(schedule, times, p2p=P2PCost(latency_ms=latency))
            busy = sum(r.compute_ms + overhead * n for r, n in zip(metrics.ranks, ops))
            measured = metrics.makespan_ms
            columns.append((
                measured, sim.step_time_ms, 1 - busy / (metrics.pipeline_model_parallel_size * measured),
                sim.bubble_fraction, overhead,
            ))
        medians = [statistics.median(c) for c in zip(*columns)]
        rows.append((label, *medians, latency))
    return rows


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (2-4 on a 2-core machine)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per schedule (after 1 warm-up)")
    parser.add_argument("--scale", type=float, default=2.0, help="multiplier on the per-stage sleeps")
    parser.add_argument("--latency", choices=("pingpong", "timeline"), default="timeline",
                        help="p2p latency: gloo ping-pong, or the mean input wait read from the run's timeline")
    parser.add_argument("--megatron", action="store_true",
                        help="add megatron-core rows (real 1F1B and interleaved schedules, 2 ranks, "
                        "GPT units with sleeps)")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    cases = [
        validation_case(
            name, pipeline_model_parallel_size=args.pp, num_microbatches=args.microbatches, scale=args.scale
        )
        for name in VALIDATION_SCHEDULES
    ]
    started = time.perf_counter()
    results = run_pipeline(cases, steps=args.steps, warmup_steps=1)
    wall_s = time.perf_counter() - started
    header = (
        "| torch schedule | simulated order | measured step ms | predicted step ms | ratio | "
        "measured bubble | predicted bubble | Δ bubble | dispatch ms/op | p2p ms |"
    )
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results:
        schedule = megapipe_schedule_for(result.case)
        latency = result.p2p_ms if args.latency == "pingpong" else runtime_gaps_ms(result)[1]
        row = compare(result, schedule, latency_ms=latency)
        order = VALIDATION_SCHEDULES[result.case.label][1] or "torch's order"
        print(
            f"| {row.name} | {order} | {row.measured_step_ms:.1f} | {row.predicted_step_ms:.1f} | "
            f"{row.predicted_step_ms / row.measured_step_ms:.3f} | {row.measured_bubble:.3f} | "
            f"{row.predicted_bubble:.3f} | {row.bubble_error:+.3f} | {row.overhead_ms:.2f} | {row.latency_ms:.3f} |"
        )
    if args.megatron:
        for label, measured, predicted, bubble, predicted_bubble, overhead, latency in _megatron_rows(steps=args.steps):
            schedule = "interleaved_1f1b" if "interleaved" in label else "1f1b"
            print(
                f"| {label} | {schedule} | {measured:.1f} | {predicted:.1f} | {predicted / measured:.3f} | "
                f"{bubble:.3f} | {predicted_bubble:.3f} | {predicted_bubble - bubble:+.3f} | "
                f"{overhead:.2f} | {latency:.3f} |"
            )
    print(f"\nP={args.pp}, m={args.microbatches}, {args.steps} measured steps, sleeps x{args.scale}; "
          f"gloo ping-pong p2p {results[0].p2p_ms:.3f} ms; wall {wall_s:.1f} s")


if __name__ == "__main__":
    main()
