"""``megapipe pack`` (on defaults and on the 50-job fleet) and ``megapipe validate`` as a user runs them, against a
yardstick measured in the same run: the speed budget's command-level goals.

Each round runs the console script in a fresh process (piped, pictures included) and times it on the wall clock;
pack's own "decided in" figure (curves and the exact packing) is read from its last lines. The yardstick, in the
same rounds: an interpreter that imports what any Hydra + numpy command pays (hydra, omegaconf, numpy). The
processes run as on a user's machine (``scripts/_bench_env.py``); each command's first run, which fills the
composed configs' cache, is timed and printed apart. Goals:
``megapipe pack`` <= 5 s; ``megapipe pack jobs=fleet_50`` decided in <= 10 s and done in <= 15 s;
``megapipe validate`` <= 60 s.

    python scripts/bench_commands.py [--rounds 3] [--only pack,fleet,validate]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from _bench_env import user_environment

_MEGAPIPE = os.path.join(os.path.dirname(sys.executable), "megapipe")
_DECIDED = re.compile(r"decided in ([0-9.]+) s")

COMMANDS = {
    "pack": (["pack"], {"whole": 5.0}),
    "fleet": (["pack", "jobs=fleet_50"], {"decided": 10.0, "whole": 15.0}),
    "validate": (["validate"], {"whole": 60.0}),
}
"""Name: (arguments, goal seconds by figure)."""


def _run(arguments: list[str], cache: str) -> tuple[float, float | None]:
    """(wall seconds, pack's decision seconds or None) of one fresh command."""
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        done = subprocess.run([_MEGAPIPE, *arguments, f"output.dir={directory}"], capture_output=True, text=True,
                              env=user_environment(cache))
        wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"megapipe {' '.join(arguments)} exited {done.returncode}: {done.stderr.strip()[-300:]}")
    found = _DECIDED.search(done.stdout)
    return wall, float(found.group(1)) if found else None


def _yardstick(cache: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import hydra, omegaconf, numpy"], check=True, env=user_environment(cache))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(COMMANDS), help="comma-separated: " + ", ".join(COMMANDS))
    args = parser.parse_args()
    names = [name for name in args.only.split(",") if name]
    unknown = [name for name in names if name not in COMMANDS]
    if unknown:
        raise SystemExit(f"--only {','.join(unknown)}: use some of {', '.join(COMMANDS)}")
    rows: dict[str, list[tuple[float, float | None]]] = {name: [] for name in names}
    stacks = []
    with tempfile.TemporaryDirectory() as cache:
        firsts = {name: _run(COMMANDS[name][0], cache)[0] for name in names}
        for _ in range(args.rounds):  # interleaved, so load drifts reach every figure alike
            stacks.append(_yardstick(cache))
            for name in names:
                rows[name].append(_run(COMMANDS[name][0], cache))
    stack = statistics.median(stacks)
    print(f"yardstick: importing hydra, omegaconf and numpy {stack:.3f} s (median of {args.rounds})")
    print("first runs (composing the configs and keeping them): " + "; ".join(
        f"megapipe {' '.join(COMMANDS[name][0])} {seconds:.1f} s" for name, seconds in firsts.items()))
    for name in names:
        arguments, goals = COMMANDS[name]
        wall = statistics.median(item[0] for item in rows[name])
        line = f"megapipe {' '.join(arguments)}: {wall:.1f} s = {wall / stack:.1f}x the yardstick"
        decided = [item[1] for item in rows[name] if item[1] is not None]
        if decided:
            median = statistics.median(decided)
            line += f"; decided in {median:.1f} s"
            if "decided" in goals:
                line += f" (goal {goals['decided']:g} s: {'met' if median <= goals['decided'] else 'not met'})"
        line += f"; whole command goal {goals['whole']:g} s: {'met' if wall <= goals['whole'] else 'not met'}"
        print(line + f"; medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
