"""A MoE layer's MLP from its parts: router, token counts, permute, dispatch and combine, experts, overlaps.

Per microbatch on one GPU (megatron-core ``MoELayer`` with its token dispatcher; each part's source is in
docs/cost_model.md):

- **router**: the ``h -> E`` GEMM (in :func:`megapipe.cost.flops.mlp_gemms`), then the score function, top-k,
  group-limited routing and the auxiliary loss as memory-bound kernels over ``tokens x E`` fp32 scores:
  :data:`ROUTER_KERNELS` launches unfused, :data:`FUSED_ROUTER_KERNELS` with ``moe_router_fusion``
  (Transformer Engine PR 1883; the DeepSeek-V3 GB200 write-up counts 72 and 31);
- **token counts**: the per-expert counts all-gathered over TP x EP, copied to the host with a sync before
  the all-to-all (``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize``); DeepEP and HybridEP wait on
  the host inside their dispatch;
- **permute / unpermute** as memory traffic: the fused kernels (``moe_permute_fusion``, TE's Triton
  permutation) read each token once and write its ``k`` copies, and read ``k`` copies and write one; the
  unfused path transposes the routing map and sorts ``E x tokens`` keys, gathers, and unpermutes in fp32
  through a scatter-add (``moe_utils.permute``/``unpermute``); DeepEP and HybridEP fuse the global permute
  into their dispatch;
- **dispatch and combine** (:func:`dispatch_ms`): NCCL's all-to-all sends every token-expert copy; DeepEP
  and HybridEP send one copy per destination GPU inside the NVLink domain and one per destination domain
  across it (then forward over NVLink), and group-limited routing bounds the domains a token reaches;
- **experts**: the grouped GEMMs on the busiest rank (:func:`megapipe.cost.kernels.grouped_gemm_ms`) with
  FP8's per-expert padding, and the activation;
- **overlaps**: ``moe_shared_expert_overlap`` runs the shared experts under the dispatch;
  ``overlap_moe_expert_parallel_comm`` (combined 1F1B) pairs one microbatch's forward with another's
  backward so that each all-to-all runs under the other's compute (:func:`overlapped_ms`), the
  dispatcher's SMs taken from that compute.

Pure: shapes and the device in, times out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.cost.comm import Collective, collective_ms, domain_members, group_link
from megapipe.cost.kernels import memory_ms
from megapipe.cost.shapes import Shapes
from megapipe.cost.timing import Device, Timing, part

__all__ = [
    "ROUTER_KERNELS",
    "FUSED_ROUTER_KERNELS",
    "DISPATCHER_SMS",
    "MoeParts",
    "moe_parts",
    "MOE_PARTS_FEATURES",
    "expected_reach",
    "dispatch_ms",
    "overlapped_ms",
    "padding_rows",
    "moe_timing",
    "combined_1f1b_saved_ms",
]

ROUTER_KERNELS = 72
"""Router kernels per MoE layer forward without fusion (score, top-k, group-limited top-k, expert bias,
aux loss): the DeepSeek-V3 GB200 write-up, sec. 2.1.4."""
FUSED_ROUTER_KERNELS = 31
"""The same with ``moe_router_fusion`` (Transformer Engine PR 1883)."""
_PREPROCESS_KERNELS = 8
"""Token counts per expert and rank, the split sizes, their all-gather: ``MoEAlltoAllTokenDispatcher.preprocess``."""
_UNFUSED_SORT_PASSES = 4
"""Passes over the ``E x tokens`` int64 keys of the unfused permute's stable argsort (radix sort, 8-bit digits)."""
DISPATCHER_SMS = {"alltoall": 16, "allgather": 16, "deepep": 20, "hybridep": 16}
"""SMs a dispatcher's kernels occupy while they run under compute: DeepEP's default ``num_sms`` (20,
``deep_ep/buffers/legacy.py``), megatron-core's ``moe_hybridep_num_sms`` (16); NCCL's all-to-all
channels (16, an assumption)."""
_FP8_ALIGN = {"mxfp8": 32}
"""Rows each expert's FP8 segment is padded to (``get_align_size_for_quantization``): 32 for MXFP8, 16 else."""
KERNEL_NVLINK_GBYTES_PER_S = {"deepep": (494.0, 420.0), "hybridep": (550.0, 538.0)}
"""(dispatch, combine) NVLink throughput, GB/s per GPU, that DeepEP's and HybridEP's own kernels reach through
their PyTorch API with their SM budgets, BF16, 4,096 tokens of hidden 7,168, top-8: DeepEP on 8 B200 with 24 SMs,
HybridEP on 8 GB200 with 16 SMs (deepseek-ai/DeepEP branch hybrid-ep 94a9f8f6, docs/README_Hybrid-EP.md). Below an
NVLink 5 link's 900 GB/s, so on Blackwell the kernels, not the link, set the rate; on H100's NVLink 4 the link does."""


