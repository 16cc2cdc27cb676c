"""Measure peak GPU memory of real SFT steps and compare it with finetune.planner's estimate.

    python scripts/measure_memory.py                 # on a CUDA GPU: every case, results in $OUT (or outputs/)
    python scripts/measure_memory.py --tiny          # on CPU: the tiny models, checks the script still runs
    python scripts/measure_memory.py --cases llama-3.2-1b-full-s1024-ckpt --parallel 1

Each case runs in a fresh subprocess: the real architecture (benchmarks/models.py) with random bf16 weights built
directly on the GPU (no hub), a few TRL SFTTrainer optimizer steps on random fixed-length token rows, and
torch.cuda.max_memory_allocated / max_memory_reserved over the steps. Rows (case, estimate, measured, ratio)
go to planner_validation.json and planner_validation.md. Cases may run side by side (--parallel): the peak
statistics are per process, and a case starts only when the planner's estimates of the running ones leave room.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.report import GIB, memory_markdown, write_memory_report
from finetune.planner import architecture, memory, setup

ROOT = Path(__file__).resolve().parent.parent
MEASURE_SCRIPT = ROOT / "scripts" / "measure_memory.py"

# (architecture, method, batch): batch as the recipes / planner assume for one H200
MODELS = [
    ("llama-3.2-1b", "full", 8),
    ("llama-3.2-3b", "full", 4),
    ("llama-3.2-3b", "lora", 8),
    ("llama-3.2-3b", "qlora", 8),
    ("gpt-oss-20b", "lora", 2),
]
SEQS = (1024, 2048)
STEPS = 4


def all_cases(tiny: bool) -> list[dict]:
    cases = []
    for arch, method, batch in MODELS:
        for seq in SEQS:
            for ckpt in (False, True):
                name = f"{arch}-{method}-s{seq}-b{batch}{'-ckpt' if ckpt else ''}"
                cases.append({"name": name, "arch": arch, "method": method, "batch": batch, "seq": seq,
                              "ckpt": ckpt, "tiny": tiny})
    if tiny:  # one of each model/method is enough to keep the code paths alive
        cases = [c for c in cases if c["seq"] == 1024 and (c["ckpt"] == (c["method"] != "full"))]
        for c in cases:
            c["seq"], c["batch"] = 64, 2
    return cases


def recipe_values(case: dict) -> dict:
    """The recipe keys the planner reads, for this case."""
    moe = case["arch"].startswith("gpt-oss")
    values = {
        "model_name_or_path": case["arch"],
        "dtype": "bfloat16",
        "max_length": case["seq"],
        "per_device_train_batch_size": case["batch"],
        "gradient_checkpointing": case["ckpt"],
        "optim": "adamw_torch_fused",
        "bf16": True,
        "attn_implementation": "flex_attention" if moe else "sdpa",
    }
    if case["method"] != "full":
        values |= {"use_peft": True, "lora_r": 16, "lora_dropout": 0.0 if moe else 0.05,
                   "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"] if moe else "all-linear"}
    if case["method"] == "qlora":
        values["load_in_4bit"] = True
    return values


def estimate_for(case: dict, architecture: architecture.Architecture | None = None) -> memory.Estimate:
    architecture = architecture or architecture.architecture_of(case["arch"])
    return memory.estimate(architecture, setup.setup_from_recipe(recipe_values(case)), "ddp", 1)


def measure(case: dict) -> dict:
    """One case, in its own process: build, train STEPS steps, read the allocator's peaks; with the estimate."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from trl import SFTConfig, SFTTrainer

    from benchmarks import models
    from benchmarks.report import versions
    from benchmarks.runner import StepTimer
    from finetune.models.tiny import build_tiny_tokenizer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tokenizer = build_tiny_tokenizer(models.family(case["arch"]))
    config = models.architecture(case["arch"], tokenizer, case["tiny"])
    # GPT-OSS's attention sinks need flex attention on CUDA; on CPU (the --tiny check) only eager runs them
    attn = ("flex_attention" if cuda else "eager") if config.model_type == "gpt_oss" else "sdpa"
    if case["method"] == "qlora":
        # Random weights cannot be loaded in 4 bit directly: save them once (safetensors), reload quantized.
        cache = Path(tempfile.gettempdir()) / f"benchmarks_bf16_{case['arch']}{'_tiny' if case['tiny'] else ''}"
        if not (cache / "config.json").is_file():
            models.build_model(config, attn, "grouped_mm", torch.bfloat16, device).save_pretrained(cache)
            if cuda:
                torch.cuda.empty_cache()
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(cache, quantization_config=bnb, device_map={"": device},
                                                     **models.model_kwargs(config, attn, "grouped_mm", torch.bfloat16))
    else:
        model = models.build_model(config, attn, "grouped_mm", torch.bfloat16, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    after_load = torch.cuda.memory_allocated() if cuda else 0

    values = recipe_values(case)
    peft_config = None if case["method"] == "full" else LoraConfig(
        r=16, lora_alpha=32, lora_dropout=values["lora_dropout"], target_modules=values["lora_target_modules"],
        task_type="CAUSAL_LM")
    rows = models.fixed_rows(case["batch"] * STEPS, case["seq"], config.vocab_size, seed=0)
    after_forward = []

    class Trainer(SFTTrainer):  # what the forward pass holds until the backward: activations, logits, loss
        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            if cuda:
                after_forward.append(torch.cuda.memory_allocated())
            return loss

    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="measure_"), per_device_train_batch_size=case["batch"], max_steps=STEPS,
        gradient_checkpointing=case["ckpt"], bf16=cuda, use_cpu=not cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", max_length=case["seq"], logging_steps=1000,
        save_strategy="no", report_to="none", dataloader_num_workers=0, learning_rate=1e-5, packing=False,
        dataset_num_proc=None,
    )
    started = time.time()
    trainer = Trainer(model=model, args=args, train_dataset=models.make_dataset(rows), processing_class=tokenizer,
                      peft_config=peft_config)
    timer = StepTimer(trainer, warmup=0, timed=STEPS, device=device)
    trainer.add_callback(timer.callback)
    trainer.train()
    row = {"case": case["name"], **case, "seconds": round(time.time() - started, 1), "device": device}
    if cuda:
        torch.cuda.synchronize()
        row.update(
            measured_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            measured_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            after_load_gib=after_load / GIB,
            step_start_gib=[x / GIB for x in timer.step_start_allocated],
            after_forward_gib=[x / GIB for x in after_forward],
            gpu=torch.cuda.get_device_name(),
        )
    row["versions"] = versions(device)
    estimate = estimate_for(case, architecture.architecture_from_config(config.to_dict(), case["arch"]))
    row["estimated_allocated_gib"] = estimate.allocated / GIB
    row["estimated_reserved_gib"] = estimate.reserved / GIB
    row["estimate_parts_gib"] = {k: round(v / GIB, 3) for k, v in estimate.parts.items()}
    if row.get("measured_allocated_gib"):
        row["ratio_allocated"] = row["estimated_allocated_gib"] / row["measured_allocated_gib"]
        row["ratio_reserved"] = row["estimated_reserved_gib"] / row["measured_reserved_gib"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="scaled-down configs (CPU check)")
    p.add_argument("--cases", nargs="*", help="case names (default: all)")
    p.add_argument("--parallel", type=int, default=1, help="cases at once (memory permitting)")
    p.add_argument("--memory-gib", type=float, default=130.0, help="GPU memory the parallel cases may share")
    p.add_argument("--deadline", type=float, default=0, help="start no case after this many seconds (0: none)")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "outputs"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.one:  # worker
        case = json.loads(args.one)
        try:
            row = measure(case)
        except Exception as e:  # reported as a row, the others still run
            traceback.print_exc()
            row = {"case": case["name"], **case, "error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(row), flush=True)
        return 0

    cases = [c for c in all_cases(args.tiny) if not args.cases or c["name"] in args.cases]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    need = {c["name"]: 0 if args.tiny else estimate_for(c).reserved / GIB * 1.2 + 2 for c in cases}
    pending = sorted(cases, key=lambda c: -need[c["name"]])
    running: list[tuple[dict, subprocess.Popen]] = []
    rows: list[dict] = []
    while pending or running:
        if args.deadline and time.time() - start > args.deadline:
            pending = []
        for c in list(pending):  # start what fits beside the running cases (always at least one)
            used = sum(need[r["name"]] for r, _ in running)
            if len(running) < args.parallel and (not running or used + need[c["name"]] <= args.memory_gib):
                running.append((c, subprocess.Popen([sys.executable, str(MEASURE_SCRIPT), "--one", json.dumps(c)],
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
                pending.remove(c)
        time.sleep(0.5)
        for c, proc in [item for item in running if item[1].poll() is not None]:
            running.remove((c, proc))
            text = proc.stdout.read()
            result = [line for line in text.splitlines() if line.startswith("RESULT ")]
            row = json.loads(result[-1][7:]) if result else {"case": c["name"], **c, "error": text[-400:]}
            if "error" in row:
                print(text[-3000:], file=sys.stderr)
            print(f"[{time.time() - start:6.0f}s] {c['name']}: "
                  + (row.get("error", "") or f"est {row['estimated_allocated_gib']:.2f} / meas "
                     f"{row.get('measured_allocated_gib') or 0:.2f} GiB allocated, {row['seconds']}s"), flush=True)
            rows.append(row)
            write_memory_report(rows, out)
    write_memory_report(rows, out)
    print(memory_markdown(rows))
    return 0 if rows and all("error" not in r for r in rows) else 1
