#!/usr/bin/env bash
# megapipe plan: Megatron-LM launch for one node.
# Run on every node: NODE_RANK=<0..N-1> MASTER_ADDR=<node 0> MEGATRON_LM=<checkout> bash launch_megatron.sh <your flags>
# Add the data, tokenizer and schedule flags, e.g. --data-path ... (or --mock-data) --tokenizer-type HuggingFaceTokenizer --tokenizer-model ... (a 51,200-token vocabulary, as planned) --train-iters ... --eval-interval ... --lr ... --lr-decay-style cosine
set -euo pipefail
MEGATRON_ARGS=(
  --tensor-model-parallel-size
  8
  --pipeline-model-parallel-size
  4
  --pipeline-model-parallel-layout
  'Et*11|t*12|t*12|t*12|t*12|t*12|t*12|t*13L'
  --microbatch-group-size-per-virtual-pipeline-stage
  8
  --context-parallel-size
  1
  --sequence-parallel
  --micro-batch-size
  2
  --global-batch-size
  512
  --recompute-granularity
  selective
  --overlap-grad-reduce
  --num-layers
  96
  --hidden-size
  12288
  --ffn-hidden-size
  49152
  --num-attention-heads
  96
  --kv-channels
  128
  --seq-length
  2048
  --max-position-embeddings
  2048
  --position-embedding-type
  learned_absolute
  --normalization
  LayerNorm
  --norm-epsilon
  1e-05
  --attention-dropout
  0.1
  --hidden-dropout
  0.1
  --vocab-size
  51200
  --make-vocab-size-divisible-by
  128
  --fp16
)
exec torchrun --nproc-per-node 8 --nnodes 16 --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-6000}" "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" "$@"
