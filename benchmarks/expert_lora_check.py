"""LoRA on GPT-OSS's experts: the grouped path (finetune/expert_lora.py) against peft's target_parameters path.

numerics:   the GPT-OSS-20B architecture cut to 2 layers, random bf16 weights on the GPU, the same rows in the same
            order, 20 training steps through each path: loss curves and adapter weights, which must agree within bf16
            rounding (and have the same keys and shapes: peft's adapter format).
throughput: the whole GPT-OSS-20B (random bf16 weights), the recipe recipes/gpt-oss-20b/lora.yaml as shipped (LoRA r16
            on attention, compiled) with and without LoRA on all experts through each path, seq 2048, batch 4, with
            and without activation checkpointing: tokens/s (median over timed steps) and peak memory.

Each variant runs in a child process of its own (a second compiled GPT-OSS in one process fails, and the peak memory is
then that variant's alone). The trainer is the one `scripts/sft.py` builds: `finetune.config.parse_args` on the recipe
plus overrides, `finetune.train.build_trainer`.

    python benchmarks/expert_lora_check.py --out DIR                 # GPU: numerics, then every throughput variant
    python benchmarks/expert_lora_check.py --out DIR --tiny          # CPU: the same with the tiny GPT-OSS, to try it

Writes DIR/expert_lora_check.json and DIR/expert_lora_check.md, and prints the table.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"
EXPERTS = ["--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CHECKPOINTING = ["--gradient_checkpointing", "true"]
GIB = 2**30
# name -> (what it is, recipe overrides)
VARIANTS = {
    "grouped": ("attention + experts, grouped path", [*EXPERTS, "--expert_lora_kernel", "grouped"]),
    "peft": ("attention + experts, peft's path", [*EXPERTS, "--expert_lora_kernel", "peft"]),
    "attention": ("attention only (recipe as shipped)", []),
    "grouped_gc": ("attention + experts, grouped path, checkpointing", [*EXPERTS, "--expert_lora_kernel", "grouped",
                                                                        *CHECKPOINTING]),
    "peft_gc": ("attention + experts, peft's path, checkpointing", [*EXPERTS, "--expert_lora_kernel", "peft",
                                                                    *CHECKPOINTING]),
    "attention_gc": ("attention only, checkpointing", CHECKPOINTING),
}


def learnable_rows(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Rows repeating a short random motif: learnt within a few steps, so the loss moves and the adapters train."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [np.resize(rng.integers(0, min(vocab, 4096), size=int(rng.integers(4, 12))), length).tolist()
            for _ in range(n_rows)]


def random_rows(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, size=(n_rows, length)).tolist()


def trainer_for(overrides: list[str], tiny: bool, layers: int | None, make_rows, steps: int, seq: int):
    """The recipe's trainer, as scripts/sft.py builds it, around a random-weight model of the recipe's architecture,
    on the rows make_rows(vocabulary size) returns."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from finetune import tiny as tiny_models
    from finetune.architectures import load_architecture
    from finetune.config import apply_to_process, parse_args
    from finetune.model import model_init_kwargs
    from finetune.train import build_trainer

    output_dir = tempfile.mkdtemp(prefix="expert-lora-check-")
    argv = ["--config", str(RECIPE), "--output_dir", output_dir, "--max_steps", str(steps), "--max_length", str(seq),
            "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
            "--assistant_only_loss", "false", "--disable_tqdm", "true", "--gradient_accumulation_steps", "1",
            *(["--tiny"] if tiny else []), *overrides]
    run = parse_args(argv)
    apply_to_process(run)
    tokenizer = tiny_models.build_tiny_tokenizer("gpt-oss")
    if tiny:
        config = tiny_models.tiny_config("gpt-oss", tokenizer)
    else:
        config = load_architecture("gpt-oss-20b")
        config.pad_token_id = tokenizer.pad_token_id if config.pad_token_id is None else config.pad_token_id
    if layers:
        config.num_hidden_layers = layers
        config.layer_types = config.layer_types[:layers]
    kwargs = model_init_kwargs(run, run.model.model_name_or_path)
    load = {"dtype": torch.float32 if tiny else torch.bfloat16, "attn_implementation": kwargs["attn_implementation"]}
    if kwargs.get("experts_implementation"):
        load["experts_implementation"] = kwargs["experts_implementation"]
    torch.manual_seed(0)
    with torch.device("cpu" if tiny else "cuda"):
        model = AutoModelForCausalLM.from_config(config, **load)
    model.config.use_cache = False
    dataset = Dataset.from_dict({"input_ids": make_rows(config.vocab_size)})
    return run, build_trainer(run, model, tokenizer, dataset, None), config


def grouped_modules(trainer) -> int:
    from finetune.expert_lora import GroupedExpertsLora

    return sum(isinstance(module, GroupedExpertsLora) for module in trainer.model.modules())


# ---- Children --------------------------------------------------------------------------------------------------------


