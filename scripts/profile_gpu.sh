#!/usr/bin/env bash
# Profile llama3_8b-sized layers on one GPU with megatron-core, then calibrate the cluster GPU's
# efficiency fields on those profiles (leave-one-out cross-validation) and print the figures that go
# to docs/validation.md ("## Calibration").
#
# Usage: scripts/profile_gpu.sh [CLUSTER] [OUT_DIR]
#   CLUSTER: the hydra_conf/cluster entry of the GPU this runs on (default h100_80gb; h200_141gb on an H200)
# Needs a CUDA build of torch and megatron-core; takes a few minutes (one layer per shape is built).
set -euo pipefail
CLUSTER=${1:-h100_80gb}
OUT=${2:-outputs/profile_gpu_${CLUSTER}}
PY=${PYTHON:-python}
COMMON=(cluster="$CLUSTER" parallel.pipeline_model_parallel_size=1 parallel.tensor_model_parallel_size=1
        model=llama3_8b "extra={device: cuda, iters: 20, warmup: 5}")
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
"$PY" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'megatron-core', m.__version__)"
PROFILES=()
for shape in "2048 1" "4096 1" "4096 2" "8192 1"; do
  set -- $shape
  seq=$1; mbs=$2
  dir="$OUT/s${seq}_mbs${mbs}"
  "$PY" -m megapipe.cli profile "${COMMON[@]}" train.seq_length="$seq" train.micro_batch_size="$mbs" \
      output.dir="$dir"
  PROFILES+=("$dir/profile.yaml")
done
# Analytical error before/after calibration, and leave-one-out predictions of each held-out shape.
"$PY" -m megapipe.cli calibrate "${PROFILES[@]}" "${COMMON[@]:0:4}" output.dir="$OUT"
echo "--- calibration.json ---"
cat "$OUT/calibration.json"
