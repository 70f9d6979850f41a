"""``megapipe plan`` on defaults as a user runs it: when the ranked table appears and when the command ends,
against yardsticks measured in the same run.

Each round runs the console script in a fresh process (piped, as a script or CI sees it) and times, on the wall
clock, the first line of the answer (the table's title: the search is done) and the process's exit (files and
pictures written). Yardsticks, in the same rounds: a bare interpreter (``python -c pass``) and one that imports
what any Hydra + numpy command pays (hydra, omegaconf, numpy). Goals (the speed budget): the table within 1.0 s,
the whole command within 1.5 s.

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

_MEGAPIPE = os.path.join(os.path.dirname(sys.executable), "megapipe")


def _plan(pictures: bool) -> tuple[float, float]:
    """(seconds until the first line of the answer, seconds until exit) of one fresh ``megapipe plan``."""
    with tempfile.TemporaryDirectory() as directory:
        args = [_MEGAPIPE, "plan", f"output.dir={directory}", f"output.pictures={'true' if pictures else 'false'}"]
        start = time.perf_counter()
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "COLUMNS": "200"}) as process:
            process.stdout.readline()
            answered = time.perf_counter() - start
            process.stdout.read()
            if process.wait() != 0:
                raise SystemExit(f"megapipe plan exited {process.returncode}")
        return answered, time.perf_counter() - start


def _python(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-pictures", action="store_true")
    args = parser.parse_args()
    rows = []
    for _ in range(args.rounds):  # interleaved, so load drifts reach every figure alike
        bare = _python("pass")
        stack = _python("import hydra, omegaconf, numpy")
        answered, ended = _plan(not args.no_pictures)
        rows.append((bare, stack, answered, ended))
    bare, stack, answered, ended = (statistics.median(column) for column in zip(*rows))
    print(f"yardsticks: bare interpreter {bare:.3f} s; importing hydra, omegaconf and numpy {stack:.3f} s")
    print(f"megapipe plan ({'no pictures' if args.no_pictures else 'pictures included'}): table after "
          f"{answered:.3f} s = {answered / stack:.2f}x the import yardstick (goal 1.0 s: "
          f"{'met' if answered <= 1.0 else 'not met'}); whole command {ended:.3f} s = {ended / stack:.2f}x "
          f"(goal 1.5 s: {'met' if ended <= 1.5 else 'not met'}); medians of {args.rounds} rounds")


if __name__ == "__main__":
    main()
