"""Ranking sanity: megapipe's best plan against configurations experts tuned, by megapipe's own prediction.

    python scripts/check_ranking.py            # about a minute on 2 cores; prints a Markdown table

For every run of the public data set from NeMo's and Megatron-LM's published performance tables
(their settings are what NVIDIA tuned for those models and GPU counts), megapipe plans the same
model, GPU count, global batch, sequence and precision with every parallel setting free, and the
table compares its best plan's predicted throughput with the tuned configuration's, both predicted
by megapipe (the tuned one as it ran: Megatron's equal split). A best plan far faster than an
expert's choice says the model favours something real runs do not gain from; those rows are
explained in docs/validation.md and are predictions to test on hardware.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megapipe.config import compose, to_scenario  # noqa: E402
from megapipe.errors import MegapipeError  # noqa: E402
from megapipe.validation.runs import read_runs  # noqa: E402
from megapipe.options import SearchOptions  # noqa: E402
from megapipe.plan.search import search  # noqa: E402
from megapipe.validation.predict import predict, resolve, run_cluster  # noqa: E402

TUNED_SETS = ("megatron_lm_readme_h100", "nemo_24_07_fp8_h100", "nemo_25_04_fp8_gb200")


def _shape(parallel, train, schedule: str) -> str:
    return (f"{parallel.tensor_model_parallel_size}/{parallel.pipeline_model_parallel_size}/"
            f"{parallel.data_parallel_size}/{parallel.context_parallel_size}/"
            f"{parallel.virtual_pipeline_model_parallel_size} mbs {train.micro_batch_size} {train.recompute_granularity.value}"
            + (" (what-if)" if schedule not in ("1f1b", "interleaved_1f1b") else ""))


def _outside(resolved, gain: float | None) -> str:
    """Why the search cannot hold the tuned configuration, where its best plan is slower than it."""
    if gain is None or gain >= -0.005:
        return ""
    if not resolved.fits:
        return "its memory model puts the tuned run over usable memory, so the search leaves it out"
    floor = SearchOptions().context_parallel_min_seq_length
    if resolved.parallel.context_parallel_size > 1 and resolved.train.seq_length < floor:
        return (f"CP={resolved.parallel.context_parallel_size} at seq {resolved.train.seq_length:,}: the search tries CP "
                f"from search.context_parallel_min_seq_length={floor:,} tokens up")
    return "not explained: the search should contain it"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    started = time.perf_counter()
    runtime = to_scenario(compose([])).cluster.runtime
    bases: dict[str, object] = {}
    rows = []
    for run in read_runs():
        if run.set not in TUNED_SETS:
            continue
        if run.cluster not in bases:
            bases[run.cluster] = to_scenario(compose([f"cluster={run.cluster}", "parallel.tensor_model_parallel_size=1",
                                                      "parallel.pipeline_model_parallel_size=1"])).cluster
        base = bases[run.cluster]
        resolved = resolve(run, base)
        cluster = run_cluster(run, base, runtime)
        tuned = predict(resolved, cluster)
        try:
            result = search(model=run.model, cluster=cluster, train=resolved.train, fixed={},
                            options=SearchOptions(top_k=1), use_distributed_optimizer=True,
                            template=resolved.parallel)
            best = result.best
            gain = best.tokens_per_s / tuned.tokens_per_s - 1
            best_text = _shape(best.parallel, best.train, str(best.schedule))
        except MegapipeError as exc:
            best, gain, best_text = None, None, f"no plan: {exc}"
        rows.append((run, resolved, tuned, best, gain, best_text))
    print("| run | tuned TP/PP/DP/CP/VP | fits megapipe's memory | tuned tok/s/GPU | megapipe's best | "
          "best tok/s/GPU | best over tuned | why the tuned run is outside the search |")
    print("|---|---|---|---|---|---|---|---|")
    for run, resolved, tuned, best, gain, best_text in rows:
        gain_text = "" if gain is None else f"{gain:+.1%}"
        best_tps = "" if best is None else f"{best.tokens_per_s_per_gpu:,.0f}"
        print(f"| {run.id} | {_shape(resolved.parallel, resolved.train, 'interleaved_1f1b')} | "
              f"{'yes' if resolved.fits else f'no (+{resolved.memory_over_gib:.1f} GiB)'} | "
              f"{tuned.tokens_per_s_per_gpu:,.0f} | {best_text} | {best_tps} | {gain_text} | {_outside(resolved, gain)} |")
    misses = sum(1 for _, resolved, *_ in rows if not resolved.fits)
    gains = [gain for *_, gain, _ in rows if gain is not None]
    within = sum(1 for gain in gains if gain <= 0.10)
    slower = sum(1 for *_, gain, _ in rows if gain is not None and gain < -0.005)
    print(f"\n{len(rows)} tuned runs, {misses} of them over megapipe's memory model; best plan at most 10% faster than "
          f"the tuned one on {within}; slower by more than 0.5% on {slower} (the planner searches every VP Megatron "
          f"allows, and only what fits its memory model); median {sorted(gains)[len(gains) // 2]:+.1%}, max "
          f"{max(gains):+.1%}, min {min(gains):+.1%}; {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