def padding_rows(shapes: Shapes) -> float:
    """Rows the FP8 grouped GEMM pads each local expert's segment by (half an alignment on average); 0 in BF16.

    Without ``moe_router_padding_for_quantization`` TEGroupedMLP pads the received rows of each expert; with it
    the router pads every source rank's map, so the padding slots travel through the all-to-all as real
    copies, ``EP`` times as many (moe_utils ``pad_routing_map``)."""
    if shapes.gemm_dtype != "fp8":
        return 0.0
    half = (_FP8_ALIGN.get(shapes.fp8_recipe, 16) - 1) / 2
    if shapes.features.moe_router_padding_for_quantization:
        return half * shapes.expert_model_parallel_size
    return half


def expected_reach(*, bins: int, experts: int, topk: int, groups: int = 0, group_topk: int = 0) -> float:
    """Expected number of ``bins`` (EP ranks, or NVLink domains) a token's top-k experts fall into.

    ``experts`` are spread evenly over the bins in order. Routing is taken as uniform: top-k distinct experts
    of all, or with group-limited routing (DeepSeek-V3: ``groups`` expert groups of which the token picks
    ``group_topk``) top-k of the chosen groups' experts. A bin is reached unless none of the token's experts
    lies in it: hypergeometric ``1 - C(P - b, k) / C(P, k)`` for a pool of ``P`` experts of which ``b`` are in
    the bin."""
    if bins <= 1:
        return 1.0
    per_bin = experts / bins
    if not (groups and group_topk) or group_topk >= groups:
        return bins * (1.0 - _none_chosen(experts, per_bin, topk))
    per_group = experts / groups
    if groups >= bins:  # whole groups per bin: the bin is reached when one of its groups is chosen
        groups_per_bin = groups / bins
        return bins * (1.0 - _none_chosen(groups, groups_per_bin, group_topk))
    # several bins per group: the token's k experts fall in its chosen groups' bins
    pool = group_topk * per_group
    reached_groups = group_topk
    bins_per_group = bins / groups
    return reached_groups * bins_per_group * (1.0 - _none_chosen(pool, per_bin, topk))


def _none_chosen(pool: float, marked: float, draws: float) -> float:
    """P(no marked item among ``draws`` drawn without replacement from ``pool`` holding ``marked``)."""
    if draws >= pool:
        return 0.0
    return math.exp(math.lgamma(pool - marked + 1) - math.lgamma(pool - marked - draws + 1)
                    - math.lgamma(pool + 1) + math.lgamma(pool - draws + 1))


@dataclass(frozen=True, slots=True, kw_only=True)
class Dispatch:
    """One direction of the token movement, forward pass: dispatch then combine, ms; their backward mirrors."""

    dispatch_ms: float
    combine_ms: float
    tp_ms: float = 0.0
    """The expert-TP all-gather and reduce-scatter (alltoall dispatcher with ETP > 1)."""


def _bytes_per_ms(link, scale: float) -> float:
    return link.bandwidth_gbytes_per_s * 1e9 * link.bandwidth_efficiency * scale * 1e-3


