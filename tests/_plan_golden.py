"""Scenarios whose search output is kept in tests/golden/plan_*.json, and the JSON they are compared as."""

from __future__ import annotations

import json

from megapipe.config import to_scenario
from megapipe.config import compose
from megapipe.config.options import search_options
from megapipe.plan.document import json_summary
from megapipe.plan.search import search

SCENARIOS = {
    "default": ["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=8192", "train.global_batch_size=256"],
    "mixed": ["model=llama3_8b", "cluster=mixed_h100_a100", "train.seq_length=8192", "train.global_batch_size=64"],
    "ignore_memory": ["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=8192", "train.global_batch_size=256",
                      "search.ignore_memory_limit=true"],
    "bubble_target": ["model=llama3_8b", "cluster=h100_80gb", "cluster.num_nodes=2", "train.seq_length=4096",
                      "train.global_batch_size=64", "search.bubble_target=[0.05,0.2]"],
    "cost": ["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=32768", "train.global_batch_size=128",
             "search.objective=cost"],
    "per_stage": ["model=llama3_70b", "cluster=h100_80gb", "train.seq_length=8192", "train.global_batch_size=256",
                  "search.per_stage_recompute=true"],
    "what_if": ["model=llama3_70b", "cluster=h200_141gb", "cluster.num_nodes=8", "train.seq_length=32768",
                "train.global_batch_size=64", "search.what_if_schedules=true"],
    "writeup": ["+experiment=writeup_70b"],
}


def scenario_summary(name: str) -> dict:
    """The search's JSON summary without its wall-clock seconds."""
    cfg = compose(SCENARIOS[name])
    scenario = to_scenario(cfg, search=True)
    fixed = scenario.fixed
    result = search(model=scenario.model, cluster=scenario.cluster, train=scenario.train, fixed=fixed,
                    options=search_options(cfg), use_distributed_optimizer=scenario.parallel.use_distributed_optimizer)
    summary = json.loads(json.dumps(json_summary(result)))
    summary["search"].pop("seconds")
    return summary


def dump(summary: dict) -> str:
    return json.dumps(summary, indent=1, sort_keys=True) + "\n"
