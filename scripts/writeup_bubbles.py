"""Which microbatch counts could produce the write-up's bubble table, and what megapipe simulates.

    python scripts/writeup_bubbles.py

For every entry of the table (schedule, stages, percent) it lists the m (and v)
whose closed form rounds to that percent, in the wall-time form (P-1)/(v*m+P-1)
and in Megatron's ideal-compute form (P-1)/(v*m), then the simulated bubbles at
one m for all schedules (equal stages, F = B = W).
"""

from __future__ import annotations

from megapipe.simulate.bubble import WRITEUP_PERCENT, bubble_rows, matching_microbatches


def _fmt(values: tuple[int, ...]) -> str:
    if not values:
        return "none"
    return ", ".join(map(str, values[:4])) + (" ..." if len(values) > 4 else "")


def main() -> None:
    print("| schedule | stages | write-up | v | m, wall (P-1)/(vm+P-1) | m, ideal (P-1)/(vm) |")
    print("|---|---|---|---|---|---|")
    for name, by_stages in WRITEUP_PERCENT.items():
        for stages, percent in by_stages.items():
            for v in ((2, 4) if name == "interleaved_1f1b" else (1,)):
                wall = matching_microbatches(percent, schedule=name, pipeline_model_parallel_size=stages,
                                             virtual_pipeline_model_parallel_size=v, max_microbatches=1024)
                ideal = matching_microbatches(percent, schedule=name, pipeline_model_parallel_size=stages,
                                              virtual_pipeline_model_parallel_size=v, max_microbatches=1024,
                                              ideal=True)
                print(f"| {name} | {stages} | {percent}% | {v} | {_fmt(wall)} | {_fmt(ideal)} |")
    for stages, m in ((8, 48), (32, 128)):
        print(f"\nSimulated, P={stages}, m={m}, interleaved v=2, equal stages, F=B=W:\n")
        print("| schedule | v | closed form | simulated (flushed) | simulated (steady) | peak in flight | write-up |")
        print("|---|---|---|---|---|---|---|")
        for row in bubble_rows(pipeline_model_parallel_size=stages, num_microbatches=m):
            if row.error:
                print(f"| {row.schedule} | {row.virtual_pipeline_model_parallel_size} | cannot run: {row.error} |")
                continue
            closed = "-" if row.closed_form is None else f"{100 * row.closed_form:.2f}%"
            writeup = "-" if row.writeup_percent is None else f"{row.writeup_percent}%"
            print(f"| {row.schedule} | {row.virtual_pipeline_model_parallel_size} | {closed} | "
                  f"{100 * row.simulated:.2f}% | {100 * row.simulated_steady:.2f}% | "
                  f"{row.peak_in_flight} | {writeup} |")


if __name__ == "__main__":
    main()
