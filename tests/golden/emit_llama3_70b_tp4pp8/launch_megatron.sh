#!/usr/bin/env bash
# megapipe plan: Megatron-LM launch for one node.
# Run on every node: NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> MEGATRON_LM=<checkout> bash launch_megatron.sh <your flags>
# Add the data, tokenizer and schedule flags, e.g. --data-path ... (or --mock-data) --tokenizer-type HuggingFaceTokenizer --tokenizer-model ... (a 128,256-token vocabulary, as planned) --train-iters ... --eval-interval ... --lr ... --lr-decay-style cosine
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
MEGATRON_ARGS=(
  --tensor-model-parallel-size
  4
  --pipeline-model-parallel-size
  8
  --pipeline-model-parallel-layout
  'Et*9|t*10|t*10|t*10|t*10|t*10|t*11|t*10L'
  --context-parallel-size
  1
  --sequence-parallel
  --micro-batch-size
  1
  --global-batch-size
  256
  --recompute-granularity
  full
  --recompute-method
  uniform
  --recompute-num-layers
  1
  --use-distributed-optimizer
  --overlap-grad-reduce
  --overlap-param-gather
  --num-layers
  80
  --hidden-size
  8192
  --ffn-hidden-size
  28672
  --num-attention-heads
  64
  --group-query-attention
  --num-query-groups
  8
  --kv-channels
  128
  --seq-length
  8192
  --max-position-embeddings
  8192
  --position-embedding-type
  rope
  --rotary-base
  500000
  --swiglu
  --normalization
  RMSNorm
  --norm-epsilon
  1e-05
  --disable-bias-linear
  --attention-dropout
  0
  --hidden-dropout
  0
  --untie-embeddings-and-output-weights
  --vocab-size
  128256
  --make-vocab-size-divisible-by
  128
  --bf16
)
exec torchrun --nproc-per-node 8 --nnodes 16 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-6000}" "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "$@"
