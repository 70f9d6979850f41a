"""Overhead of the schedule hook on a real megatron-core pipeline step (CPU, gloo).

Two ranks run the real ``get_forward_backward_func()`` 1F1B schedule on a small
GPTModel. Blocks of ``--steps`` steps without the hook (the yardstick) alternate
with blocks with the hook attached, the order flipping every round so drift in
machine load hits both equally. Every block starts from a barrier, so the ranks
begin it level, and its figure is the slower rank's wall time per step. (Per-step
times are not comparable: the hook's all_gather lines the ranks up at the end of
a gather step, so the last stage's call on that step also holds its head start
on the first stage.)

Prints the median block of each variant, their ratio, and the paired ratio (with /
without in the same round) as a mean with a 95% confidence interval over rounds.

    python scripts/bench_hook_overhead.py [--rounds 30] [--steps 10] [--gather-every 10]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import _megatron_cpu as mc  # noqa: E402  (test harness: CPU shim + spawn)


def _block(models, *, hooked: bool, steps: int, micro: int, seq: int, every: int) -> tuple[float, int]:
    import torch

    from megapipe.monitor import attach

    hook = attach(models, gather_every=every) if hooked else None
    torch.distributed.barrier()
    start = time.perf_counter()
    mc.train_steps(models, num_steps=steps, num_microbatches=micro, seq_length=seq)
    wall = (time.perf_counter() - start) / steps
    reports = 0
    if hook is not None:
        reports = len(hook.reports)
        hook.detach()
    return wall, reports


def _rank(rank: int, world_size: int, rounds: int, steps: int, layers: int, hidden: int, seq: int, micro: int, every: int):
    import warnings

    warnings.filterwarnings("ignore")
    with mc.megatron_cpu():
        mc.init_model_parallel(pipeline_model_parallel_size=world_size)
        models = mc.build_gpt_chunks(layout=None, num_layers=layers, hidden_size=hidden, seq_length=seq)
        mc.train_steps(models, num_steps=2, num_microbatches=micro, seq_length=seq)  # warm-up
        base, hooked, reports = [], [], 0
        for round_ in range(rounds):
            for with_hook in ((True, False) if round_ % 2 else (False, True)):
                wall, count = _block(models, hooked=with_hook, steps=steps, micro=micro, seq=seq, every=every)
                (hooked if with_hook else base).append(wall)
                reports = max(reports, count)
        return base, hooked, reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--gather-every", type=int, default=10, help="steps per all_gather")
    args = parser.parse_args()
    results = mc.run_ranks(
        _rank, world_size=2, args=(args.rounds, args.steps, args.layers, args.hidden, args.seq, args.microbatches, args.gather_every),
        timeout_s=1800,
    )
    base = [max(blocks) for blocks in zip(*(r[0] for r in results))]
    hooked = [max(blocks) for blocks in zip(*(r[1] for r in results))]
    base_ms, hooked_ms = statistics.median(base) * 1e3, statistics.median(hooked) * 1e3
    paired = [h / b for h, b in zip(hooked, base)]
    mean = statistics.fmean(paired)
    half = 1.96 * statistics.stdev(paired) / len(paired) ** 0.5 if len(paired) > 1 else float("nan")
    print(f"{args.rounds} rounds of {args.steps}-step blocks per variant (pp=2, {args.microbatches} microbatches, "
          f"{args.layers} layers, hidden {args.hidden}, seq {args.seq}, all_gather every {args.gather_every} steps); "
          f"reports per hooked block: {results[0][2]}")
    print(f"without hook (yardstick): median block {base_ms:.2f} ms/step")
    print(f"with hook:                median block {hooked_ms:.2f} ms/step")
    print(f"ratio of medians: {hooked_ms / base_ms:.4f}  (overhead {100 * (hooked_ms / base_ms - 1):+.2f}%)")
    print(f"paired ratio: mean {mean:.4f} ({(mean - 1) * 100:+.2f}%), 95% CI [{(mean - half - 1) * 100:+.2f}%, "
          f"{(mean + half - 1) * 100:+.2f}%], median {statistics.median(paired):.4f}")


if __name__ == "__main__":
    main()
