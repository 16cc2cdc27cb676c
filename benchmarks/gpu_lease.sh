#!/usr/bin/env bash
# One device call of `benchmarks/user_path.py --all`: PART is 6 (the Llama recipes cold and warm, Unsloth's Llama), 7
# (GPT-OSS-20B with checkpointing cold and warm, then the fused MXFP4 GEMM's benchmark), 8 (GPT-OSS-20B with
# checkpointing and its experts resident, cold and warm, Unsloth's GPT-OSS), 1 (the Llama recipes, a second launch,
# SIGTERM, Unsloth's Llama), 2 (GPT-OSS-20B with and without checkpointing, Unsloth's GPT-OSS), 3 (GPT-OSS-120B
# resident on one GPU, compiled as shipped, then eager), 4 (GPT-OSS-20B resident against dequantized), 5 (resident
# with checkpointing, Unsloth's GPT-OSS), 9 (GPT-OSS-120B at r16 with fp32 AdamW, 4 then 8 rows a micro-batch, for
# one H200), 10 (GPT-OSS-20B resident with and without checkpointing, then dequantized without), 11 (GPT-OSS-20B
# resident against dequantized with checkpointing, after the prefetched dequantization against dequantizing where
# asked), 12 (the same, then the variant that dequantizes the next chunk ahead) or 13 (the one-GPU recipe
# lora_mxfp4.yaml as shipped resident against dequantized, then both without activation offloading) or 14 (13's pair
# without offloading first, then the recipe as shipped); each fits one call.
# FLAGS="--per_device_train_batch_size 8" adds flags to every run, after (so over) each case's own.
# Run from the project's root with `carry` [".whl", ".uw", ".peers"] (../shared/gpu/README.md: the project's wheels in
# .whl, Unsloth's in .uw, unsloth_peer.py in .peers). The results and logs go to $OUT/up.
#   bash benchmarks/gpu_lease.sh 1
set -euo pipefail
# this session's GPU processes left by an earlier call would skew the memory and the speed
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
df -h /dev/shm . | sed 's/^/[lease] /'; free -g | sed 's/^/[lease] /' 
part=${1:?usage: gpu_lease.sh 1|2|3|4|5|6|7|8|9|10|11|12|13|14}
# bytecode compiled as a user's `pip install` leaves it: a first import that compiles it is a wait no user has.
# Once per machine: a later call of the same lease finds them installed.
wheels=$(ls -l .whl .uw | md5sum | cut -c1-32)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # Unsloth pins trl <= 1.15: its wheels go to a folder of their own, first on its path only (user_path.py sets it)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site2 .uw/*.whl
  echo "$wheels" > /tmp/site/.wheels
fi
# The image's own packages (torch, transformers, ...) came without bytecode, and its environment forbids writing it:
# every process would compile them again at import (seconds in `accelerate launch` and in the training process). A
# user's `pip install` leaves them compiled, so they are compiled here once, timed apart from every row.
unset PYTHONDONTWRITEBYTECODE
image_site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "[lease] $image_site: $(find "$image_site" -name '*.py' | wc -l) .py, $(find "$image_site" -name '*.pyc' | wc -l) .pyc, writable: $(test -w "$image_site" && echo yes || echo no)"
if ! test -w "$image_site"; then export PYTHONPYCACHEPREFIX=/tmp/pycache; fi
start=$(date +%s.%N)
python3 -m compileall -q -j 0 "$image_site" /tmp/site /tmp/site2 finetune scripts benchmarks > /dev/null 2>&1 || true
echo "[lease] bytecode compiled in $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s (not in any row)"
# graph breaks and dynamo's restarts are logged: where a compiled first step's wait goes, beside finetune_speed.json's compile_seconds
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 HF_HUB_OFFLINE=1 TORCH_LOGS=graph_breaks,dynamo
out="${OUT:-runs/up/results}/up"
if [ "$part" = 11 ] || [ "$part" = 12 ]; then
  # the prefetch's exactness on this GPU (its second stream) before the rows that time it (issue 42: the 0.95x row)
  mkdir -p "$out"
  OUT="$out" timeout 90 python3 benchmarks/mxfp4_resident_check.py --prefetch > "$out/mxfp4_prefetch.log" 2>&1
  tail -5 "$out/mxfp4_prefetch.log"
fi
python3 benchmarks/user_path.py --all --part "$part" --flags "${FLAGS:-}" --work runs/up --out "$out" --budget "${BUDGET:-520}"
set +e  # diagnostics only: none of them may cost the rows above
# part 7 leaves time for the fused MXFP4 grouped GEMM against the chunked path (issue 42: training takes it where it won)
if [ "$part" = 7 ]; then
  OUT="$out" timeout 170 python3 benchmarks/mxfp4_resident_check.py --fused_gemm > "$out/mxfp4_fused_gemm.log" 2>&1
  tail -40 "$out/mxfp4_fused_gemm.log"
fi
# What the compiled graphs hold besides GPU kernels (a C++ kernel for the CPU costs a compiler run cold and inductor's
# CPU probe warm), and what the training process imports, in the order and time it imports it
for source in $(find runs/up/compile-cache -name '*.cpp' 2>/dev/null | head -5); do
  echo "[lease] C++ kernel $source:"; grep -v '^#include' "$source" | head -40
done
find runs/up/compile-cache -name '*.py' -exec grep -l "async_compile.cpp" {} + 2>/dev/null | head -3 \
  | while read -r wrapper; do echo "[lease] wrapper with C++: $wrapper"; grep -n -B2 -A12 "async_compile.cpp" "$wrapper" | head -60; done
python3 -X importtime -c "import finetune.sft" 2> "$out/importtime_sft.txt" || true
python3 -X importtime -c "import accelerate.commands.launch" 2> "$out/importtime_accelerate_launch.txt" || true

