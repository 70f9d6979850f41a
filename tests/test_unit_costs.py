"""What the search shares between runtime feature sets is what they share: a decoder's fixed parts read no feature
(but FP8's routing-map padding) and no recompute setting, a unit's bytes and parameters read only the bytes
features, and feature dominance settled once per layer key equals the pairwise definition at every size."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from megapipe.config import compose, to_scenario
from megapipe.config.options import search_options
from megapipe.cost.comm import p2p_link, tensor_parallel_link
from megapipe.cost.decoder import decoder_parts, fixed_parts, fixed_shapes
from megapipe.cost.layers import BYTES_FEATURES, _fixed_times, fixed_unit_times, unit_bytes
from megapipe.cost.memory import (
    decoder_activation_bytes,
    embedding_activation_bytes,
    mtp_activation_bytes,
    output_activation_bytes,
)
from megapipe.cost.params import decoder_params, expert_params, mtp_params, unit_static_bytes
from megapipe.cost.shapes import shapes_of
from megapipe.cost.timing import Device
from megapipe.features import GRAPHED_SCOPES
from megapipe.plan.dominance import surviving_points
from megapipe.plan.evaluator import Evaluator
from megapipe.plan.space import enumerate_candidates
from megapipe.records import LayerKind, ParallelSpec, Recompute, RuntimeFeatures

_FEATURE_SETS = (
    RuntimeFeatures(),
    RuntimeFeatures(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep",
                    overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True,
                    cuda_graph_impl="transformer_engine", cuda_graph_scope=GRAPHED_SCOPES),
    RuntimeFeatures(moe_token_dispatcher_type="allgather", moe_shared_expert_overlap=True, moe_permute_fusion=True,
                    moe_router_fusion=True, recompute_modules=("moe", "layernorm", "mla_up_proj")),
    RuntimeFeatures(moe_router_force_load_balancing=True, recompute_modules=("shared_experts", "moe_act"),
                    cuda_graph_impl="local", cuda_graph_scope=("full_iteration",)),
    RuntimeFeatures(fine_grained_activation_offloading=True, offload_modules=("core_attn", "attn_proj", "expert_fc1"),
                    moe_token_dispatcher_type="alltoall"),
)


def _scenario(*overrides):
    return to_scenario(compose(list(overrides)), search=True)


def _device(scenario, parallel, shapes):
    cluster = scenario.cluster
    tp, cp = parallel.tensor_model_parallel_size, parallel.context_parallel_size
    return Device(gpu=cluster.gpu, runtime=cluster.runtime,
                  tp_comm_overlap=parallel.tp_comm_overlap and shapes.sequence_parallel,
                  link=tensor_parallel_link(cluster=cluster, tensor_model_parallel_size=tp),
                  cp_link=p2p_link(cluster=cluster, span=tp * cp), cluster=cluster)


@pytest.mark.parametrize("overrides, parallel", [
    (("model=deepseek_v3", "cluster=h100_80gb", "cluster.num_nodes=16"),
     dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=8,
          data_parallel_size=8, expert_model_parallel_size=8, expert_tensor_parallel_size=2)),
    (("model=mixtral_8x7b", "cluster=h100_80gb", "cluster.num_nodes=4", "train.precision=fp8"),
     dict(tensor_model_parallel_size=2, sequence_parallel=True, tp_comm_overlap=True, pipeline_model_parallel_size=2,
          context_parallel_size=2, data_parallel_size=4, expert_model_parallel_size=4)),
])
def test_fixed_decoder_parts_read_no_feature_and_no_recompute(overrides, parallel):
    """The cached parts of a decoder's time, and the embedding's, output's and eh_proj's times, read through the key
    without features and recompute, equal those read with the candidate's own features and recompute setting."""
    scenario = _scenario(*overrides)
    padded = (dataclasses.replace(_FEATURE_SETS[0], moe_router_padding_for_quantization=True),)
    for features, recompute in itertools.product(_FEATURE_SETS + padded, Recompute):
        par = ParallelSpec(**parallel, features=features)
        train = dataclasses.replace(scenario.train, recompute_granularity=recompute)
        shapes = shapes_of(model=scenario.model, parallel=par, train=train)
        device = _device(scenario, par, shapes)
        for moe in (False, True):
            assert fixed_parts(fixed_shapes(shapes), device, moe) == decoder_parts(shapes, device, moe)
        kinds = (False, True)
        assert _fixed_times(fixed_shapes(shapes), device, kinds) == fixed_unit_times(shapes, device, kinds)


