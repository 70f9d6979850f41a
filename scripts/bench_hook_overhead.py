"""Overhead of the schedule hook on a real megatron-core pipeline step (CPU, gloo).

Two ranks run the real ``get_forward_backward_func()`` 1F1B schedule on a small
GPTModel; blocks of steps without the hook (the yardstick) alternate with blocks
with the hook attached (all_gather every step), so drift in machine load hits
both equally. Prints the median step time of each and their ratio.

    python scripts/bench_hook_overhead.py [--rounds 6] [--steps 10] [--gather-every 10]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import _megatron_cpu as mc  # noqa: E402  (test harness: CPU shim + spawn)


def _rank(rank: int, world_size: int, rounds: int, steps: int, layers: int, hidden: int, seq: int, micro: int, every: int):
    import warnings

    warnings.filterwarnings("ignore")
    from megapipe.monitor import attach

    with mc.megatron_cpu():
        mc.init_model_parallel(pipeline_model_parallel_size=world_size)
        models = mc.build_gpt_chunks(layout=None, num_layers=layers, hidden_size=hidden, seq_length=seq)
        mc.train_steps(models, num_steps=2, num_microbatches=micro, seq_length=seq)  # warm-up
        base, hooked = [], []
        for _ in range(rounds):
            base += mc.train_steps(models, num_steps=steps, num_microbatches=micro, seq_length=seq).wall_s
            hook = attach(models, gather_every=every)
            hooked += mc.train_steps(models, num_steps=steps, num_microbatches=micro, seq_length=seq).wall_s
            hook.detach()
        return base, hooked, len(hook.reports)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--gather-every", type=int, default=10, help="steps per all_gather")
    args = parser.parse_args()
    results = mc.run_ranks(
        _rank, world_size=2, args=(args.rounds, args.steps, args.layers, args.hidden, args.seq, args.microbatches, args.gather_every),
        timeout_s=1200,
    )
    base = [max(steps) for steps in zip(*(r[0] for r in results))]
    hooked = [max(steps) for steps in zip(*(r[1] for r in results))]
    base_ms, hooked_ms = statistics.median(base) * 1e3, statistics.median(hooked) * 1e3
    print(f"steps per variant: {len(base)} (pp=2, {args.microbatches} microbatches, {args.layers} layers, "
          f"hidden {args.hidden}, seq {args.seq}, all_gather every {args.gather_every} steps); reports per hooked block: {results[0][2]}")
    print(f"without hook (yardstick): median step {base_ms:.2f} ms")
    print(f"with hook:                median step {hooked_ms:.2f} ms")
    print(f"ratio with/without: {hooked_ms / base_ms:.4f}  (overhead {100 * (hooked_ms / base_ms - 1):+.2f}%)")


if __name__ == "__main__":
    main()
