"""Benchmark the planner: full search for llama3_70b on 128 H100s (16 x 8), seq 8192, global batch 256;
with ``--moe``, DeepSeek-V3 on 1,024 H100s (128 x 8), seq 4096, global batch 8192, expert parallelism searched.

Prints, on one core (CPU time of this single-threaded process; wall clock alongside):

* the full search: its time and what happened to every candidate (pruned by a shape rule,
  pruned by a provable bound or the closed-form memory check, or partitioned and simulated);
* (a) candidates decided per second: every enumerated candidate is decided, either exactly
  evaluated or provably pruned, so this is enumerated / search time;
* (b) exact evaluations per second: partition + simulation + pricing of candidates that fit
  memory, one after the other on a warm evaluator (as the search runs them);
* the yardstick measured in the same run: naive evaluation (a fresh evaluator per candidate
  and cleared schedule caches: no caches, no bounds, every candidate partitioned and
  simulated) on a random sample, extrapolated to the whole space; and the ratios of (a) and
  (b) to it and to Calculon's published 433 configs/s/core.

    python scripts/bench_plan.py [--sample 40] [--exact 200] [--repeats 3] [--moe] [--max-virtual N]

``--max-virtual N`` also times the same search with VP capped at N (the yardstick of the full VP range).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megapipe.config import to_scenario  # noqa: E402
from megapipe.config import compose  # noqa: E402
from megapipe.config.options import search_options  # noqa: E402
from megapipe.errors import InfeasibleError, ScheduleError  # noqa: E402
from megapipe.plan.evaluator import Evaluator  # noqa: E402
from megapipe.plan.search import search  # noqa: E402
from megapipe.plan.space import enumerate_candidates  # noqa: E402
from megapipe.schedules import in_flight, registry  # noqa: E402

CALCULON_PER_S = 433.0
"""Calculon's brute-force rate (configs/s/core), the published figure; not re-measured here."""
TARGET_PER_S = 22_000.0
"""50x Calculon."""


def _clear_caches() -> None:
    registry.build.cache_clear()
    in_flight._interleaved.cache_clear()


def _timed(function):
    _clear_caches()
    cpu, wall = time.process_time(), time.perf_counter()
    result = function()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def _search(scenario, fixed, options, repeats: int):
    runs = [_timed(lambda: search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=fixed,
                                  options=options)) for _ in range(repeats)]
    result = runs[0][0]
    cpu = min(run[1] for run in runs)
    wall = min(run[2] for run in runs)
    stats, best = result.stats, result.best
    print(f"search: {cpu:.3f} s CPU ({wall:.3f} s wall), best of {repeats}, cold caches each")
    print(f"  enumerated {stats.enumerated}; pruned {dict(stats.pruned)}; bounded {stats.evaluated}; "
          f"partitioned {stats.partitioned}; simulated {stats.simulated}")
    print(f"  best: TP={best.parallel.tensor_model_parallel_size} PP={best.parallel.pipeline_model_parallel_size} "
          f"DP={best.parallel.data_parallel_size} VP={best.parallel.virtual_pipeline_model_parallel_size} "
          f"{best.schedule} mbs={best.train.micro_batch_size} {best.train.recompute_granularity.value}: "
          f"{best.tokens_per_s_per_gpu:.0f} tok/s/GPU, MFU {best.mfu:.1%}")
    return stats, cpu


def _exact_rate(scenario, options, space, count: int) -> tuple[float, float, int]:
    """Exact evaluations per CPU second over candidates that fit memory: schedules built as needed, then built."""
    evaluator = Evaluator(model=scenario.model, cluster=scenario.cluster, options=options)
    fitting = [cand for cand in space.candidates if evaluator.bounds.split_can_fit(cand)]
    sample = random.Random(1).sample(fitting, min(count, len(fitting)))
    for cand in sample:  # layer costs are costed once per search; keep them out of the rate
        evaluator.costs.profile(cand)
    _clear_caches()
    rates = []
    for _ in range(2):  # first pass builds each schedule once; the second finds them built
        started = time.process_time()
        done = 0
        for cand in sample:
            try:
                evaluator.evaluate(cand)
                done += 1
            except (InfeasibleError, ScheduleError):
                pass
        rates.append(done / (time.process_time() - started))
    return rates[0], rates[1], done


def _naive_rate(scenario, options, space, count: int) -> float:
    sample = random.Random(0).sample(space.candidates, min(count, len(space.candidates)))
    started = time.process_time()
    for cand in sample:
        _clear_caches()
        try:
            Evaluator(model=scenario.model, cluster=scenario.cluster, options=options).evaluate(cand)
        except (InfeasibleError, ScheduleError):
            pass
    return len(sample) / (time.process_time() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample", type=int, default=40, help="candidates for the naive yardstick")
    parser.add_argument("--exact", type=int, default=200, help="candidates for the exact-evaluation rate")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-virtual", type=int, default=None,
                        help="also time the search with search.max_virtual_pipeline_model_parallel_size=N")
    parser.add_argument("--moe", action="store_true",
                        help="DeepSeek-V3 (MLA, 256 experts, MTP) on 1,024 H100 (128 x 8), global batch 8192, EP searched")
    args = parser.parse_args()
    if args.moe:
        cfg = compose(["model=deepseek_v3", "cluster=h100_80gb", "cluster.num_nodes=128", "train.global_batch_size=8192"])
    else:
        cfg = compose(["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=8192", "train.global_batch_size=256"])
    scenario = to_scenario(cfg, search=True)
    fixed = scenario.fixed
    options = search_options(cfg)
    stats, seconds = _search(scenario, fixed, options, args.repeats)
    if args.max_virtual is not None:
        print(f"with VP capped at {args.max_virtual}:")
        _, capped = _search(scenario, fixed, dataclasses.replace(options, max_virtual_pipeline_model_parallel_size=
                                                                 args.max_virtual), args.repeats)
        print(f"every VP against VP <= {args.max_virtual}: {seconds / capped:.2f}x the time")
    space = enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=fixed,
                                 options=options)
    decided = stats.enumerated / seconds
    exact, exact_warm, exact_count = _exact_rate(scenario, options, space, args.exact)
    naive = _naive_rate(scenario, options, space, args.sample)
    naive_total = len(space.candidates) / naive
    print(f"yardstick (naive, no caches/bounds): {naive:,.1f} candidates/s; whole space "
          f"({len(space.candidates)} after shape rules) {naive_total:.1f} s (extrapolated from {args.sample})")
    print(f"(a) candidates decided/s/core: {decided:,.0f} = {decided / naive:,.0f}x naive, "
          f"{decided / CALCULON_PER_S:.1f}x Calculon's {CALCULON_PER_S:.0f}/s; target {TARGET_PER_S:,.0f}/s "
          f"{'met' if decided >= TARGET_PER_S else 'not met'}")
    print(f"(b) exact partition+simulation evaluations/s/core: {exact:,.0f} (over {exact_count} that fit; "
          f"{exact_warm:,.0f} with their schedules already built) = {exact / naive:.1f}x naive, "
          f"{exact_warm / CALCULON_PER_S:.2f}x Calculon; target {TARGET_PER_S:,.0f}/s "
          f"{'met' if exact_warm >= TARGET_PER_S else 'not met'}")
    print(f"full search {seconds:.3f} s against the 2 s target: {'met' if seconds < 2 else 'not met'}; "
          f"{naive_total / seconds:,.0f}x faster than naive over the whole space")


if __name__ == "__main__":
    main()