def numerics(tiny: bool, steps: int) -> dict:
    """Same weights, same rows, same order: peft's path and the grouped path, eager (no compile, no checkpointing).
    The noise floor: peft's path again with transformers' eager experts (a loop over experts instead of grouped_mm),
    which rounds differently in bf16 and is as right; the grouped path passes within max(bound, 2 x that floor)."""
    import torch
    from peft import get_peft_model_state_dict

    seq = 128 if tiny else 512
    paths = {"peft": ["--expert_lora_kernel", "peft"], "grouped": ["--expert_lora_kernel", "grouped"],
             "peft_eager_experts": ["--expert_lora_kernel", "peft", "--experts_implementation", "eager"]}
    curves, adapters, grouped = {}, {}, {}
    for path, flags in paths.items():
        overrides = [*EXPERTS, *flags, "--torch_compile", "false", "--learning_rate", "1e-3",
                     "--lr_scheduler_type", "constant", "--warmup_steps", "0", "--per_device_train_batch_size", "4",
                     "--seed", "42"]
        _, trainer, _ = trainer_for(overrides, tiny, None if tiny else 2,
                                    lambda vocab: learnable_rows(4 * steps, seq, vocab, seed=3), steps, seq)
        grouped[path] = grouped_modules(trainer)
        trainer.train()
        curves[path] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        adapters[path] = {name: tensor.detach().float().cpu()
                          for name, tensor in get_peft_model_state_dict(trainer.model).items()}
        del trainer
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    reference = adapters["peft"]
    same_format = all({name: tuple(t.shape) for name, t in adapters[path].items()} ==
                      {name: tuple(t.shape) for name, t in reference.items()} for path in paths)

    def loss_difference(path):
        return max(abs(a - b) / abs(a) for a, b in zip(curves["peft"], curves[path], strict=True))

    def adapter_difference(path):
        return max(((adapters[path][name] - tensor).norm() / (tensor.norm() or 1.0)).item()
                   for name, tensor in reference.items())

    moved = max(tensor.norm().item() for name, tensor in reference.items() if "experts" in name and "lora_B" in name)
    # The paths round differently (bf16: x·A·B against bf16 W + B·A), and Adam turns rounding in near-zero gradients
    # into full-size steps (float32, tiny, 3 steps: adapters 1.7e-4 apart, losses 1.1e-7)
    bound_loss, bound_weights = (1e-5, 1e-3) if tiny else (2e-2, 5e-2)
    result = {
        "model": "tiny GPT-OSS (float32, CPU)" if tiny else "GPT-OSS-20B architecture cut to 2 layers (bf16)",
        "steps": steps, "seq": seq, "losses": curves, "grouped_modules": grouped,
        "same_adapter_keys_and_shapes": same_format, "expert_lora_B_norm": moved,
    }
    if same_format:
        result.update(max_rel_loss_diff=loss_difference("grouped"), max_rel_adapter_diff=adapter_difference("grouped"),
                      noise_floor_loss=loss_difference("peft_eager_experts"),
                      noise_floor_adapter=adapter_difference("peft_eager_experts"))
        bound_loss = max(bound_loss, 2 * result["noise_floor_loss"])
        bound_weights = max(bound_weights, 2 * result["noise_floor_adapter"])
    result["bounds"] = {"loss": bound_loss, "adapter": bound_weights}
    result["passed"] = bool(same_format and grouped["grouped"] > 0 and grouped["peft"] == 0 and moved > 0
                            and result.get("max_rel_loss_diff", float("inf")) <= bound_loss
                            and result.get("max_rel_adapter_diff", float("inf")) <= bound_weights)
    return result


def throughput(variant: str, tiny: bool, warmup: int, timed: int) -> dict:
    import torch
    from transformers import TrainerCallback

    seq = 128 if tiny else 2048
    batch = 4
    steps = warmup + timed
    _, overrides = VARIANTS[variant]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run, trainer, _ = trainer_for([*overrides, "--per_device_train_batch_size", str(batch)], tiny, None,
                                  lambda vocab: random_rows(batch * steps, seq, vocab, seed=1), steps, seq)
    marks: list[float] = []

    class Timer(TrainerCallback):
        def _mark(self):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

        def on_train_begin(self, args, state, control, **kwargs):
            self._mark()

        def on_step_end(self, args, state, control, **kwargs):
            self._mark()

    trainer.add_callback(Timer())
    trainer.train()
    times = [b - a for a, b in itertools.pairwise(marks)][warmup:]
    tokens = batch * seq
    result = {
        "variant": variant, "label": VARIANTS[variant][0], "grouped_modules": grouped_modules(trainer),
        "gradient_checkpointing": run.training.gradient_checkpointing,
        "torch_compile": "CompileInsideCheckpoints" in str(trainer.callback_handler.callbacks) or
                         run.training.torch_compile,
        "seq": seq, "batch": batch, "timed_steps": len(times), "first_step_s": marks[1] - marks[0],
        "step_time_median_s": statistics.median(times), "tokens_per_s": tokens / statistics.median(times),
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "command": "scripts/sft.py --config recipes/gpt-oss-20b/lora.yaml " + " ".join(overrides),
    }
    if torch.cuda.is_available():
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    return result


