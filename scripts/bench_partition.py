"""Benchmark: megapipe's exact partition solver against the textbook O(L^2 P) dynamic program.

The yardstick is the PipeDream-style DP (Narayanan et al., SOSP 2019, sec. 3.1, one
level): best[j][k] = min over i of max(best[j-1][i], cost_j(i, k)) subject to stage j's
memory, in plain Python on prefix sums. Both run in this process on the same seeded
instance (L entries on P heterogeneous, memory-capped 1F1B stages); the script checks
they find the same bottleneck and prints the speed ratio.

    python scripts/bench_partition.py [--entries 256] [--stages 64] [--seed 0] [--repeats 50] [--dp-repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import time

from megapipe.partition import StageSpec, in_flight_counts, solve
from megapipe.records import LayerCost, LayerKind

GIB = 2**30
# (name, time_scale, memory GiB): a mixed pool, slower GPUs with less memory.
GPU_TYPES = (("h100", 1.0, 72.0), ("h200", 0.95, 126.0), ("a100", 1.7, 72.0), ("a100_40", 1.7, 36.0))


def make_instance(*, num_entries: int, num_stages: int, seed: int):
    rng = random.Random(seed)
    layers = [LayerCost(name="embedding", kind=LayerKind.embedding, fwd_ms=0.4, bwd_ms=0.8, wgrad_ms=0.4,
                        static_bytes=6 * GIB, act_bytes=0.25 * GIB)]  # fmt: skip
    for index in range(num_entries - 2):
        fwd = rng.uniform(1.0, 3.0)
        layers.append(LayerCost(
            name=f"decoder.{index}", kind=LayerKind.decoder, fwd_ms=fwd, bwd_ms=2 * fwd, wgrad_ms=fwd,
            static_bytes=rng.randint(12, 20) * GIB // 8, act_bytes=rng.randint(2, 6) * GIB // 16,
        ))  # fmt: skip
    layers.append(LayerCost(name="loss", kind=LayerKind.loss, fwd_ms=2.5, bwd_ms=5.0, wgrad_ms=2.5,
                            static_bytes=6 * GIB, act_bytes=2 * GIB))  # fmt: skip
    stages = []
    for _ in range(num_stages):
        name, scale, memory = rng.choice(GPU_TYPES)
        stages.append(StageSpec(time_scale=scale, memory_bytes=memory * GIB, gpu_name=name))
    return layers, stages


def textbook_dp(layers, stages, in_flight) -> float:
    """O(L^2 P) min-max DP; returns the optimal bottleneck (math.inf when memory never fits)."""
    num_entries = len(layers)
    times = [0.0, *itertools.accumulate(e.fwd_ms + e.bwd_ms for e in layers)]
    static = [0.0, *itertools.accumulate(e.static_bytes for e in layers)]
    act = [0.0, *itertools.accumulate(e.act_bytes for e in layers)]
    best = [0.0] + [math.inf] * num_entries  # best[k]: first k entries on the stages so far
    for stage, count in zip(stages, in_flight):
        scale, cap = stage.time_scale, stage.memory_bytes
        nxt = [math.inf] * (num_entries + 1)
        for stop in range(1, num_entries + 1):
            value = math.inf
            for start in range(stop):
                if best[start] == math.inf:
                    continue
                if (static[stop] - static[start]) + count * (act[stop] - act[start]) > cap:
                    continue
                value = min(value, max(best[start], scale * (times[stop] - times[start])))
            nxt[stop] = value
        best = nxt
    return best[num_entries]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=256)
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dp-repeats", type=int, default=3)
    args = parser.parse_args()
    layers, stages = make_instance(num_entries=args.entries, num_stages=args.stages, seed=args.seed)
    call = dict(num_microbatches=args.microbatches, schedule="1f1b")

    solve(layers, stages, **call)  # warm imports and caches
    runs = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        part = solve(layers, stages, **call)
        runs.append(time.perf_counter() - began)
    ours = min(runs)

    in_flight = in_flight_counts(
        schedule="1f1b", pipeline_model_parallel_size=len(stages), num_microbatches=args.microbatches
    )
    dp_runs = []
    for _ in range(args.dp_repeats):
        began = time.perf_counter()
        reference = textbook_dp(layers, stages, in_flight)
        dp_runs.append(time.perf_counter() - began)
    yardstick = min(dp_runs)

    free = solve(layers, stages, **call, check_memory=False)
    agree = math.isclose(part.bottleneck_ms, reference, rel_tol=1e-9)
    print(f"instance: L={len(layers)} entries, P={len(stages)} stages, seed={args.seed}, "
          f"time_scale {min(s.time_scale for s in stages)}..{max(s.time_scale for s in stages)}, "
          f"memory {min(s.memory_bytes for s in stages) / GIB:.0f}..{max(s.memory_bytes for s in stages) / GIB:.0f} GiB")  # fmt: skip
    print(f"memory binds: bottleneck {part.bottleneck_ms:.4f} ms capped vs {free.bottleneck_ms:.4f} ms uncapped; "
          f"layers per stage {min(part.entries_per_stage)}..{max(part.entries_per_stage)}")  # fmt: skip
    print(f"textbook O(L^2 P) DP: {yardstick * 1e3:.1f} ms (best of {args.dp_repeats}), bottleneck {reference:.6f} ms")
    print(f"megapipe solve():     {ours * 1e3:.2f} ms (best of {args.repeats}), bottleneck {part.bottleneck_ms:.6f} ms")
    print(f"same bottleneck: {agree}; speed-up {yardstick / ours:.0f}x")
    if not agree:
        raise SystemExit("bottlenecks differ")


if __name__ == "__main__":
    main()
