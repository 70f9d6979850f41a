"""Simulator throughput: scheduled ops per second, against a bare-loop yardstick.

    python scripts/bench_simulate.py [--repeats 5]

For each case the script times ``simulate`` on a schedule seen for the first time
("cold": validation and lowering included) and again ("warm": the lowered form is
memoised on the Schedule record, the planner's case of many time tables per
order). The yardstick is a bare Python loop over the same ops, in an order that
satisfies every dependency, doing only the max/add arithmetic of the recurrence
``start = max(rank free, dependency end + delay); end = start + duration``. Each
figure is the best of ``--repeats`` runs in process CPU time (other processes on
the machine do not count); the ratio simulate / yardstick cancels the speed of the
machine. Growth in ops is shown for 1F1B P=32 with m = 64..512.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from megapipe.schedules import build
from megapipe.simulate import P2PCost, StageTimes, simulate
from megapipe.simulate.program import lower


def _yardstick_inputs(schedule, result):
    """Ops in start-time order with (rank, dependency position or -1, delay, duration)."""
    program = lower(schedule)
    flat = []
    for rank, ops in enumerate(program.rank_ops):
        for index, op in enumerate(ops):
            flat.append((result.start_ms[rank][index], rank, op, program.deps[rank][index]))
    flat.sort()
    position = {op: i for i, (_, _, op, _) in enumerate(flat)}
    return [(rank, position.get(dep, -1), 0.01, 1.0) for _, rank, _, dep in flat], len(program.rank_ops)


def _yardstick(rows, ranks):
    end = [0.0] * len(rows)
    free = [0.0] * ranks
    for i, (rank, dep, delay, duration) in enumerate(rows):
        now = free[rank]
        if dep >= 0:
            arrival = end[dep] + delay
            if arrival > now:
                now = arrival
        now += duration
        end[i] = now
        free[rank] = now
    return end


def _best(function, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        function()
        best = min(best, time.process_time() - start)
    return best


def _case(name, pp, m, v, repeats):
    schedule = build(name, pipeline_model_parallel_size=pp, num_microbatches=m, virtual_pipeline_model_parallel_size=v)
    times = StageTimes.uniform(schedule.num_stages, fwd_ms=1.0 / v, input_grad_ms=1.0 / v, wgrad_ms=0.5 / v)
    p2p = P2PCost(latency_ms=0.01)
    result = simulate(schedule, times, p2p=p2p)
    rows, ranks = _yardstick_inputs(schedule, result)
    fresh = [dataclasses.replace(schedule) for _ in range(repeats)]
    cold = _best(lambda: simulate(fresh.pop(), times, p2p=p2p), repeats)
    warm = _best(lambda: simulate(schedule, times, p2p=p2p), repeats)
    bare = _best(lambda: _yardstick(rows, ranks), repeats)
    ops = schedule.num_ops
    print(f"{name:17s} P={pp:<3d} v={v} m={m:<4d} ops={ops:7d}  cold {ops / cold / 1e3:7.0f}k ops/s  "
          f"warm {ops / warm / 1e3:7.0f}k ops/s  yardstick {ops / bare / 1e3:7.0f}k ops/s  "
          f"cold/yardstick {cold / bare:5.2f}x  warm/yardstick {warm / bare:5.2f}x")
    return ops, cold, warm, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("targets: >= 500k ops/s, 1F1B P=32 m=256 and interleaved P=16 v=4 m=256")
    _case("1f1b", 32, 256, 1, args.repeats)
    _case("interleaved_1f1b", 16, 256, 4, args.repeats)
    _case("zb_h2", 32, 256, 1, args.repeats)
    print("growth in ops, 1F1B P=32 (time per op should stay flat):")
    for m in (64, 128, 256, 512):
        ops, cold, warm, _ = _case("1f1b", 32, m, 1, args.repeats)
        print(f"    m={m:4d}: cold {1e9 * cold / ops:6.0f} ns/op, warm {1e9 * warm / ops:6.0f} ns/op")


if __name__ == "__main__":
    main()
