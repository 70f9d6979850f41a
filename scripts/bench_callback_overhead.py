"""Training monitor overhead: the same CPU training with and without the monitor attached.

    python scripts/bench_callback_overhead.py [--rounds 6] [--steps 10] [--log-every 10]

Two gloo ranks run megatron-core's real 1F1B schedule (pp=2, the test harness's
GPT on CPU). Blocks of ``--steps`` steps without the monitor (the yardstick)
alternate with blocks with it (schedule hook + ``step_end`` after every step,
metrics and JSONL every ``--log-every`` steps, topology check off), the order
flipping every round so slow drift does not favour either. A block's figure is
its wall time per step on the slower rank, timed from a barrier that lines the
ranks up, so both variants start level (the last stage ends each step before
the first stage, and only the monitor's end-of-window gather lines them up at
a block's end). Printed: each variant's median over
rounds; the paired ratio (with / without in the same round), its mean with a 95%
confidence interval over rounds (normal approximation), so one can see whether
the machine's noise resolves a 1% overhead; and the time spent inside
``step_end`` calls per step (the monitor's own work on the step's critical path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import _megatron_cpu as mc  # noqa: E402


def _block(models, *, steps, monitor_kwargs, microbatches):
    import torch

    from megapipe.monitor.monitor import attach_monitor

    mon = attach_monitor(models, **monitor_kwargs) if monitor_kwargs is not None else None
    inside = [0.0, 0.0]  # inside step_end; inside the schedule hook's callbacks

    def between(step):
        if mon is not None:
            start = time.perf_counter()
            mon.step_end(step)
            inside[0] += time.perf_counter() - start

    if mon is not None and mon.hook is not None:
        _account(mon.hook, inside)

    if mon is not None:
        mon.train_start()
    torch.distributed.barrier()  # every block starts with the ranks level (see the module docstring)
    start, cpu = time.perf_counter(), time.process_time()
    mc.train_steps(models, num_steps=steps, num_microbatches=microbatches, micro_batch_size=2, seq_length=64,
                   between_steps=between)
    wall = (time.perf_counter() - start) / steps
    cpu = (time.process_time() - cpu) / steps
    if mon is not None:
        mon.train_end()
    return wall, inside[0] / steps, inside[1] / steps, cpu


def _account(hook, inside) -> None:
    """Time spent inside the hook's callbacks (recording, step derivation, its gather), per block."""

    def timed(function):
        def wrapper(*args):
            start = time.perf_counter()
            function(*args)
            inside[1] += time.perf_counter() - start
        return wrapper

    for name in ("_on_start", "_on_stop", "_on_step_start", "_on_step_end"):
        setattr(hook, name, timed(getattr(hook, name)))


def _bench(rank, world_size, rounds, steps, log_every, log_dir, sleep_ms):
    with mc.megatron_cpu():
        mc.init_model_parallel(pipeline_model_parallel_size=2)
        delays = mc.UnitDelays(decoder=(sleep_ms, 2 * sleep_ms))
        models = mc.build_gpt_chunks(layout=None, num_layers=4, hidden_size=64, seq_length=64, delays_ms=delays)
        kwargs = dict(log_every=log_every, topology_check=False, log_dir=log_dir, tokens_per_step=8 * 2 * 64)
        _block(models, steps=2, monitor_kwargs=None, microbatches=8)  # warm-up
        out = {"without": [], "with": [], "inside": [], "hook": [], "cpu_without": [], "cpu_with": []}
        for round_ in range(rounds):
            if round_ % 2:
                wall, inside, hook, cpu = _block(models, steps=steps, monitor_kwargs=kwargs, microbatches=8)
                bare = _block(models, steps=steps, monitor_kwargs=None, microbatches=8)
            else:
                bare = _block(models, steps=steps, monitor_kwargs=None, microbatches=8)
                wall, inside, hook, cpu = _block(models, steps=steps, monitor_kwargs=kwargs, microbatches=8)
            out["without"].append(bare[0])
            out["cpu_without"].append(bare[3])
            out["cpu_with"].append(cpu)
            out["with"].append(wall)
            out["inside"].append(inside)
            out["hook"].append(hook)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--sleep-ms", type=float, default=0.0,
                        help="sleep this long per decoder layer in forward (twice in backward) per microbatch: "
                             "controlled op times that leave the cores idle, for a low-noise step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as log_dir:
        ranks = mc.run_ranks(_bench, world_size=2, args=(args.rounds, args.steps, args.log_every, log_dir, args.sleep_ms),
                             timeout_s=900)
    blocks = {key: [max(r[key][i] for r in ranks) for i in range(args.rounds)] for key in ("without", "with", "inside", "hook")}
    without, with_ = statistics.median(blocks["without"]) * 1e3, statistics.median(blocks["with"]) * 1e3
    inside = statistics.median(blocks["inside"]) * 1e3
    hook = statistics.median(blocks["hook"]) * 1e3
    cpu_ratios = ", ".join(
        f"rank {i} {statistics.median(r['cpu_with']) / statistics.median(r['cpu_without']):.4f}"
        for i, r in enumerate(ranks)
    )
    per_rank = ", ".join(
        f"rank {i} {statistics.median(r['inside']) * 1e3:.3f} + {statistics.median(r['hook']) * 1e3:.3f} ms"
        for i, r in enumerate(ranks)
    )
    paired = [w / wo for w, wo in zip(blocks["with"], blocks["without"])]
    mean = statistics.fmean(paired)
    half = 1.96 * statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
    print(f"log_every={args.log_every}: step without monitor {without:.2f} ms (yardstick), with {with_:.2f} ms, "
          f"ratio of medians {with_ / without:.4f} ({(with_ / without - 1) * 100:+.2f}%); paired ratio over {len(paired)} "
          f"rounds: mean {mean:.4f} ({(mean - 1) * 100:+.2f}%), 95% CI [{(mean - half - 1) * 100:+.2f}%, "
          f"{(mean + half - 1) * 100:+.2f}%], median {statistics.median(paired):.4f}; inside step_end {inside:.3f} ms/step "
          f"= {inside / without * 100:.2f}% of the step; inside the hook's callbacks "
          f"{hook:.3f} ms/step = {hook / without * 100:.2f}% (includes waiting in its gather for the slower rank); per rank, step_end + hook: {per_rank}; "
          f"CPU time per step with / without (median of blocks): {cpu_ratios}; "
          f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