def dispatch_ms(shapes: Shapes, device: Device) -> Dispatch:
    """Forward dispatch and combine of one MoE layer's tokens, by dispatcher; the backward repeats both."""
    cluster, scale = device.cluster, device.runtime.comm_efficiency_scale
    e, h = shapes.element_bytes, shapes.hidden_size
    ep, etp = shapes.expert_model_parallel_size, shapes.expert_tensor_parallel_size
    tokens, topk, imbalance = shapes.norm_tokens, shapes.topk, shapes.moe_load_imbalance
    if shapes.dispatcher == "allgather":
        group = ep * etp
        size = e * h * tokens * group
        link = group_link(cluster=cluster, span=group)
        one = math.fsum(collective_ms(kind=kind, num_bytes=size, group_size=group, link=link, efficiency_scale=scale)
                        for kind in (Collective.all_gather, Collective.reduce_scatter))
        return Dispatch(dispatch_ms=one / 2, combine_ms=one / 2)
    tp = 0.0
    if etp > 1:
        gathered = e * h * shapes.expert_tokens * imbalance
        link = group_link(cluster=cluster, span=etp)
        tp = math.fsum(collective_ms(kind=kind, num_bytes=gathered, group_size=etp, link=link, efficiency_scale=scale)
                       for kind in (Collective.all_gather, Collective.reduce_scatter))
    if ep <= 1:
        return Dispatch(dispatch_ms=0.0, combine_ms=0.0, tp_ms=tp)
    local = domain_members(cluster=cluster, group_size=ep, stride=etp)
    domains = ep / local
    padded = topk + padding_rows(shapes) * shapes.local_experts * ep / max(tokens, 1.0) \
        if shapes.features.moe_router_padding_for_quantization else topk
    intra_link, inter_link = cluster.intra_node, cluster.inter_node
    if shapes.dispatcher == "alltoall":
        # every copy to a GPU other than itself: the share inside the domain at NVLink, the rest over the NICs
        per_peer = e * h * tokens * padded * imbalance / ep
        intra = (local - 1) * per_peer / _bytes_per_ms(intra_link, scale)
        inter = (ep - local) * per_peer / _bytes_per_ms(inter_link, scale) if domains > 1 else 0.0
        latency = (inter_link if domains > 1 else intra_link).latency_us * 1e-3
        one = max(intra, inter) + latency
        return Dispatch(dispatch_ms=one, combine_ms=one, tp_ms=tp)
    # DeepEP / HybridEP: one copy per destination GPU in the domain, one per destination domain across it
    ranks = expected_reach(bins=ep, experts=shapes.num_experts, topk=topk, groups=shapes.moe_router_num_groups,
                           group_topk=shapes.moe_router_group_topk)
    reached = expected_reach(bins=max(1, round(domains)), experts=shapes.num_experts, topk=topk,
                             groups=shapes.moe_router_num_groups, group_topk=shapes.moe_router_group_topk)
    remote_domains = max(0.0, reached - 1.0 / max(domains, 1.0) * reached) if domains > 1 else 0.0
    token = e * h * tokens * imbalance
    link = _bytes_per_ms(intra_link, scale)
    network = token * remote_domains / _bytes_per_ms(inter_link, scale) if domains > 1 else 0.0
    latency = (inter_link if domains > 1 else intra_link).latency_us * 1e-3
    forwarded = token * ranks * (1.0 - 1.0 / min(ep, local))  # copies leaving this GPU over NVLink
    one_way = []
    for kernel in KERNEL_NVLINK_GBYTES_PER_S[shapes.dispatcher]:
        rate = min(link, kernel * 1e9 * scale * 1e-3)
        one_way.append(max(forwarded / rate, network) + latency)
    return Dispatch(dispatch_ms=one_way[0], combine_ms=one_way[1], tp_ms=tp)


@dataclass(frozen=True, slots=True, kw_only=True)
class MoeParts:
    """A MoE layer's non-GEMM parts, forward and backward ms (the backward of each is given apart)."""

    router_fwd_ms: float
    router_bwd_ms: float
    permute_fwd_ms: float
    permute_bwd_ms: float
    comm: Dispatch
    preprocess_ms: float
    """Token-count all-gather over TP x EP (forward only)."""


def _router_kernels(shapes: Shapes) -> int:
    return FUSED_ROUTER_KERNELS if shapes.features.moe_router_fusion else ROUTER_KERNELS


MOE_PARTS_FEATURES = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_router_fusion",
                      "moe_permute_fusion", "moe_router_padding_for_quantization")
"""The runtime features :func:`moe_parts` reads (tests/test_cost.py checks it reads no other): feature sets that agree
on these share its parts."""


