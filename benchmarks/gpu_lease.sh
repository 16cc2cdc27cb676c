#!/usr/bin/env bash
# One device call of `benchmarks/user_path.py --all`: PART is 6 (the Llama recipes cold and warm, Unsloth's Llama), 7
# (GPT-OSS-20B with checkpointing cold and warm, Unsloth's GPT-OSS), 8 (the same, experts resident), 1 (the Llama recipes, a second launch, SIGTERM, Unsloth's
# Llama), 2 (GPT-OSS-20B with and without checkpointing, Unsloth's GPT-OSS), 3 (GPT-OSS-120B resident on one GPU), 4
# (GPT-OSS-20B resident against dequantized) or 5 (resident with checkpointing, Unsloth's GPT-OSS); each fits one call.
# Run from the project's root with `carry` [".whl", ".uw", ".peers"] (../shared/gpu/README.md: the project's wheels in
# .whl, Unsloth's in .uw, unsloth_peer.py in .peers). The results and logs go to $OUT/up.
#   bash benchmarks/gpu_lease.sh 1
set -euo pipefail
# this session's GPU processes left by an earlier call would skew the memory and the speed
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
df -h /dev/shm . | sed 's/^/[lease] /'; free -g | sed 's/^/[lease] /' 
part=${1:?usage: gpu_lease.sh 1|2|3|4|5|6|7|8}
# bytecode compiled as a user's `pip install` leaves it: a first import that compiles it is a wait no user has
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
# Unsloth pins trl <= 1.15: its wheels go to a folder of their own, first on its path only (user_path.py sets it)
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site2 .uw/*.whl
# graph breaks are logged: where a compiled first step's wait goes, beside finetune_speed.json's compile_seconds
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TORCH_LOGS=graph_breaks
python3 benchmarks/user_path.py --all --part "$part" --flags "${FLAGS:-}" --work runs/up --out "${OUT:-runs/up/results}/up" --budget "${BUDGET:-520}"
