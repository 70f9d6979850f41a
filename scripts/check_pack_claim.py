"""Check the write-ups' claim that packing jobs with per-job pipeline depth gives 15-25% higher cluster-wide
utilisation, on a few representative job mixes (``megapipe pack``'s exact packing, repacking as jobs finish).

For each mix it prints the packing's average utilisation (model FLOPs done over the cluster's peak x the
makespan) and its gain over each baseline measured in the same run: every job at one fixed pipeline depth
(the best single depth for the mix), each job alone at its best one after another, and an even split of
the nodes.

    python scripts/check_pack_claim.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megapipe.config import compose, to_scenario  # noqa: E402
from megapipe.config.jobs import jobs_of, pack_options  # noqa: E402
from megapipe.pack import pack_jobs  # noqa: E402


def _job(name, model, batch, seq, tokens, weight=1.0):
    return (f"{{name: {name}, model: {model}, global_batch_size: {batch}, seq_length: {seq}, tokens: {tokens}, "
            f"weight: {weight}}}")


MIXES = {
    "lab mix (jobs=lab_mix, 64 H100 nodes)": ["cluster.num_nodes=64"],
    "ablation sweep: ten 8B runs of different batch sizes, 32 H100 nodes": [
        "cluster.num_nodes=32",
        "jobs.jobs=[" + ",".join(_job(f"a{i}", "llama3_8b", batch, 4096, tokens)
                                 for i, (batch, tokens) in enumerate([(64, 5e9), (64, 1e10), (128, 1e10), (128, 2e10),
                                                                      (256, 2e10), (256, 4e10), (512, 4e10),
                                                                      (512, 8e10), (1024, 8e10), (1024, 1.6e11)]))
        + "]"],
    "one large and many small: 405B + 70B + four 8B, 128 H100 nodes": [
        "cluster.num_nodes=128",
        "jobs.jobs=[" + ",".join([_job("l405", "llama3_405b", 1024, 8192, 2e11, 2.0),
                                  _job("l70", "llama3_70b", 512, 8192, 2e11),
                                  *[_job(f"s{i}", "llama3_8b", 256, 4096, 4e10 * (i + 1)) for i in range(4)]]) + "]"],
    "mixed H100 + A100 cluster, lab-like mix": [
        "cluster=mixed_h100_a100",
        "jobs.jobs=[" + ",".join([_job("l70", "llama3_70b", 256, 8192, 5e10), _job("l8a", "llama3_8b", 256, 8192, 5e10),
                                  _job("l8b", "llama3_8b", 128, 4096, 1e10), _job("moe", "mixtral_8x7b", 256, 4096, 2e10)])
        + "]"],
}


def main() -> None:
    print("| mix | packed average utilisation | vs fixed depth | vs one after another | vs even split |")
    print("|---|---|---|---|---|")
    for label, overrides in MIXES.items():
        cfg = compose(overrides)
        cluster = to_scenario(cfg, search=True).cluster
        jobs = jobs_of(cfg, cluster)
        result = pack_jobs(jobs, cluster, pack_options(cfg, jobs))
        ours = result.packed.average_utilisation
        cells = []
        for name in ("fixed", "one after another", "even split"):
            policy = next((p for p in result.baselines if p.name.startswith(name)), None)
            if policy is None or policy.average_utilisation is None:
                cells.append("n/a")
            else:
                cells.append(f"{ours / policy.average_utilisation - 1:+.1%} ({policy.name}, "
                             f"{policy.average_utilisation:.1%})")
        print(f"| {label} | {ours:.1%} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
