"""Benchmark the planner: full search for llama3_70b on 128 H100s (16 x 8), seq 8192, global batch 256.

Prints the search time, how many candidates were enumerated / bounded / simulated, the rate in
candidates per second, and the ratio against a yardstick measured in the same run: naive
evaluation (a fresh evaluator per candidate: no caches, no bounds, every survivor of the
shape rules partitioned and simulated) on a random sample, extrapolated to the whole space.

    /work/venv/bin/python scripts/bench_plan.py [--sample 40]
"""

from __future__ import annotations

import argparse
import random
import time

from megapipe.commands.plan import search_inputs, search_options
from megapipe.config import compose
from megapipe.errors import InfeasibleError, ScheduleError
from megapipe.plan.evaluate import Evaluator
from megapipe.plan.search import search
from megapipe.plan.space import enumerate_candidates

CALCULON_PER_S = 433.0
"""Calculon's brute-force rate on this kind of machine (configs/s/core)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sample", type=int, default=40)
    args = parser.parse_args()
    cfg = compose(["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=8192", "train.global_batch_size=256"])
    setup, fixed = search_inputs(cfg)
    options = search_options(cfg)
    started = time.perf_counter()
    result = search(model=setup.model, cluster=setup.cluster, train=setup.train, fixed=fixed, options=options)
    seconds = time.perf_counter() - started
    stats = result.stats
    best = result.best
    print(f"search: {seconds:.2f} s; enumerated {stats.enumerated}, bounded {stats.evaluated}, "
          f"simulated {stats.simulated}, pruned {dict(stats.pruned)}")
    print(f"best: TP={best.parallel.tensor_model_parallel_size} PP={best.parallel.pipeline_model_parallel_size} "
          f"DP={best.parallel.data_parallel_size} VP={best.parallel.virtual_pipeline_model_parallel_size} "
          f"{best.schedule} mbs={best.train.micro_batch_size} {best.train.recompute_granularity.value}: "
          f"{best.tokens_per_s_per_gpu:.0f} tok/s/GPU, MFU {best.mfu:.1%}")
    rate = stats.enumerated / seconds
    print(f"rate: {rate:,.0f} candidates/s/core (enumerated), {stats.evaluated / seconds:,.0f} bounded/s, "
          f"{stats.simulated / seconds:,.1f} simulated/s")

    space = enumerate_candidates(model=setup.model, cluster=setup.cluster, train=setup.train, fixed=fixed,
                                 options=options)
    sample = random.Random(0).sample(space.candidates, min(args.sample, len(space.candidates)))
    naive_started = time.perf_counter()
    for cand in sample:
        try:
            Evaluator(model=setup.model, cluster=setup.cluster, options=options).evaluate(cand)
        except (InfeasibleError, ScheduleError):
            pass
    per_candidate = (time.perf_counter() - naive_started) / len(sample)
    naive_total = per_candidate * len(space.candidates)
    print(f"yardstick (naive, no caches/bounds): {1 / per_candidate:,.1f} candidates/s; "
          f"whole space {naive_total:.1f} s (extrapolated from {len(sample)})")
    print(f"ratio: search is {naive_total / seconds:.1f}x faster than naive; "
          f"{rate / CALCULON_PER_S:.2f}x Calculon's {CALCULON_PER_S:.0f} configs/s (published figure, not re-measured)")


if __name__ == "__main__":
    main()