def moe_parts(shapes: Shapes, device: Device) -> MoeParts:
    """The router's gating kernels, the counts' all-gather, permute and unpermute, dispatch and combine."""
    gpu = device.gpu
    e, h, k = shapes.element_bytes, shapes.hidden_size, shapes.topk
    tokens, experts = shapes.norm_tokens, shapes.num_experts
    scores = 4.0 * experts * tokens
    kernels = _router_kernels(shapes)
    # each gating kernel reads and writes about one fp32 tokens x E tensor; unfused, each of the many does
    router_passes = 6 if shapes.features.moe_router_fusion else 12
    router_fwd = memory_ms(num_bytes=router_passes * scores, gpu=gpu, kernels=kernels)
    router_bwd = memory_ms(num_bytes=router_passes * scores, gpu=gpu, kernels=kernels)
    fused_dispatch = shapes.dispatcher in ("deepep", "hybridep")
    copies = tokens * k
    if shapes.features.moe_permute_fusion:
        permute = (tokens + copies) * e * h  # read once, write k copies (TE's Triton permute)
        unpermute = (copies + tokens) * e * h + copies * 4  # read k copies and their probabilities, write one
        permute_kernels, unpermute_kernels = 4, 1
        sort = 0.0
    else:
        permute = 2 * copies * e * h + 2 * 8 * copies  # gather: read + write k copies, the index
        unpermute = 3 * copies * 4 * h + 3 * tokens * 4 * h  # weighted in fp32, zeros, scatter-add, cast
        sort = (_UNFUSED_SORT_PASSES * 2 * 8 + 1 + 1) * experts * tokens  # argsort keys, transposed map
        permute_kernels, unpermute_kernels = 6 + _UNFUSED_SORT_PASSES, 5
    if fused_dispatch:  # the global permute happens inside the dispatch kernel
        permute, sort, permute_kernels = tokens * e * h, 0.0, 2
    local_sort = 0.0
    if shapes.dispatcher == "alltoall" and shapes.local_experts > 1:
        local_sort = 2 * 2 * e * h * shapes.expert_tokens * shapes.moe_load_imbalance  # sort by expert, and back
    permute_fwd = (memory_ms(num_bytes=permute + sort + local_sort / 2, gpu=gpu, kernels=permute_kernels)
                   + memory_ms(num_bytes=unpermute + local_sort / 2, gpu=gpu, kernels=unpermute_kernels))
    counts = 4.0 * experts * shapes.tensor_model_parallel_size * shapes.expert_model_parallel_size
    group = shapes.tensor_model_parallel_size * shapes.expert_model_parallel_size
    preprocess = collective_ms(kind=Collective.all_gather, num_bytes=counts, group_size=group,
                               link=group_link(cluster=device.cluster, span=group),
                               efficiency_scale=device.runtime.comm_efficiency_scale) if group > 1 else 0.0
    preprocess += memory_ms(num_bytes=scores, gpu=gpu, kernels=_PREPROCESS_KERNELS)
    return MoeParts(router_fwd_ms=router_fwd, router_bwd_ms=router_bwd, permute_fwd_ms=permute_fwd,
                    permute_bwd_ms=permute_fwd, comm=dispatch_ms(shapes, device), preprocess_ms=preprocess)


def combined_1f1b_saved_ms(*, attention_f: float, attention_b: float, mlp_f: float, mlp_b: float, mlp_wgrad: float,
                           dispatch: float, combine: float, delay_wgrad: bool, comm_sms: int,
                           num_sms: int) -> tuple[float, float]:
    """(forward, backward) ms megatron-core's combined 1F1B hides for one MoE layer's pair of microbatches.

    The layer's forward of microbatch i+1 and backward of microbatch i run as two streams (megatron-core
    ``TransformerLayerSchedulePlan.run``): compute attention_f, the experts' backward (dgrad, then wgrad), the
    experts' forward, attention_b; communication combine_b, dispatch_f, dispatch_b, combine_f. Each op waits for
    the one before it on its stream and for what it consumes: the experts' backward for combine_b, dispatch_f for
    attention_f, the experts' forward for dispatch_f, combine_f for the experts' forward, attention_b for
    dispatch_b, and dispatch_b for the experts' dgrad (``delay_wgrad_compute``) or their whole backward. The pair
    takes the two-stream list schedule's makespan; what it saves against running the ops one after another is
    split between the directions as their all-to-alls are, less the compute slowed by the SMs the
    communication kernels hold while they overlap."""
    dgrad = mlp_b - mlp_wgrad
    compute = {"attention_f": attention_f, "dgrad": dgrad, "wgrad": mlp_wgrad, "mlp_f": mlp_f, "attention_b": attention_b}
    comm = {"combine_b": combine, "dispatch_f": dispatch, "dispatch_b": dispatch, "combine_f": combine}
    needs = {"dgrad": "combine_b", "dispatch_f": "attention_f", "mlp_f": "dispatch_f", "combine_f": "mlp_f",
             "attention_b": "dispatch_b", "dispatch_b": "dgrad" if delay_wgrad else "wgrad"}
    done: dict[str, float] = {}
    clock = {"compute": 0.0, "comm": 0.0}
    queues = {"compute": list(compute), "comm": list(comm)}
    durations = {**compute, **comm}
    while queues["compute"] or queues["comm"]:
        progressed = False
        for stream in ("compute", "comm"):
            if not queues[stream]:
                continue
            name = queues[stream][0]
            need = needs.get(name)
            if need is not None and need not in done:
                continue
            start = max(clock[stream], done.get(need, 0.0))
            done[name] = clock[stream] = start + durations[name]
            queues[stream].pop(0)
            progressed = True
        if not progressed:  # a dependency cycle cannot happen with these orders
            raise AssertionError(f"combined 1F1B schedule stuck at {queues}")
    serial = math.fsum(durations.values())
    hidden = max(0.0, serial - max(done.values()))
    slow = num_sms / (num_sms - comm_sms) - 1.0 if num_sms > comm_sms > 0 else 0.0
    saved = max(0.0, hidden - hidden * slow)
    return saved / 2, saved / 2  # both directions move the same bytes


