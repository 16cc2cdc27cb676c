#!/usr/bin/env bash
# One device call (carry [".whl"]): a 4-layer GPT-OSS-120B written as the hub ships it, then one micro-batch of the
# 120B recipe profiled (benchmarks/profile_step.py) with the experts resident and dequantized; tables in $OUT.
#   bash benchmarks/profile_lease.sh
set -u
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1
python3 -c "from benchmarks.user_path import write_chat_rows; from pathlib import Path; write_chat_rows(Path('/tmp/data'))"
python3 benchmarks/profile_step.py --write_gpt_oss gpt-oss-120b:4:/tmp/m120 || exit 1
common="--config recipes/gpt-oss-120b/lora.yaml --model_name_or_path /tmp/m120 --dataset_name /tmp/data --max_steps 1 --gradient_accumulation_steps 5 --eval_strategy no --save_strategy no --eval_samples_before_after 0 --logging_steps 1"
timeout 200 python3 benchmarks/profile_step.py --label resident_ckpt --at 4 -- $common --output_dir /tmp/o1 2>&1 | grep -v Warning | tail -60
timeout 200 python3 benchmarks/profile_step.py --label dequantized_ckpt --at 4 -- $common --dequantize_mxfp4 true --output_dir /tmp/o2 2>&1 | grep -v Warning | tail -60
