"""Benchmark ``megapipe pack``: 50 jobs on 512 H100 nodes, decided on one core.

The jobs are drawn (fixed seed) from six job shapes, the mix of a shared cluster: Llama 3 8B at two batch
sizes, Llama 3 70B, Mixtral 8x7B, Qwen3-30B-A3B and Llama 3 405B, each job with its own weight and token
budget. Prints:

* the decision: every curve point the planner searches (one search per job shape, node count), then the
  exact packing (``solve_packing``: the DP over node counts), split into the two;
* the packing alone by the HiGHS MILP, on the same curves (it must agree with the DP);
* the yardstick measured in the same run: a planner search per *job* and node count (no sharing of curves
  between jobs of one shape), timed on a sample of points and extrapolated, and the ratio to it.

    python scripts/bench_pack.py [--jobs 50] [--nodes 512] [--sample 6]
"""

from __future__ import annotations

import argparse
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megapipe.config import compose, to_scenario  # noqa: E402
from megapipe.pack import CurveCache, job_options, solve_milp  # noqa: E402
from megapipe.pack.solve import solve_packing  # noqa: E402
from megapipe.pack.curves import default_node_counts  # noqa: E402
from megapipe.records import JobSpec  # noqa: E402
from megapipe.options import PackOptions

SHAPES = (("llama3_8b", 128, 4096), ("llama3_8b", 1024, 8192), ("llama3_70b", 512, 8192), ("mixtral_8x7b", 512, 4096),
          ("qwen3_30b_a3b", 512, 4096), ("llama3_405b", 1024, 8192))


def _jobs(count: int) -> list[JobSpec]:
    rng = random.Random(20261201)
    specs = {}
    for model, batch, seq in SHAPES:
        scenario = to_scenario(compose([f"model={model}", f"train.global_batch_size={batch}", f"train.seq_length={seq}"]),
                               search=True)
        specs[(model, batch, seq)] = (scenario.model, scenario.train)
    jobs = []
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)] if index < len(SHAPES) else rng.choice(SHAPES)
        model, train = specs[shape]
        jobs.append(JobSpec(name=f"job{index:02d}", model=model, train=train, weight=rng.choice((0.5, 1.0, 2.0)),
                            tokens=rng.choice((1e10, 5e10, 2e11))))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=512)
    parser.add_argument("--sample", type=int, default=6, help="curve points timed for the yardstick")
    args = parser.parse_args()
    cluster = to_scenario(compose([f"cluster.num_nodes={args.nodes}"]), search=True).cluster
    jobs = _jobs(args.jobs)
    options = PackOptions()
    cpu, wall = time.process_time(), time.perf_counter()
    cache = CurveCache(cluster=cluster)
    curves = [job_options(job, cache) for job in jobs]
    curve_cpu = time.process_time() - cpu
    solve_start = time.process_time()
    packing = solve_packing(jobs, curves, (args.nodes,), objective=options.objective)
    dp_cpu = time.process_time() - solve_start
    decide_cpu, decide_wall = time.process_time() - cpu, time.perf_counter() - wall
    milp_start = time.process_time()
    milp = solve_milp(jobs, curves, (args.nodes,), objective=options.objective)
    milp_cpu = time.process_time() - milp_start
    used = sum(curves[j][o].nodes for j, o in enumerate(packing.choice))
    print(f"{len(jobs)} jobs ({len(SHAPES)} shapes) on {args.nodes} x {cluster.gpu.name} nodes, node counts "
          f"{default_node_counts(args.nodes)}")
    print(f"decision: {decide_cpu:.2f} s CPU ({decide_wall:.2f} s wall) against the 10 s target: "
          f"{'met' if decide_cpu < 10 else 'not met'}")
    print(f"  curves: {cache.searches} planner searches, {curve_cpu:.2f} s; exact packing (DP over node counts, "
          f"{sum(len(c) for c in curves)} options): {dp_cpu:.3f} s; {used} nodes used")
    print(f"  HiGHS MILP on the same curves: {milp_cpu:.3f} s ({milp_cpu / dp_cpu:.1f}x the DP), value "
          f"{milp.value / packing.value:.12f} of the DP's")
    # yardstick: one search per job and node count, nothing shared; time a sample of fresh points
    rng = random.Random(7)
    points = [(rng.randrange(len(jobs)), rng.choice(default_node_counts(args.nodes))) for _ in range(args.sample)]
    start = time.process_time()
    for j, nodes in points:
        CurveCache(cluster=cluster).best(jobs[j], 0, nodes)
    per_point = (time.process_time() - start) / len(points)
    naive = per_point * len(jobs) * len(default_node_counts(args.nodes))
    print(f"yardstick (a search per job and node count, {per_point:.3f} s per point over {len(points)} sampled): "
          f"{naive:.1f} s extrapolated; the decision is {naive / decide_cpu:.1f}x faster")


if __name__ == "__main__":
    main()
