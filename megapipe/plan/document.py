"""The ``megapipe-plan/1`` document: a search result, its inputs and the assumed topology.

Pure: records in, plain dicts out. The same inputs give the same dict (no timestamps or
durations), so ``plan.yaml`` is byte-identical across runs; the search's seconds appear
only in the JSON printed on stdout.
"""

from __future__ import annotations

from dataclasses import asdict

from megapipe.features import MOE_SETTINGS
from megapipe.plan.plans import SearchResult
from megapipe.records import ClusterSpec, LinkSpec, ModelSpec

__all__ = ["FORMAT", "plan_document", "json_summary"]

FORMAT = "megapipe-plan/1"


def _link(link: LinkSpec) -> dict:
    return {"kind": link.kind, "bandwidth_gbytes_per_s": float(link.bandwidth_gbytes_per_s),
            "latency_us": float(link.latency_us)}


def _model(model: ModelSpec) -> dict:
    """The model record without the fields that do not apply to it (a dense model's MoE fields, MLA's without MLA):
    read back, their defaults are what they leave out."""
    out = {key: value for key, value in asdict(model).items() if key not in model.unused_fields}
    out["activation"] = model.activation.value
    out["attention_backend"] = model.attention_backend.value
    return out


def _inputs(inputs: dict, model: ModelSpec) -> dict:
    """The resolved config without what does not apply to the model: its model group as :func:`_model` leaves it,
    and, for a dense model, the parallel and train groups without the MoE settings (:data:`MOE_SETTINGS`)."""
    unused = {"model": set(model.unused_fields), "parallel": set(), "train": set()}
    if not model.is_moe:
        unused["parallel"] = unused["train"] = set(MOE_SETTINGS)
    return {name: {key: value for key, value in group.items() if key not in unused[name]}
            if name in unused and isinstance(group, dict) else group for name, group in inputs.items()}


def _cluster(cluster: ClusterSpec) -> dict:
    return {
        "name": cluster.name,
        "num_nodes": cluster.num_nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "num_gpus": cluster.num_gpus,
        "price_per_gpu_hour": float(cluster.price_per_gpu_hour),
        "node_groups": [{"gpu": asdict(group.gpu), "num_nodes": group.num_nodes} for group in cluster.node_groups],
    }


def _stats(result: SearchResult) -> dict:
    stats = result.stats.to_dict()
    stats.pop("seconds")
    return stats


def plan_document(*, result: SearchResult, model: ModelSpec, cluster: ClusterSpec, inputs: dict,
                  emitted: dict | None = None, extra: dict | None = None) -> dict:
    """Everything a run needs to reproduce and check the plan; ``inputs`` is the resolved config.

    ``best`` is the plan to run (the best one megatron-core runs); ``emitted`` is None for a what-if
    plan. ``extra``: where the sequence length came from and, on a mixed cluster, each node rank's GPU.
    """
    doc = {
        "format": FORMAT,
        "model": _model(model),
        "cluster": _cluster(cluster),
        "topology": {
            "intra_node": _link(cluster.intra_node),
            "inter_node": _link(cluster.inter_node),
            "gpus_per_node": cluster.gpus_per_node,
            "rank_order": "tp-cp-dp-pp",
        },
        **_plans(result, moe=model.is_moe),
        "search": _stats(result),
        "inputs": _inputs(inputs, model),
    }
    if result.hetero_gain is not None:
        doc["hetero_gain_over_equal_split"] = float(f"{result.hetero_gain:.12g}")
    doc.update(extra or {})
    doc["emitted"] = emitted
    return doc


def _plans(result: SearchResult, *, moe: bool) -> dict:
    return {
        "best": result.best.to_dict(moe=moe),
        "plans": [plan.to_dict(moe=moe) for plan in result.plans],
        "baseline": result.baseline.to_dict(moe=moe) if result.baseline else None,
        "reference": result.reference.to_dict(moe=moe) if result.reference else None,
    }


def json_summary(result: SearchResult, *, moe: bool = False) -> dict:
    """The one JSON object of ``output.format=json``: plans best first, baseline, search stats."""
    return {
        **_plans(result, moe=moe),
        "hetero_gain": result.hetero_gain,
        "search": result.stats.to_dict(),
    }
