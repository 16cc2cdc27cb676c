"""Measure peak GPU memory of real SFT steps and compare it with finetune.plan's estimate.

    python scripts/measure_memory.py                 # on a CUDA GPU: every case, results in $OUT (or outputs/)
    python scripts/measure_memory.py --tiny          # on CPU: scaled-down configs, checks the script still runs
    python scripts/measure_memory.py --cases llama-3.2-1b-full-s1024-ckpt --parallel 1

Each case runs in a fresh subprocess: the real architecture from finetune/model_configs/*.json with random bf16
weights built directly on the GPU (no hub), a few TRL SFTTrainer optimizer steps on random fixed-length token rows,
and torch.cuda.max_memory_allocated / max_memory_reserved over the steps. Rows (case, estimate, measured, ratio)
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from finetune import plan as planner  # noqa: E402  (json only: cheap)
from finetune.architectures import MODEL_CONFIGS_DIR  # noqa: E402

GIB = 1024**3

# (architecture, method, batch): batch as the recipes / planner assume for one H200
MODELS = [
    ("llama-3.2-1b", "full", 8),
    ("llama-3.2-3b", "full", 4),
    ("llama-3.2-3b", "lora", 8),
    ("llama-3.2-3b", "qlora", 8),
    ("gpt-oss-20b", "lora", 2),
]
SEQS = (1024, 2048)


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


def estimate_for(case: dict, config_values: dict | None = None) -> planner.Estimate:
    values = recipe_values(case)
    setup = planner.setup_from_recipe(values)
    arch = planner.architecture_from_config(config_values) if config_values else planner.architecture_of(case["arch"])
    return planner.estimate(arch, setup, "ddp", 1)


def tiny_config(values: dict) -> dict:
    """The same architecture, scaled down (2 layers, narrow) for a CPU check."""
    values = dict(values)
    values.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512)
    if "layer_types" in values:
        values["layer_types"] = values["layer_types"][:2]
    if "num_local_experts" in values:
        values.update(num_local_experts=4, num_experts_per_tok=2, experts_per_token=2)
    values.pop("bos_token_id", None)
    values.update(eos_token_id=1, pad_token_id=0)
    return values


# ---- One case, in its own process -------------------------------------------------------------------------------
def run_case(case: dict) -> dict:
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config_values = json.loads((MODEL_CONFIGS_DIR / f"{case['arch']}.json").read_text())
    config_values.pop("torch_dtype", None)
    if case["tiny"]:
        config_values = tiny_config(config_values)
    model_type = config_values.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **config_values)
    moe = model_type == "gpt_oss"
    # GPT-OSS's attention sinks need flex attention on CUDA; on CPU (the --tiny check) only eager runs them
    init_kwargs = {"attn_implementation": ("flex_attention" if cuda else "eager") if moe else "sdpa"}
    if moe:
        init_kwargs["experts_implementation"] = "grouped_mm"

    def build(dev):
        with torch.device(dev):
            try:
                return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **init_kwargs)
            except (TypeError, ValueError):  # a transformers without experts_implementation
                init_kwargs.pop("experts_implementation", None)
                return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **init_kwargs)

    tmp = Path(tempfile.mkdtemp(prefix="measure_"))
    if case["method"] == "qlora":
        # Random weights cannot be loaded in 4 bit directly: save them once (safetensors), reload quantized.
        from transformers import BitsAndBytesConfig

        cache = Path(tempfile.gettempdir()) / f"measure_bf16_{case['arch']}{'_tiny' if case['tiny'] else ''}"
        if not (cache / "config.json").is_file():
            build(device).save_pretrained(cache)
            if cuda:
                torch.cuda.empty_cache()
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(cache, quantization_config=bnb, dtype=torch.bfloat16,
                                                     device_map={"": device}, **init_kwargs)
    else:
        model = build(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    after_load = torch.cuda.memory_allocated() if cuda else 0

    peft_config = None
    values = recipe_values(case)
    if case["method"] != "full":
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=values["lora_dropout"],
                                 target_modules=values["lora_target_modules"], task_type="CAUSAL_LM")

    vocab = cfg.vocab_size
    steps = 4
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(2, vocab, (case["batch"] * steps, case["seq"]), generator=g).tolist()
    dataset = Dataset.from_dict({"input_ids": rows})
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>")),
        pad_token="<pad>", eos_token="<eos>")

    stats = {"step_start_allocated": [], "after_forward_allocated": [], "step_peak_allocated": []}

    class Probe(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                stats["step_start_allocated"].append(torch.cuda.memory_allocated())

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                stats["step_peak_allocated"].append(torch.cuda.max_memory_allocated())

    class Trainer(SFTTrainer):
        def compute_loss(self, *a, **k):
            out = super().compute_loss(*a, **k)
            if cuda:
                stats["after_forward_allocated"].append(torch.cuda.memory_allocated())
            return out

    args = SFTConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=case["batch"], max_steps=steps,
        gradient_checkpointing=case["ckpt"], bf16=cuda, use_cpu=not cuda, optim="adamw_torch_fused" if cuda else "adamw_torch",
        max_length=case["seq"], logging_steps=1000, save_strategy="no", report_to="none", dataloader_num_workers=0,
        learning_rate=1e-5, packing=False, dataset_num_proc=None,
    )
    t0 = time.time()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tok, peft_config=peft_config,
                      callbacks=[Probe()])
    trainer.train()
    seconds = time.time() - t0
    row = {"case": case["name"], **case, "seconds": round(seconds, 1), "device": device}
    if cuda:
        torch.cuda.synchronize()
        row.update(
            measured_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
            measured_reserved_gib=torch.cuda.max_memory_reserved() / GIB,
            after_load_gib=after_load / GIB,
            step_start_gib=[x / GIB for x in stats["step_start_allocated"]],
            after_forward_gib=[x / GIB for x in stats["after_forward_allocated"]],
            gpu=torch.cuda.get_device_name(),
        )
    import peft
    import transformers  # noqa: E401
    import trl

    row["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                       "peft": peft.__version__}
    return row


def add_estimate(row: dict) -> dict:
    case = {k: row[k] for k in ("arch", "method", "batch", "seq", "ckpt", "tiny")}
    cfg = None
    if case["tiny"]:
        cfg = tiny_config(json.loads((MODEL_CONFIGS_DIR / f"{case['arch']}.json").read_text()))
    e = estimate_for(case, cfg)
    row["estimated_allocated_gib"] = e.allocated / GIB
    row["estimated_reserved_gib"] = e.reserved / GIB
    row["estimate_parts_gib"] = {k: round(v / GIB, 3) for k, v in e.parts.items()}
    if row.get("measured_allocated_gib"):
        row["ratio_allocated"] = row["estimated_allocated_gib"] / row["measured_allocated_gib"]
        row["ratio_reserved"] = row["estimated_reserved_gib"] / row["measured_reserved_gib"]
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| case | est. allocated GiB | measured max allocated GiB | ratio | est. reserved GiB | "
             "measured max reserved GiB | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][:80]} | | | | | |")
            continue
        ma, mr = r.get("measured_allocated_gib"), r.get("measured_reserved_gib")
        fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {r['case']} | {r['estimated_allocated_gib']:.2f} | {fmt(ma)} | {fmt(r.get('ratio_allocated'))} "
                     f"| {r['estimated_reserved_gib']:.2f} | {fmt(mr)} | {fmt(r.get('ratio_reserved'))} |")
    return "\n".join(lines) + "\n"


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
            row = run_case(case)
        except Exception as e:  # reported as a row, the others still run
            import traceback

            traceback.print_exc()
            row = {"case": case["name"], **case, "error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(row), flush=True)
        return 0

    cases = all_cases(args.tiny)
    if args.cases:
        cases = [c for c in cases if c["name"] in args.cases]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    pending = sorted(cases, key=lambda c: -estimate_for(c).reserved) if not args.tiny else list(cases)
    running: list[tuple[dict, subprocess.Popen, float]] = []
    rows: list[dict] = []
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    def budget_used():
        return sum(0 if args.tiny else estimate_for(c).reserved / GIB * 1.2 + 2 for c, _, _ in running)

    def save():
        rows.sort(key=lambda r: r["case"])
        (out / "planner_validation.json").write_text(json.dumps(rows, indent=2))
        (out / "planner_validation.md").write_text(markdown(rows))

    while pending or running:
        if args.deadline and time.time() - start > args.deadline:
            pending = []
        # start what fits beside the running cases (always at least one)
        for c in list(pending):
            need = 0 if args.tiny else estimate_for(c).reserved / GIB * 1.2 + 2
            if len(running) < args.parallel and (not running or budget_used() + need <= args.memory_gib):
                proc = subprocess.Popen([sys.executable, __file__, "--one", json.dumps(c)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env)
                running.append((c, proc, time.time()))
                pending.remove(c)
        time.sleep(0.5)
        for item in list(running):
            c, proc, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            text = proc.stdout.read()
            result = [line for line in text.splitlines() if line.startswith("RESULT ")]
            row = json.loads(result[-1][7:]) if result else {"case": c["name"], **c, "error": text[-400:]}
            if "error" in row:
                print(text[-3000:], file=sys.stderr)
            else:
                row = add_estimate(row)
            print(f"[{time.time() - start:6.0f}s] {c['name']}: "
                  + (row.get("error", "") or f"est {row['estimated_allocated_gib']:.2f} / meas "
                     f"{row.get('measured_allocated_gib') or 0:.2f} GiB allocated, {row['seconds']}s"), flush=True)
            rows.append(row)
            save()
    save()
    print(markdown(rows))
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