def _direct_bytes(model, parallel, train) -> dict:
    """Each unit's (params, expert params, static, activation bytes) read with the candidate's own features."""
    shapes = shapes_of(model=model, parallel=parallel, train=train)
    last_moe = bool(model.moe_layers[-1])

    def static(kind, params, experts=0.0):
        return unit_static_bytes(kind=kind, params=params, shapes=shapes, parallel=parallel, train=train,
                                 expert_params=experts)

    out = {}
    for key, moe in (("dense", False), ("moe", True)):
        params, experts = decoder_params(shapes, moe=moe), expert_params(shapes, moe=moe)
        out[key] = (params, experts, static(LayerKind.decoder, params, experts),
                    decoder_activation_bytes(shapes, moe=moe))
    params, experts = mtp_params(shapes, moe=last_moe), expert_params(shapes, moe=last_moe)
    out["mtp"] = (params, experts, static(LayerKind.mtp, params, experts), mtp_activation_bytes(shapes, moe=last_moe))
    out["embedding_act"] = embedding_activation_bytes(shapes)
    out["output_act"] = output_activation_bytes(shapes)
    return out


def test_unit_bytes_read_only_the_bytes_features():
    """Every RuntimeFeatures field but BYTES_FEATURES leaves every unit's parameters and bytes as they are: the
    memory model (cost/memory.py, cost/params.py) reads no other feature. A field the memory model comes to read
    belongs in BYTES_FEATURES."""
    scenario = _scenario("model=deepseek_v3", "cluster=h100_80gb", "cluster.num_nodes=16", "train.precision=fp8")
    base = dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=8,
                data_parallel_size=8, expert_model_parallel_size=8)
    for features in _FEATURE_SETS + (RuntimeFeatures(moe_router_padding_for_quantization=True),):
        for recompute in (Recompute.none, Recompute.selective):
            par = ParallelSpec(**base, features=features)
            train = dataclasses.replace(scenario.train, recompute_granularity=recompute)
            sized = unit_bytes(model=scenario.model, parallel=par, train=train)
            direct = _direct_bytes(scenario.model, par, train)
            for key in ("dense", "moe", "mtp"):
                unit = sized[key]
                assert (unit.param_count, unit.expert_param_count, unit.static_bytes, unit.act_bytes) == direct[key]
            assert sized["embedding"].act_bytes == direct["embedding_act"]
            assert sized["output"].act_bytes == direct["output_act"]
    assert set(BYTES_FEATURES) < {field.name for field in dataclasses.fields(RuntimeFeatures)}


def _pairwise_dominated(evaluator, space) -> set[int]:
    """The definition: within points equal but for their features, a point whose every unit another member runs no
    slower (forward, backward, weight gradient) with equal static and activation bytes, at its own PP and DP; of
    equal points the first stays."""
    groups: dict[tuple, list[int]] = {}
    for index, point in enumerate(space.points):
        groups.setdefault(point[:13], []).append(index)
    out = set()
    for members in groups.values():
        vectors = []
        for index in members:
            units, _ = evaluator.costs.runs(space.candidate(space.points[index]))
            vectors.append(tuple((u.fwd_ms, u.bwd_ms, u.wgrad_ms, u.static_bytes, u.act_bytes) for u in units))
        for position, mine in enumerate(vectors):
            for other, theirs in enumerate(vectors):
                if other == position or theirs == mine and other > position:
                    continue
                if all(t[0] <= m[0] and t[1] <= m[1] and t[2] <= m[2] and t[3] == m[3] and t[4] == m[4]
                       for t, m in zip(theirs, mine)):
                    out.add(members[position])
                    break
    return out


def test_dominance_settled_per_layer_key_equals_the_pairwise_definition():
    cfg = compose(["model=qwen3_30b_a3b", "cluster=h100_80gb", "cluster.num_nodes=2", "train.global_batch_size=256",
                   "search.max_virtual_pipeline_model_parallel_size=2"])
    scenario = to_scenario(cfg, search=True)
    options = search_options(cfg)
    space = enumerate_candidates(model=scenario.model, cluster=scenario.cluster, train=scenario.train,
                                 fixed=scenario.fixed, options=options)
    assert len({point.features for point in space.points}) > 1
    evaluator = Evaluator(model=scenario.model, cluster=scenario.cluster, options=options)
    found = set(range(len(space.points))) - set(surviving_points(evaluator.costs, space))
    assert found and found == _pairwise_dominated(evaluator, space)
