"""Print the cost-model figures quoted in docs/cost_model.md.

Usage: python scripts/cost_model_figures.py

1. The write-ups' 48-layer, 128k-vocabulary GPT: embedding and output units against a decoder layer
   (static memory, fwd+bwd time, activations), for TP = 1, 2, 4.
2. Per-layer costs and the implied per-microbatch MFU (no pipeline bubble, no data-parallel
   communication) for shipped model/cluster pairs; the yardstick is the GPU's dense bf16 peak.
"""

from __future__ import annotations

from megapipe.config import compose, to_scenario
from megapipe.cost import layer_costs, model_flops_per_token
from megapipe.records import ParallelSpec, TrainSpec


def _scenario(model: str, cluster: str = "h100_80gb"):
    return to_scenario(compose([f"model={model}", f"cluster={cluster}", "parallel.tensor_model_parallel_size=1",
                                "parallel.pipeline_model_parallel_size=1"]))


def _time(layer) -> float:
    return layer.fwd_ms + layer.bwd_ms


def _write_up_gpt() -> None:
    scenario = _scenario("gpt_48l_128k")
    train = TrainSpec(micro_batch_size=1, seq_length=scenario.model.seq_length)
    print("gpt_48l_128k on h100_80gb, seq 4096, mbs 1 (ratios against one decoder layer)")
    print("tp  emb_static  emb_time  out_static  out_time  out_act")
    for tp in (1, 2, 4):
        parallel = ParallelSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, data_parallel_size=8 // tp)
        layers = layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster,
                             parallel=parallel, train=train).layers
        emb, dec, out = layers[0], layers[1], layers[-1]
        print(f"{tp:<3} {emb.static_bytes / dec.static_bytes:10.2f}  {_time(emb) / _time(dec):8.3f}  "
              f"{out.static_bytes / dec.static_bytes:10.2f}  {_time(out) / _time(dec):8.2f}  "
              f"{out.act_bytes / dec.act_bytes:7.2f}")


def _implied_mfu() -> None:
    print("\nmodel        cluster        tp  dec_fwd_ms  dec_bwd_ms  dec_wgrad_ms  dec_act_MiB  out_ms  implied_MFU")
    cases = (("llama3_8b", "h100_80gb", 1, 8192), ("llama3_70b", "h100_80gb", 4, 8192),
             ("llama3_405b", "h100_80gb", 8, 8192), ("gpt3_175b", "a100_80gb", 8, 2048),
             ("llama3_70b", "h200_141gb", 4, 8192), ("llama3_70b", "b300_192gb", 4, 8192),
             ("llama3_70b", "mi300x_192gb", 4, 8192))
    for model, cluster, tp, seq in cases:
        scenario = _scenario(model, cluster)
        parallel = ParallelSpec(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, data_parallel_size=4)
        profile = layer_costs(model=scenario.model, gpu=scenario.cluster.gpu, cluster=scenario.cluster,
                              parallel=parallel, train=TrainSpec(micro_batch_size=1, seq_length=seq))
        total_ms = sum(_time(layer) for layer in profile.layers)
        flops_per_gpu = model_flops_per_token(scenario.model, seq) * seq / tp
        mfu = flops_per_gpu / (total_ms * 1e-3) / (scenario.cluster.gpu.bf16_tflops * 1e12)
        dec, out = profile.layers[1], profile.layers[-1]
        print(f"{model:<12} {cluster:<14} {tp:<3} {dec.fwd_ms:10.2f}  {dec.bwd_ms:10.2f}  {dec.wgrad_ms:12.2f}  "
              f"{dec.act_bytes / 2**20:11.0f}  {_time(out):6.2f}  {mfu:11.3f}")


if __name__ == "__main__":
    _write_up_gpt()
    _implied_mfu()
