"""``megapipe plan`` on defaults as a user runs it: when the ranked table appears and when the command ends,
against yardsticks measured in the same run.

Each round runs the console script in a fresh process (piped, as a script or CI sees it) and times, on the wall
clock, the first line of the answer (the table's title: the search is done) and the process's exit (files and
pictures written). Yardsticks, in the same rounds: a bare interpreter (``python -c pass``) and one that imports
what any Hydra + numpy command pays (hydra, omegaconf, numpy). Goals (the speed budget): the table within 1.0 s,
the whole command within 1.5 s.

The processes run as on a user's machine (``scripts/_bench_env.py``: bytecode kept, composed configs kept in
this run's own cache). The first run, which fills that cache, is timed and printed apart: it is what a user's
first command after an install, or after changing ``hydra_conf``, takes. Each round's ``output.dir`` is new, as a
user's often is.

    python scripts/bench_startup.py --rounds 5 [--no-pictures]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _bench_env import user_environment

_MEGAPIPE = os.path.join(os.path.dirname(sys.executable), "megapipe")


def _plan(pictures: bool, cache: str) -> tuple[float, float]:
    """(seconds until the first line of the answer, seconds until exit) of one fresh ``megapipe plan``."""
    with tempfile.TemporaryDirectory() as directory:
        args = [_MEGAPIPE, "plan", f"output.dir={directory}", f"output.pictures={'true' if pictures else 'false'}"]
        start = time.perf_counter()
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=user_environment(cache)) as process:
            process.stdout.readline()
            answered = time.perf_counter() - start
            process.stdout.read()
            if process.wait() != 0:
                raise SystemExit(f"megapipe plan exited {process.returncode}")
        return answered, time.perf_counter() - start


def _python(code: str, cache: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=user_environment(cache))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-pictures", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        first = _plan(not args.no_pictures, cache)  # writes the composition's cache (and any missing bytecode)
        for _ in range(args.rounds):  # interleaved, so load drifts reach every figure alike
            bare = _python("pass", cache)
            stack = _python("import hydra, omegaconf, numpy", cache)
            answered, ended = _plan(not args.no_pictures, cache)
            rows.append((bare, stack, answered, ended))
    bare, stack, answered, ended = (statistics.median(column) for column in zip(*rows))
    print(f"yardsticks: bare interpreter {bare:.3f} s; importing hydra, omegaconf and numpy {stack:.3f} s")
    print(f"first run (composing the config and keeping it): table after {first[0]:.3f} s, whole command "
          f"{first[1]:.3f} s")
    print(f"megapipe plan ({'no pictures' if args.no_pictures else 'pictures included'}): table after "
          f"{answered:.3f} s = {answered / stack:.2f}x the import yardstick (goal 1.0 s: "
          f"{'met' if answered <= 1.0 else 'not met'}); whole command {ended:.3f} s = {ended / stack:.2f}x "
          f"(goal 1.5 s: {'met' if ended <= 1.5 else 'not met'}); medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
