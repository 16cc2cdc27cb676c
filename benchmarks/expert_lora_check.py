"""LoRA on GPT-OSS's experts: the grouped path (finetune/models/expert_lora.py) agrees with peft's target_parameters path.

The GPT-OSS-20B architecture cut to 2 layers, random bf16 weights on the GPU, the same rows in the same order, 20
training steps through each path: loss curves and adapter weights, which must agree within bf16 rounding (and have the
same keys and shapes: peft's adapter format). The trainer is the one `scripts/sft.py` builds:
`finetune.sft.configure` on the recipe plus overrides, `finetune.run.trainer.build_trainer`. The speed of each path is
the benchmark's case `gptoss20b_expert_lora` (`scripts/bench.py --cases gptoss20b_expert_lora`).

    python benchmarks/expert_lora_check.py --out DIR            # GPU
    python benchmarks/expert_lora_check.py --out DIR --tiny     # CPU: the tiny GPT-OSS in float32, to try it

Writes DIR/expert_lora_check.json and DIR/expert_lora_check.md, and prints the verdict.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"
EXPERTS = ["--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def learnable_rows(n_rows: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Rows repeating a short random motif: learnt within a few steps, so the loss moves and the adapters train."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [np.resize(rng.integers(0, min(vocab, 4096), size=int(rng.integers(4, 12))), length).tolist()
            for _ in range(n_rows)]


def trainer_for(overrides: list[str], tiny: bool, layers: int | None, make_rows, steps: int, seq: int):
    """The recipe's trainer, as scripts/sft.py builds it, around a random-weight model of the recipe's architecture,
    on the rows make_rows(vocabulary size) returns."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from finetune.families import load_architecture
    from finetune.models import tiny as tiny_models
    from finetune.run.model import model_init_kwargs
    from finetune.run.trainer import build_trainer
    from finetune.sft import configure

    output_dir = tempfile.mkdtemp(prefix="expert-lora-check-")
    argv = ["--config", str(RECIPE), "--output_dir", output_dir, "--max_steps", str(steps), "--max_length", str(seq),
            "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
            "--assistant_only_loss", "false", "--disable_tqdm", "true", "--gradient_accumulation_steps", "1",
            *(["--tiny"] if tiny else []), *overrides]
    run = configure(argv)
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
    from finetune.models.expert_lora import GroupedExpertsLora

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


# ---- Parent ----------------------------------------------------------------------------------------------------------


def run_child(args, timeout: float) -> dict:
    """The check in a child process, whose memory is its own, stopped at the time budget."""
    result_file = Path(args.out) / "numerics.json"
    command = [sys.executable, __file__, "--out", args.out, "--child", "--steps", str(args.steps),
               *(["--tiny"] if args.tiny else [])]
    start = time.monotonic()
    try:
        completed = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=max(timeout, 1))
        failure = None if completed.returncode == 0 else f"exit {completed.returncode}: {completed.stderr[-2500:]}"
    except subprocess.TimeoutExpired as error:
        failure = f"timed out after {timeout:.0f} s: {(error.stderr or b'')[-1500:]!r}"
    (Path(args.out) / "numerics.log").write_text("" if failure is None else failure)
    if failure is None and result_file.is_file():
        result = json.loads(result_file.read_text())
    else:
        result = {"error": failure or "no result written"}
    result["wall_s"] = round(time.monotonic() - start, 1)
    return result


def summary(check: dict) -> str:
    if "error" in check:
        return f"numerics: FAILED ({check['error'][:300]})"
    return (f"numerics ({check['model']}, {check['steps']} steps): max relative loss difference "
            f"{check.get('max_rel_loss_diff', float('nan')):.2e}, adapter "
            f"{check.get('max_rel_adapter_diff', float('nan')):.2e} (peft's path with eager experts, the noise "
            f"floor: {check.get('noise_floor_loss', float('nan')):.2e}, "
            f"{check.get('noise_floor_adapter', float('nan')):.2e}; bounds {check['bounds']['loss']:.1e}, "
            f"{check['bounds']['adapter']:.1e}); same adapter format: "
            f"{check['same_adapter_keys_and_shapes']}; {'PASSED' if check['passed'] else 'FAILED'}")


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
    parser.add_argument("--out", required=True, help="folder for the JSON, the summary and the child's log")
    parser.add_argument("--tiny", action="store_true", help="the tiny GPT-OSS on CPU (float32), to check the script runs")
    parser.add_argument("--steps", type=int, default=None, help="training steps (20; tiny 4)")
    parser.add_argument("--budget", type=float, default=300, help="seconds before the check is stopped")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 20)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if args.child:
        result = numerics(args.tiny, args.steps)
        (out / "numerics.json").write_text(json.dumps(result, indent=2) + "\n")
        return result

    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "versions": versions(),
              "tiny": args.tiny, "numerics": run_child(args, args.budget)}
    text = summary(report["numerics"])
    (out / "expert_lora_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "expert_lora_check.md").write_text(text + "\n")
    print(text, flush=True)
    return report


if __name__ == "__main__":
    main()
