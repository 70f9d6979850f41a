"""Predicted (megapipe.cost) against measured (megatron-core on this CPU) parameters and activation bytes.

Usage: python scripts/validate_cost_activations.py

Measured: ``megapipe.profile.measure`` builds megatron-core's local-spec GPTModel units and sums
the distinct storages autograd saves for backward. Its builds use no dropout, so the gelu rows
also print the cost model's figure without the dropout terms (masks and the score-dropout output).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megapipe.cost import layer_costs, shapes_of
from megapipe.cost.memory import decoder_activation_bytes, embedding_activation_bytes
from megapipe.profile.measure import measure_profile
from megapipe.options import MeasureOptions
from megapipe.records import (
    Activation, AttentionBackend, ClusterSpec, GpuSpec, LayerKind, LinkSpec, ModelSpec, NodeGroup, ParallelSpec,
    Recompute, TrainSpec,
)

GPU = GpuSpec(name="cpu", bf16_tflops=0.1, hbm_gbytes_per_s=10, memory_gib=4)
LINK = LinkSpec(kind="loopback", bandwidth_gbytes_per_s=2, latency_us=50)
CLUSTER = ClusterSpec(name="cpu", gpus_per_node=2, price_per_gpu_hour=0.05, intra_node=LINK, inter_node=LINK,
                      node_groups=(NodeGroup(gpu=GPU, num_nodes=1),))
MODELS = (
    ModelSpec(name="swiglu_gqa", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
              ffn_hidden_size=176, vocab_size=512, seq_length=64, attention_backend=AttentionBackend.unfused),
    ModelSpec(name="gelu_mha", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
              ffn_hidden_size=256, vocab_size=512, seq_length=64, activation=Activation.gelu,
              attention_backend=AttentionBackend.unfused, position_embedding_type="learned_absolute"),
)


def _without_dropout(model: ModelSpec, train: TrainSpec) -> tuple[float, float]:
    """(embedding, decoder) bytes with the gelu family's dropout switched off."""
    shapes = replace(shapes_of(model=model, parallel=ParallelSpec(), train=train), gpt_style=False)
    return embedding_activation_bytes(shapes), decoder_activation_bytes(shapes)


def main() -> None:
    torch.set_num_threads(1)
    print("model       prec  recompute  unit       params_pred  params_meas  act_pred  act_pred_nodrop  act_meas")
    for model in MODELS:
        for precision in ("fp32", "bf16"):
            for recompute in Recompute:
                train = TrainSpec(micro_batch_size=2, seq_length=64, precision=precision,
                                  recompute_granularity=recompute)
                measured = measure_profile(model=model, train=train,
                                           options=MeasureOptions(device="cpu", warmup=0, iters=1))
                predicted = layer_costs(model=model, gpu=GPU, cluster=CLUSTER, parallel=ParallelSpec(), train=train)
                by_kind = {layer.kind: layer for layer in measured.layers}
                nodrop = dict(zip((LayerKind.embedding, LayerKind.decoder), _without_dropout(model, train)))
                for pred in (predicted.layers[0], predicted.layers[1], predicted.layers[-1]):
                    meas = by_kind[pred.kind]
                    plain = nodrop.get(pred.kind, pred.act_bytes)
                    print(f"{model.name:<11} {precision:<5} {recompute.value:<10} {pred.kind.value:<10} "
                          f"{pred.param_count:11.0f}  {meas.param_count:11.0f}  {pred.act_bytes:8.0f}  "
                          f"{plain:15.0f}  {meas.act_bytes:8.0f}")


if __name__ == "__main__":
    main()
