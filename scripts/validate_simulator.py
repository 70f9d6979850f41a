"""Predicted vs measured step time and bubble for real torch.distributed.pipelining runs.

Runs every schedule of the validation set on P gloo ranks (CPU) over stage modules
whose F, I and W costs are uneven sleeps, records every op's interval, feeds the
measured mean op times, the runtime's dispatch overhead per op and the gloo p2p
latency into megapipe's simulator with megapipe's schedule, and prints one row per
schedule. The yardstick is the measured step time of the same run; the ratio
column is predicted / measured.

    python scripts/validate_simulator.py [--pp 4] [--microbatches 8] [--steps 3] [--scale 2.0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _torch_pipelining import (  # noqa: E402
    VALIDATION_SCHEDULES,
    compare,
    megapipe_schedule_for,
    run_pipeline,
    runtime_gaps_ms,
    validation_case,
)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (2-4 on a 2-core machine)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per schedule (after 1 warm-up)")
    parser.add_argument("--scale", type=float, default=2.0, help="multiplier on the per-stage sleeps")
    parser.add_argument("--latency", choices=("pingpong", "timeline"), default="timeline",
                        help="p2p latency: gloo ping-pong, or the mean input wait read from the run's timeline")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    cases = [
        validation_case(name, pipeline_model_parallel_size=args.pp, num_microbatches=args.microbatches, scale=args.scale)
        for name in VALIDATION_SCHEDULES
    ]
    started = time.perf_counter()
    results = run_pipeline(cases, steps=args.steps, warmup_steps=1)
    wall_s = time.perf_counter() - started
    header = (
        f"| torch schedule | simulated order | measured step ms | predicted step ms | ratio | "
        f"measured bubble | predicted bubble | Δ bubble | dispatch ms/op | p2p ms |"
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
    print(f"\nP={args.pp}, m={args.microbatches}, {args.steps} measured steps, sleeps x{args.scale}; "
          f"gloo ping-pong p2p {results[0].p2p_ms:.3f} ms; wall {wall_s:.1f} s")


if __name__ == "__main__":
    main()
