#!/usr/bin/env bash
# The live-sync checks on a GPU machine, in one go (under 5 minutes on one GPU):
#   1. the live tests (tests/vllm/test_sync.py: the toy Llama and the toy Qwen3-MoE) with the
#      engine on the GPU, at TP 1, the trainer's DTensors on the GPU too;
#   1b. DTensors between device meshes on the GPU (bench/dtensor_bench.py --device cuda: six
#      processes, gloo staging through host memory on any number of GPUs; with six GPUs or
#      more, NCCL, a GPU per process);
#   2. the benchmark (bench/vllm_sync_bench.py), engine TP 1 on the GPU;
#   3. with at least two GPUs, one sync into two engines (tests/vllm/test_sync.py's two-engine
#      test and bench/fleet_bench.py), an engine on each GPU;
#   4. with at least three GPUs, the benchmark over NCCL (two trainer processes and one worker,
#      each on a GPU of its own: NCCL refuses two processes of one group on the same GPU);
#   5. with at least four GPUs, one sync into two engines over NCCL (bench/fleet_bench.py: the
#      schedule's lanes as concurrent NCCL communicators, every process on a GPU of its own).
#
# Needs a Python with a CUDA build of vLLM 0.32 and reshard installed in it (pip install
# --no-deps a wheel of this checkout), given as VLLM_PYTHON (default: python3); for step 3, PEFT
# and accelerate too (pip install --no-deps peft==0.21.2 accelerate==1.15.0: the two-engine
# test pushes LoRA adapters from PEFT models and computes PEFT's tokens). Run from the
# repository root:  VLLM_PYTHON=/path/to/venv/bin/python bench/gpu_check.sh
# Prints what each step gave; exits non-zero at the first step that fails.
set -euo pipefail

PY=${VLLM_PYTHON:-python3}
OUT=${OUT:-$(mktemp -d)}
cd "$(dirname "$0")/.."

step() { echo; echo "== $*"; }

step "environment"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
"$PY" - <<'EOF'
import importlib.metadata as md
import torch, vllm, reshard
assert torch.cuda.is_available(), "torch sees no GPU: a CUDA build of torch and vLLM is needed"
plugins = [e.value for e in md.entry_points(group="vllm.general_plugins")]
assert "reshard.vllm.plugin:register" in plugins, f"reshard's vLLM plugin is not installed: {plugins}"
print("torch", torch.__version__, "vllm", vllm.__version__, "reshard", reshard.__version__,
      "GPUs", torch.cuda.device_count())
EOF
GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')

step "live tests, engine on the GPU (TP 1)"
# One sync into two engines needs a GPU for each (both at TP 1).
FLEET=(-k "not two_engines")
if [ "$GPUS" -ge 2 ]; then FLEET=(); fi
RESHARD_VLLM_ENGINE_TPS=1 RESHARD_FLEET_GPU_EACH=1 RESHARD_TRAINER_DEVICE=cuda timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
  tests/vllm/test_sync.py --basetemp="$OUT/tests" -x "${FLEET[@]}"

step "DTensors between meshes on the GPU (6 processes, gloo)"
DTENSOR=(-m torch.distributed.run --nproc_per_node 6 --master_addr 127.0.0.1 bench/dtensor_bench.py
  --device cuda --size 2048)
timeout 150 "$PY" "${DTENSOR[@]}" --backend gloo
if [ "$GPUS" -ge 6 ]; then
  step "DTensors between meshes over NCCL (a GPU per process)"
  timeout 150 "$PY" "${DTENSOR[@]}" --backend nccl
else
  step "NCCL DTensor benchmark skipped: $GPUS GPU(s), it needs 6"
fi

step "benchmark, engine TP 1 on the GPU, gloo between trainer processes and worker"
timeout 150 "$PY" bench/vllm_sync_bench.py --engine-tp 1 --mb 320 --repeat 3

if [ "$GPUS" -ge 2 ]; then
  step "one sync into two engines (one GPU each), against one engine and two syncs"
  timeout 300 env CUDA_VISIBLE_DEVICES=0,1 "$PY" bench/fleet_bench.py --engine-tp 1 --mb 320 --repeat 3 \
    --gpu-each
fi

if [ "$GPUS" -ge 3 ]; then
  step "benchmark over NCCL (trainer processes on GPUs 1 and 2, the worker on GPU 0)"
  timeout 150 "$PY" bench/vllm_sync_bench.py --engine-tp 1 --mb 320 --repeat 3 --backend nccl
else
  step "NCCL benchmark skipped: $GPUS GPU(s), NCCL needs one per process (3)"
fi
if [ "$GPUS" -ge 4 ]; then
  step "one sync into two engines over NCCL (engines on GPUs 0 and 1, trainer processes on 2 and 3)"
  timeout 300 env CUDA_VISIBLE_DEVICES=0,1,2,3 "$PY" bench/fleet_bench.py --engine-tp 1 --mb 320 \
    --repeat 3 --backend nccl
else
  step "NCCL two-engine benchmark skipped: $GPUS GPU(s), it needs 4"
fi
echo; echo "gpu_check: done ($OUT)"
