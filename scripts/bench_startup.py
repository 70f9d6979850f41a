"""End-to-end cost of ``megapipe plan`` on defaults against the search's own time in the same run.

Each round runs the CLI as a user does (a fresh interpreter, ``output.format=json``) and reads,
from that same run, the search's own seconds (``search.seconds`` of its JSON). It prints:

- answer: wall seconds from start until the ranked answer is printed, over the search's seconds;
- CPU: the process's user + system CPU seconds until it exits, over the search's seconds;

once without pictures and once with them (the pictures are drawn after the answer).
Goal: answer at most 3x the search.

    python scripts/bench_startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def _one(pictures: bool) -> tuple[float, float, float]:
    """(search s, answer wall s, process CPU s) of one fresh ``megapipe plan`` run."""
    with tempfile.TemporaryDirectory() as directory:
        args = [sys.executable, "-m", "megapipe.cli", "plan", "output.format=json", f"output.dir={directory}",
                f"output.pictures={'true' if pictures else 'false'}"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "COLUMNS": "200"}) as process:
            line = process.stdout.readline()
            answered = time.perf_counter() - start
            process.stdout.read()
            if process.wait() != 0:
                raise SystemExit(f"megapipe plan exited {process.returncode}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(json.loads(line)["search"]["seconds"]), answered, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for pictures in (False, True):
        rows = [_one(pictures) for _ in range(args.rounds)]
        search = statistics.median(r[0] for r in rows)
        answer = statistics.median(r[1] for r in rows)
        cpu = statistics.median(r[2] for r in rows)
        label = "with pictures" if pictures else "without pictures"
        print(f"{label}: search {search:.3f} s; answer after {answer:.3f} s wall = "
              f"{answer / search:.2f}x the search; process CPU {cpu:.3f} s = {cpu / search:.2f}x "
              f"(median of {args.rounds}; per round answer/search "
              f"{', '.join(f'{r[1] / r[0]:.2f}' for r in rows)})")


if __name__ == "__main__":
    main()
