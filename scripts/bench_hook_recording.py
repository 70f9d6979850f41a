"""The schedule hook's recording cost per timer call, without torch or Megatron.

    python scripts/bench_hook_recording.py [--pairs 200000] [--pairs-per-step 50]

Drives a hook attached to a bare config object through megatron-core's timer call
pattern: ``config.timers(name, log_level=2).start()`` / ``.stop()`` pairs, a
``forward-backward`` step timer around every ``--pairs-per-step`` pairs (so each
step also pays the hook's step derivation). Yardstick, measured in the same run:
the same calls on a ``config.timers`` that returns a no-op timer (the cheapest
thing Megatron could be calling). Prints microseconds per pair for both, with
and without step ends, and the ratio to the yardstick. One thread; best of
``--repeats``.

Also prints what importing the simulator costs in a fresh interpreter that has
already imported the hook (the import ``attach`` now does up front instead of
inside the first step that gathers), against that interpreter's import of the
hook module itself as the yardstick. Bytecode caching changes both, so the run
reports ``sys.dont_write_bytecode``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from megapipe.monitor.clock import HostClock
from megapipe.monitor.hook import ScheduleHook


class _Config:
    virtual_pipeline_model_parallel_size = None
    microbatch_group_size_per_vp_stage = None
    pipeline_model_parallel_size = 2
    timers = None


class _NoOpTimer:
    def start(self, *args, **kwargs):
        pass

    def stop(self, *args, **kwargs):
        pass


class _NoOpTimers:
    _timer = _NoOpTimer()

    def __call__(self, name, *args, **kwargs):
        return self._timer


def _drive(timers, pairs: int, per_step: int) -> float:
    start = time.perf_counter()
    for i in range(pairs):
        if i % per_step == 0:
            timers("forward-backward", log_level=1).start(barrier=False)
        timers("forward-compute", log_level=2).start()
        timers("forward-compute", log_level=2).stop()
        if i % per_step == per_step - 1:
            timers("forward-backward", log_level=1).stop()
    return (time.perf_counter() - start) / pairs * 1e6


_IMPORTS = """
import time
start = time.perf_counter()
import megapipe.monitor.hook
hook = time.perf_counter() - start
start = time.perf_counter()
import megapipe.monitor.predict
print(hook, time.perf_counter() - start)
"""


def _import_ms() -> tuple[float, float]:
    """(hook module import, simulator import after it) in ms, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", _IMPORTS], check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    hook, simulator = (float(x) * 1e3 for x in out.stdout.split())
    return hook, simulator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--pairs-per-step", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = _Config()
    ScheduleHook(configs=[config], group=None, gather_every=10, capacity=8192, warn_threshold=0.05,
                 plan_bubble_fraction=None, schedule=None, p2p_latency_ms=0.0, on_report=None, clock=HostClock(),
                 gather_device="cpu", keep_reports=64)
    hook_timers, null_timers = config.timers, _NoOpTimers()
    no_steps = args.pairs + 1  # the step timer opens once and never closes: recording only
    for label, per_step in (("recording only", no_steps), (f"with a step end every {args.pairs_per_step} pairs",
                                                          args.pairs_per_step)):
        hook = min(_drive(hook_timers, args.pairs, per_step) for _ in range(args.repeats))
        null = min(_drive(null_timers, args.pairs, per_step) for _ in range(args.repeats))
        print(f"{label}: hook {hook:.3f} us/pair, no-op timers (yardstick) {null:.3f} us/pair, "
              f"ratio {hook / null:.2f}x, hook's own cost {hook - null:.3f} us/pair")
    runs = [_import_ms() for _ in range(args.repeats)]
    hook_ms, simulator_ms = min(r[0] for r in runs), min(r[1] for r in runs)
    print(f"fresh interpreter (dont_write_bytecode={sys.dont_write_bytecode}): import megapipe.monitor.hook "
          f"{hook_ms:.1f} ms (yardstick), then the simulator {simulator_ms:.1f} ms = {simulator_ms / hook_ms:.2f}x; "
          f"best of {args.repeats}")


if __name__ == "__main__":
    main()
