#!/usr/bin/env bash
# Cross-validated calibration on this machine's CPU: profile a GPT layer stack at several hidden
# sizes and micro-batch sizes with megatron-core, then fit cluster=cpu_gloo's efficiency fields
# and predict each held-out shape from the others (leave-one-out).
# cluster=cpu_gloo's nominal 0.1 TFLOPS is below what one core reaches here in bf16 (~0.15-0.25 measured),
# which would pin matmul_efficiency at its bound of 1; the fit uses a nominal 0.4 TFLOPS instead, and
# 50 GB/s for memory-bound kernels (the small tensors live in cache, not DRAM).
# Usage: scripts/calibrate_cpu.sh [OUT_DIR]   (about 1-3 minutes on 2 cores)
set -euo pipefail
OUT=${1:-outputs/calibrate_cpu}
PY=${PYTHON:-python}
COMMON=(cluster=cpu_gloo parallel.pipeline_model_parallel_size=1 parallel.tensor_model_parallel_size=1
        cluster.gpu.bf16_tflops=0.4 cluster.gpu.hbm_gbytes_per_s=50 model=tiny_gpt model.num_layers=2 model.vocab_size=4096 train.seq_length=256
        "extra={iters: 7, warmup: 2, num_threads: 1}")
PROFILES=()
for shape in "128 1" "256 2" "384 1" "512 2"; do
  set -- $shape
  hidden=$1; mbs=$2
  dir="$OUT/h${hidden}_mbs${mbs}"
  $PY -m megapipe.cli profile "${COMMON[@]}" model.hidden_size=$hidden model.ffn_hidden_size=$((4 * hidden)) \
      model.num_attention_heads=$((hidden / 64)) model.num_query_groups=$((hidden / 64)) \
      train.micro_batch_size=$mbs output.dir="$dir" output.format=json
  PROFILES+=("$dir/profile.yaml")
done
$PY -m megapipe.cli calibrate "${PROFILES[@]}" "${COMMON[@]:0:6}" output.dir="$OUT"
