"""Random bad input across every verb: counts tracebacks, hangs and multi-line errors (goal: none).

    python scripts/fuzz_cli.py --cases 1000 --seed 0

Each case is one verb with one to three bad overrides (a known key with a wrong value, an unknown
``+key``, or an unknown option), on top of a small valid model so that valid cases finish quickly.
Cases run in this process (``megapipe.cli.main``) with a 30 s alarm each.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _cli_fuzz import random_cases, run_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit-s", type=int, default=30)
    args = parser.parse_args()
    started = time.perf_counter()
    codes: collections.Counter = collections.Counter()
    problems = []
    slowest = (0.0, None)
    with tempfile.TemporaryDirectory() as directory:
        for index, case in enumerate(random_cases(args.cases, seed=args.seed)):
            began = time.perf_counter()
            outcome = run_case(case, directory=f"{directory}/{index}", limit_s=args.limit_s)
            took = time.perf_counter() - began
            slowest = max(slowest, (took, case), key=lambda item: item[0])
            codes[outcome.code] += 1
            if outcome.problem:
                problems.append(outcome)
    print(f"{args.cases} cases (seed {args.seed}) in {time.perf_counter() - started:.0f} s: exit codes "
          f"{dict(sorted(codes.items(), key=str))}; tracebacks, hangs or multi-line errors: {len(problems)}; "
          f"slowest case {slowest[0]:.1f} s ({' '.join(slowest[1].argv()) if slowest[1] else '-'})")
    for outcome in problems:
        print(f"  {outcome.problem}: megapipe {' '.join(outcome.case.argv())}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