def overlapped_ms(*, comm_ms: tuple[float, ...], compute_ms: tuple[float, ...], comm_sms: int, num_sms: int) -> float:
    """Time hidden when each communication runs under the paired compute on another stream.

    Each pair takes ``max(comm, compute')`` instead of their sum, where the compute slows by the SMs the
    communication kernels hold while they overlap (``compute' = compute x SMs / (SMs - comm_sms)`` over the
    overlapped span). Returns the milliseconds saved against running them one after another."""
    saved = 0.0
    slow = num_sms / (num_sms - comm_sms) if num_sms > comm_sms > 0 else 1.0
    for comm, compute in zip(comm_ms, compute_ms):
        hidden = min(comm, compute)
        saved += hidden - hidden * (slow - 1.0)
    return max(0.0, saved)


def _split(timings, prefix: str) -> tuple[float, float, float]:
    """(forward, backward, weight-gradient) ms of the timings whose name starts with ``prefix``."""
    chosen = [timing for name, timing in timings.items() if name.startswith(prefix)]
    return (math.fsum(t.fwd_ms for t in chosen), math.fsum(t.bwd_ms for t in chosen),
            math.fsum(t.wgrad_ms for t in chosen))


def moe_timing(shapes: Shapes, device: Device, *, attention: Timing, mlp: dict[str, Timing],
               parts: MoeParts | None = None) -> Timing:
    """A MoE layer's router gating, token counts, permute and its exposed dispatch and combine.

    ``attention`` and ``mlp`` (by GEMM name, :func:`megapipe.cost.flops.mlp_gemms`) are the layer's timed
    parts, which the overlaps hide the all-to-alls under: the shared experts under the dispatch and combine
    (``moe_shared_expert_overlap``), or with EP overlap the four pairs of megatron-core's combined 1F1B
    (``combined_1f1b.py``, ``fine_grained_callables.py``): the backward combine under the next microbatch's
    attention, its dispatch under the backward of the experts, the backward dispatch under the forward
    experts, and its combine under the backward attention (with ``delay_wgrad_compute`` the experts' weight
    gradients move from the second pair to the third)."""
    parts = parts or moe_parts(shapes, device)
    comm = parts.comm
    features = shapes.features
    dispatch = comm.dispatch_ms + comm.tp_ms / 2
    combine = comm.combine_ms + comm.tp_ms / 2
    saved_f = saved_b = 0.0
    sms = DISPATCHER_SMS.get(shapes.dispatcher, 16)
    if features.moe_shared_expert_overlap and shapes.shared_ffn_hidden_size:
        fc1, fc2 = mlp.get("shared_experts.linear_fc1", Timing()), mlp.get("shared_experts.linear_fc2", Timing())
        saved_f = overlapped_ms(comm_ms=(dispatch, combine), compute_ms=(fc1.fwd_ms, fc2.fwd_ms), comm_sms=sms,
                                num_sms=device.gpu.num_sms)
        saved_b = overlapped_ms(comm_ms=(combine, dispatch), compute_ms=(fc2.bwd_ms, fc1.bwd_ms), comm_sms=sms,
                                num_sms=device.gpu.num_sms)
    elif features.overlap_moe_expert_parallel_comm:
        experts_f, experts_b, experts_w = _split(mlp, "experts.")
        shared_f, shared_b, shared_w = _split(mlp, "shared_experts.")
        router_f, router_b, _ = _split(mlp, "router")
        mlp_f = experts_f + shared_f + router_f + parts.router_fwd_ms + parts.permute_fwd_ms
        mlp_b = experts_b + shared_b + router_b + parts.router_bwd_ms + parts.permute_bwd_ms
        saved_f, saved_b = combined_1f1b_saved_ms(
            attention_f=attention.fwd_ms, attention_b=attention.bwd_ms, mlp_f=mlp_f, mlp_b=mlp_b,
            mlp_wgrad=experts_w + shared_w, dispatch=dispatch, combine=combine,
            delay_wgrad=features.delay_wgrad_compute, comm_sms=sms, num_sms=device.gpu.num_sms)
    total = dispatch + combine
    return (part("memory_bound", parts.router_fwd_ms + parts.permute_fwd_ms, parts.router_bwd_ms + parts.permute_bwd_ms)
            + part("ep_comm", parts.preprocess_ms + total - saved_f, total - saved_b))