# ---- Parent ----------------------------------------------------------------------------------------------------------


def run_child(args, what: str, timeout: float) -> dict:
    result_file = Path(args.out) / f"{what}.json"
    command = [sys.executable, __file__, "--out", args.out, "--child", what, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--timed", str(args.timed), *(["--tiny"] if args.tiny else [])]
    start = time.monotonic()
    try:
        completed = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
        failure = None if completed.returncode == 0 else f"exit {completed.returncode}: {completed.stderr[-2500:]}"
    except subprocess.TimeoutExpired as error:
        failure = f"timed out after {timeout:.0f} s: {(error.stderr or b'')[-1500:]!r}"
    (Path(args.out) / f"{what}.log").write_text("" if failure is None else failure)
    if failure is None and result_file.is_file():
        result = json.loads(result_file.read_text())
    else:
        result = {"variant": what, "error": failure or "no result written"}
    result["wall_s"] = round(time.monotonic() - start, 1)
    print(f"[expert_lora_check] {what}: {'ok' if 'error' not in result else 'FAILED'} in {result['wall_s']} s",
          flush=True)
    return result


def table(report: dict) -> str:
    lines = []
    check = report.get("numerics")
    if check:
        if "error" in check:
            lines.append(f"numerics: FAILED ({check['error'][:300]})")
        else:
            lines.append(
                f"numerics ({check['model']}, {check['steps']} steps): max relative loss difference "
                f"{check.get('max_rel_loss_diff', float('nan')):.2e}, adapter "
                f"{check.get('max_rel_adapter_diff', float('nan')):.2e} (peft's path with eager experts, the noise "
                f"floor: {check.get('noise_floor_loss', float('nan')):.2e}, "
                f"{check.get('noise_floor_adapter', float('nan')):.2e}; bounds {check['bounds']['loss']:.1e}, "
                f"{check['bounds']['adapter']:.1e}); same adapter format: "
                f"{check['same_adapter_keys_and_shapes']}; {'PASSED' if check['passed'] else 'FAILED'}")
    results = report.get("throughput", [])
    if results:
        reference = {r["variant"]: r.get("tokens_per_s") for r in results}
        header = "| variant | tokens/s | vs attention only | peak GiB | step s (median) | first step s | grouped modules |"
        lines += ["", header, "|---|---|---|---|---|---|---|"]
        for r in results:
            if "error" in r:
                last_line = (r["error"].strip().splitlines() or [""])[-1][:120]
                lines.append(f"| {r['variant']} | failed: {last_line} | | | | | |")
                continue
            base = reference.get("attention_gc" if r["gradient_checkpointing"] else "attention")
            ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "—"
            peak = f"{r['peak_gib']:.1f}" if "peak_gib" in r else "—"
            lines.append(f"| {r['variant']}: {r['label']} | {r['tokens_per_s']:,.0f} | {ratio} | {peak} | "
                         f"{r['step_time_median_s']:.3f} | {r['first_step_s']:.1f} | {r['grouped_modules']} |")
    return "\n".join(lines)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "peft", "trl", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the JSON, the markdown table and the children's logs")
    parser.add_argument("--mode", choices=["all", "numerics", "throughput"], default="all")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"throughput variants, of {','.join(VARIANTS)}")
    parser.add_argument("--tiny", action="store_true", help="the tiny GPT-OSS on CPU (float32), to check the script runs")
    parser.add_argument("--steps", type=int, default=None, help="numerics steps (20; tiny 4)")
    parser.add_argument("--warmup", type=int, default=None, help="throughput warm-up steps, compilation included (3; tiny 1)")
    parser.add_argument("--timed", type=int, default=None, help="throughput timed steps (5; tiny 2)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole run; a variant that would "
                        "start past it is skipped, a running one is stopped at it")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 20)
    args.warmup = args.warmup or (1 if args.tiny else 3)
    args.timed = args.timed or (2 if args.tiny else 5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.child:
        if args.child == "numerics":
            result = numerics(args.tiny, args.steps)
        else:
            result = throughput(args.child, args.tiny, args.warmup, args.timed)
        (out / f"{args.child}.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    start = time.monotonic()
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "versions": versions(),
              "tiny": args.tiny}
    if args.mode in ("all", "numerics"):
        report["numerics"] = run_child(args, "numerics", args.budget - (time.monotonic() - start))
    if args.mode in ("all", "throughput"):
        report["throughput"] = []
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                parser.error(f"unknown variant {variant}; pick from {','.join(VARIANTS)}")
            remaining = args.budget - (time.monotonic() - start)
            if remaining < 30:
                report["throughput"].append({"variant": variant, "error": "skipped: out of --budget"})
                continue
            report["throughput"].append(run_child(args, variant, remaining))
    report["elapsed_s"] = round(time.monotonic() - start, 1)
    text = table(report)
    (out / "expert_lora_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "expert_lora_check.md").write_text(text + "\n")
    print(text, flush=True)
    return report


if __name__ == "__main__":
    main()
