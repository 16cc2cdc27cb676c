"""Throughput benchmark: plain TRL `SFTTrainer` against this project's recipes, in one process, on the same data.

The real architectures (Llama-3.2-1B/3B, GPT-OSS-20B) are built with random bf16 weights on the GPU
(benchmarks/models.py). Each case (benchmarks/cases.py) runs
  plain_default  plain TRL with its defaults for that model,
  plain_best     plain TRL with the best settings a careful user finds (README table),
  finetune       the recipe YAML exactly as shipped, configured by `finetune.sft.configure`,
  finetune_fast  the recipe plus the overrides this benchmark proposes as the new recipe defaults,
and reports steady-state tokens/s (device synchronised, steps after warm-up), MFU against 790 TFLOP/s, peak memory and
the loss after N steps. `--tiny` runs every case with tiny models on the CPU in seconds (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import models
from benchmarks.cases import RECIPES, Case, Variant, gpu_cases, process_groups, select, tiny_cases
from benchmarks.report import GIB, markdown, versions, write_report
from finetune.models import attention

PEAK_FLOPS = 790e12  # bf16 dense matmul measured on one H200
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
_VARLEN_CHECK: dict = {}


def register_varlen_attention(device: str) -> dict:
    """Register `torch_varlen` (finetune.models.attention) and, on a GPU, check its kernel against the dense block-diagonal
    reference, forward and backward, once per process. Returns what was found."""
    attention.register()
    if _VARLEN_CHECK or device != "cuda":
        return _VARLEN_CHECK or {"ok": None, "error": "no GPU: packed rows use the block-diagonal sdpa path"}
    try:
        torch.manual_seed(0)
        lengths = [5, 130, 64, 300]
        total, heads, kv_heads, dim = sum(lengths), 8, 2, 64
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (torch.randn(1, n, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for n in (heads, kv_heads, kv_heads))
        out = attention.varlen_attention(q, k, v, cu, max(lengths), dim**-0.5)
        out.float().square().sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        ref = attention.block_diagonal_attention(q.float(), k.float(), v.float(), cu, dim**-0.5)
        ref.square().sum().backward()
        err = (out.float() - ref).abs().max().item()
        grad_err = max(((g.float() - t.grad.float()).abs().max() / t.grad.float().abs().max()).item()
                       for g, t in zip(grads, (q, k, v)))
        _VARLEN_CHECK.update(ok=err < 0.05 and grad_err < 0.05, max_abs_err=err, max_rel_grad_err=grad_err)
    except Exception as error:  # reported in the results, the bench goes on
        _VARLEN_CHECK.update(ok=False, error=f"{type(error).__name__}: {error}"[:400])
    return _VARLEN_CHECK




class StepTimer:
    """Device-synchronised wall time, real tokens and (on a GPU) allocated memory at the start of every optimizer
    step; an optional profile after the timed ones."""

    def __init__(self, trainer, warmup: int, timed: int, device: str, profile_steps: int = 0,
                 profile_path: Path | None = None):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer.last = time.perf_counter()

            def on_step_begin(self, args, state, control, **kwargs):
                if timer.cuda:  # the caching allocator counts on the host: no synchronisation needed
                    timer.step_start_allocated.append(torch.cuda.memory_allocated())
                if timer.profile_steps and state.global_step == timer.warmup + timer.timed and timer.profiler is None:
                    from torch.profiler import ProfilerActivity, profile

                    timer.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    timer.profiler.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                now = time.perf_counter()
                tokens = int(getattr(trainer, "_total_train_tokens", 0))
                timer.steps.append((now - timer.last, tokens - timer.tokens))
                timer.last, timer.tokens = now, tokens
                if timer.profiler is not None and state.global_step >= timer.warmup + timer.timed + timer.profile_steps:
                    profiler, timer.profiler = timer.profiler, None
                    profiler.__exit__(None, None, None)
                    timer.profile_summary = summarize_profile(profiler, timer.profile_steps, timer.profile_path)

        self.callback = _Callback()
        self.warmup, self.timed, self.cuda = warmup, timed, device == "cuda"
        self.profile_steps, self.profile_path = profile_steps, profile_path
        self.profiler = self.profile_summary = None
        self.steps: list[tuple[float, int]] = []
        self.step_start_allocated: list[int] = []
        self.last, self.tokens = 0.0, 0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def summary(self) -> dict:
        timed = self.steps[self.warmup : self.warmup + self.timed]
        if not timed:
            raise RuntimeError(f"only {len(self.steps)} steps ran; nothing after the {self.warmup} warm-up steps")
        times = [t for t, _ in timed]
        tokens = [n for _, n in timed]
        rates = [n / t for t, n in timed if t > 0]
        return {
            "timed_steps": len(timed),
            "step_time_median_s": statistics.median(times),
            "tokens_per_step_mean": sum(tokens) / len(tokens),
            "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_mean": sum(tokens) / sum(times),
        }


def _kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in ("flash", "fmha", "attention", "flex", "varlen", "triton_tem_fused")):
        return "attention"
    if any(key in lowered for key in ("gemm", "cutlass", "nvjet", "xmma", "sm90", "cublas", "grouped_mm", "matmul")):
        return "matmul"
    if any(key in lowered for key in ("memcpy", "memset")):
        return "copy"
    if any(key in lowered for key in ("liger", "triton")):
        return "triton (fused)"
    return "other elementwise/reduction"


def summarize_profile(profiler, steps: int, path: Path | None) -> dict:
    kernels = []
    for event in profiler.key_averages():
        device_time = getattr(event, "self_device_time_total", None)
        if device_time is None:
            device_time = getattr(event, "self_cuda_time_total", 0)
        if device_time and getattr(event, "device_type", None) is not None and "CUDA" in str(event.device_type):
            kernels.append((event.key, device_time / 1e3 / steps, event.count // max(steps, 1)))
    kernels.sort(key=lambda row: -row[1])
    total = sum(ms for _, ms, _ in kernels) or 1.0
    categories: dict[str, float] = {}
    for name, ms, _ in kernels:
        categories[_kernel_category(name)] = categories.get(_kernel_category(name), 0.0) + ms
    summary = {
        "gpu_ms_per_step": total,
        "share": {k: round(v / total, 3) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:120], "ms_per_step": round(ms, 2), "calls_per_step": calls}
                        for name, ms, calls in kernels[:15]],
    }
    if path is not None:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary




class VariantTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise VariantTimeout(f"stopped after {seconds:.0f} s (time limit)")

    previous = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def restoring_modeling_modules():
    """Put transformers' Llama and GPT-OSS modeling modules back as they were after one variant.

    `use_liger_kernel` (liger's `apply_liger_kernel_to_llama`) replaces names in these modules for every model built
    afterwards, not only in the model it is given: `apply_rotary_pos_emb`, the RMSNorm and MLP classes, even class
    attributes such as `LlamaForCausalLM.forward`. The variants that are not compiled share one child process per
    case (a process each would pay the imports and the CUDA start-up twice as often, and the GPU run would no longer
    fit its time budget), so a plain variant after a liger one would otherwise run liger's kernels."""
    modules = [importlib.import_module(f"transformers.models.{name}.modeling_{name}") for name in ("llama", "gpt_oss")]
    saved = [(module, dict(vars(module)), {name: dict(obj.__dict__) for name, obj in vars(module).items()
                                           if isinstance(obj, type)}) for module in modules]
    try:
        yield
    finally:
        for module, names, classes in saved:
            for name in set(vars(module)) - set(names):
                delattr(module, name)
            for name, value in names.items():
                setattr(module, name, value)
            for name, attributes in classes.items():
                for attribute, value in attributes.items():
                    if not attribute.startswith("__") and names[name].__dict__.get(attribute) is not value:
                        with contextlib.suppress(AttributeError, TypeError):
                            setattr(names[name], attribute, value)


@contextlib.contextmanager
def memory_capped(cap_gib: float | None, device: str):
    """The caching allocator limited to `cap_gib` (an allocation past it fails with OutOfMemoryError), as on a smaller
    card; lifted afterwards for the next variant of the process."""
    if not cap_gib or device != "cuda":
        yield
        return
    torch.cuda.set_per_process_memory_fraction(cap_gib * GIB / torch.cuda.get_device_properties(0).total_memory)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def planned_gib(case: Case, variant: Variant, config) -> float:
    """finetune.planner's estimate of the allocated peak of a recipe variant, as `finetune plan --config RECIPE FLAGS`
    makes it, for this case's architecture and sequence length."""
    from finetune.config.files import parse_overrides, read_recipe
    from finetune.planner import architecture, memory, setup

    values = read_recipe(str(RECIPES / variant.recipe), {"max_length": case.seq} | parse_overrides(variant.overrides))
    architecture = architecture.architecture_from_config(config.to_dict(), case.arch)
    return memory.estimate(architecture, setup.setup_from_recipe(values), "ddp", 1).allocated / GIB


def common_flags(steps: int, output_dir: str) -> list[str]:
    return ["--output_dir", output_dir, "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no",
            "--eval_strategy", "no", "--report_to", "none", "--assistant_only_loss", "false", "--disable_tqdm", "true"]


def finetune_run_config(variant: Variant, steps: int, output_dir: str, seq: int, tiny: bool):
    """The recipe configured as a run configures it (finetune.sft.configure), and the command line that runs it. A
    tiny run is on the CPU even beside a GPU: it gets the values a recipe gets on a machine without one (the command
    line's flags still win)."""
    from finetune.config.files import read_recipe
    from finetune.models.cpu import cpu_overrides

    argv = ["--config", str(RECIPES / variant.recipe), *common_flags(steps, output_dir), *variant.overrides]
    if "--max_length" not in variant.overrides and seq != 2048:
        argv += ["--max_length", str(seq)]
    cpu_flags = []
    if tiny:
        argv.append("--tiny")
        for key, value in cpu_overrides(read_recipe(str(RECIPES / variant.recipe))).items():
            cpu_flags += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    from finetune.sft import configure

    return configure(cpu_flags + argv), argv


def plain_sft_config(variant: Variant, steps: int, output_dir: str, seq: int, tiny: bool):
    from trl import SFTConfig

    kwargs = {"max_length": seq, "bf16": True, **variant.sft}
    kwargs.update(output_dir=output_dir, max_steps=steps, logging_steps=1, save_strategy="no", eval_strategy="no",
                  report_to="none", disable_tqdm=True, seed=42)
    if tiny:
        kwargs.update(bf16=False, use_cpu=True, use_liger_kernel=False, optim="adamw_torch")
    return SFTConfig(**kwargs)


def rows_for(case: Case, rows_per_step: int, steps: int, vocab: int, tiny: bool):
    if case.data == "fixed":
        return models.fixed_rows(rows_per_step * (steps + 1), case.seq, vocab, seed=1)
    if case.data == "markov":
        return models.markov_rows(rows_per_step * (steps + 1), case.seq, vocab, seed=4)
    # Chat rows average ~860 tokens: enough rows for padded batches and for packed bins of max_length tokens
    n = max(rows_per_step * (steps + 1), rows_per_step * (steps + 1) * case.seq // 700)
    return models.chat_rows(n, vocab, seed=2, high=case.seq - 96 if not tiny else case.seq - 8)


def run_variant(case: Case, variant: Variant, out_dir: Path, tiny: bool, layers: int | None = None) -> dict:
    from peft import LoraConfig

    from finetune.models import tiny as tiny_models
    from finetune.run.model import lora_config as recipe_lora_config
    from finetune.run.model import model_init_kwargs

    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    tokenizer = tiny_models.build_tiny_tokenizer(models.family(case.arch))
    config = models.architecture(case.arch, tokenizer, tiny, layers)
    steps = case.warmup + case.timed + (2 if variant.profile else 0)  # rescaled below for gradient accumulation
    output_dir = tempfile.mkdtemp(prefix=f"bench-{case.key}-{variant.key}-")
    result = {"case": case.key, "variant": variant.key, "label": variant.label}

    if variant.recipe:
        run, argv = finetune_run_config(variant, steps, output_dir, case.seq, tiny)
        kwargs = model_init_kwargs(run, run.model.model_name_or_path)
        attn, experts = kwargs.get("attn_implementation") or "sdpa", kwargs.get("experts_implementation")
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(str(kwargs.get("dtype")), dtype)
        peft_config = recipe_lora_config(run)
        training = run.training
        shown = [f"recipes/{variant.recipe}" if a.startswith(str(RECIPES)) else a for a in argv]
        shown = [f"outputs/bench-{case.key}-{variant.key}" if a == output_dir else a for a in shown]
        result["command"] = "scripts/sft.py " + " ".join(shown)
    else:
        training = plain_sft_config(variant, steps, output_dir, case.seq, tiny)
        attn = variant.model.get("attn_implementation", "sdpa")
        experts = variant.model.get("experts_implementation")
        if tiny:
            from finetune.models.cpu import CPU_ATTENTION, CPU_EXPERTS

            attn, experts = CPU_ATTENTION.get(attn, attn), CPU_EXPERTS.get(experts, experts)
        peft_config = LoraConfig(task_type="CAUSAL_LM", **variant.lora) if variant.lora else None
    # Gradient accumulation makes a step several micro-batches: fewer steps, the same number of micro-batches
    ga = training.gradient_accumulation_steps
    floor = (1, 2) if tiny else (2, 3)
    warmup, timed = max(floor[0], math.ceil(case.warmup / ga)), max(floor[1], math.ceil(case.timed / ga))
    profile_steps = 2 if variant.profile else 0
    training.max_steps = warmup + timed + profile_steps
    if "command" in result:
        result["command"] = result["command"].replace(f"--max_steps {steps} ", f"--max_steps {training.max_steps} ")
    rows = rows_for(case, training.per_device_train_batch_size * ga, training.max_steps, config.vocab_size, tiny)
    if attn == attention.VARLEN_ATTENTION:
        result["varlen"] = register_varlen_attention(device)
    result["settings"] = {
        "attn_implementation": attn, "experts_implementation": experts,
        "batch": training.per_device_train_batch_size, "grad_accum": training.gradient_accumulation_steps,
        "gradient_checkpointing": training.gradient_checkpointing, "use_liger_kernel": training.use_liger_kernel,
        "packing": training.packing, "padding_free": training.padding_free, "optim": str(training.optim),
        "lora": None if peft_config is None else {
            "r": peft_config.r, "dropout": peft_config.lora_dropout,
            "target_modules": sorted(peft_config.target_modules) if isinstance(peft_config.target_modules, set)
            else peft_config.target_modules,
            "target_parameters": getattr(peft_config, "target_parameters", None)},
        "torch_compile": training.torch_compile,
    }

    baseline = 0
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()  # memory a previous variant left behind is not this one's
        result["baseline_gib"] = baseline / GIB
    start = time.perf_counter()
    model = models.build_model(config, attn, experts, dtype, device)
    dataset = models.make_dataset(rows)
    if variant.recipe:
        from finetune.run.trainer import build_trainer

        trainer = build_trainer(run, model, tokenizer, dataset, None)
    else:
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=training, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)
    profile_path = out_dir / f"profile_{case.key}_{variant.key}.json" if variant.profile else None
    timer = StepTimer(trainer, warmup, timed, device, profile_steps, profile_path)
    trainer.add_callback(timer.callback)
    # The LM head module runs only when the full (tokens x vocabulary) logits are built; TRL's fused head reads its
    # weight in tiles instead
    head_calls = []
    trainer.model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    fpt = models.flops_per_token(trainer.model, config, case.method, case.seq)
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    with memory_capped(variant.memory_cap_gib, device):
        trainer.train()
    result["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
    result["lm_head_calls"] = len(head_calls)
    result.update(timer.summary())
    result["setup_s"] = round(time.perf_counter() - start - sum(t for t, _ in timer.steps), 1)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result["loss_first"], result["loss_last"], result["losses"] = losses[0], losses[-1], losses
    fixed_length = case.data != "chat"
    result["tokens_per_s"] = result["tokens_per_s_median" if fixed_length else "tokens_per_s_mean"]
    result["flops_per_token"] = fpt
    result["mfu"] = result["tokens_per_s"] * fpt / PEAK_FLOPS if fixed_length else None
    if device == "cuda":
        result["peak_gib"] = (torch.cuda.max_memory_allocated() - baseline) / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    if variant.recipe:
        result["planned_gib"] = planned_gib(case, variant, config)
        if result.get("peak_gib"):
            result["planned_over_peak"] = result["planned_gib"] / result["peak_gib"]
    if variant.memory_cap_gib:
        result["memory_cap_gib"] = variant.memory_cap_gib
    if timer.profile_summary:
        result["profile"] = timer.profile_summary
    if not tiny:
        with contextlib.suppress(Exception):
            trainer.accelerator.free_memory()
    del trainer, model, timer
    return result


def release_memory(device: str):
    # dynamo's caches of the last model go too: without this a second compiled GPT-OSS in one process fails with
    # NameError `__compiled_fn_...` (H200, torch 2.11; reproduced on CPU with torch 2.13)
    torch._dynamo.reset()
    if device == "cuda":  # on the CPU (tiny mode) the models are small: skip the slow full collection
        gc.collect()
        torch.cuda.empty_cache()




def numerics_check(out_dir: Path, tiny: bool, steps: int = 20) -> dict:
    """Same small model (Llama-3.2-1B with 4 layers), same weights, same rows in the same order, 20 steps:
    plain path (padded batches, sdpa, no liger, non-fused AdamW) vs the fast path (padding-free batches with varlen
    attention, liger kernels, fused AdamW) and, on a GPU, the compiled path of the LoRA and GPT-OSS recipes (the fast
    path with torch_compile's regional compilation instead of liger). Returns the loss curves and each path's largest
    relative difference from the plain one."""
    from trl import SFTConfig, SFTTrainer

    from finetune.models import tiny as tiny_models
    from finetune.models.compilation import compile_per_layer

    device = "cpu" if tiny else "cuda"
    tokenizer = tiny_models.build_tiny_tokenizer("llama")
    config = models.architecture("llama-3.2-1b", tokenizer, tiny, layers=4)
    rows = models.learnable_rows(8 * steps, config.vocab_size, seed=3, low=16, high=256 if tiny else 1024)
    varlen = register_varlen_attention(device)
    curves = {}
    paths = {
        "plain": ({"optim": "adamw_torch"}, "sdpa"),
        "fast": ({"optim": "adamw_torch_fused", "padding_free": True, "use_liger_kernel": True},
                 attention.VARLEN_ATTENTION),
    }
    if not tiny:
        paths["compiled"] = ({"optim": "adamw_torch_fused", "padding_free": True, "torch_compile": True},
                             attention.VARLEN_ATTENTION)
    for name, (extra, attn) in paths.items():
        with restoring_modeling_modules():
            kwargs = dict(output_dir=tempfile.mkdtemp(prefix=f"bench-numerics-{name}-"), max_steps=steps,
                          per_device_train_batch_size=8, learning_rate=3e-4, lr_scheduler_type="constant",
                          warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                          gradient_checkpointing=False, max_length=None, bf16=not tiny, seed=42, **extra)
            if tiny:
                kwargs.update(use_cpu=True, use_liger_kernel=False, optim="adamw_torch")
            model = models.build_model(config, attn, None, torch.float32 if tiny else torch.bfloat16, device, seed=0)
            if kwargs.get("torch_compile"):
                # regional compilation, as config.apply_to_process asks for a recipe's run without checkpointing
                os.environ.setdefault("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
            training = SFTConfig(**kwargs)
            trainer = SFTTrainer(model=model, args=training, train_dataset=models.make_dataset(rows),
                                 processing_class=tokenizer, callbacks=compile_per_layer(training))
            trainer.train()
            curves[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            del trainer, model
            release_memory(device)
    rel = {name: [abs(a - b) / abs(a) for a, b in zip(curves["plain"], curves[name])] for name in curves}
    result = {
        "model": "Llama-3.2-1B architecture, 4 layers" if not tiny else "tiny Llama",
        "steps": steps, **curves, "max_rel_diff": max(rel["fast"]), "final_rel_diff": rel["fast"][-1],
        "varlen": varlen,
        "passed": all(max(rel[name]) < 0.02 for name in curves) and (tiny or curves["plain"][-1] < curves["plain"][0]),
    }
    if "compiled" in curves:
        result["max_rel_diff_compiled"] = max(rel["compiled"])
        result["final_rel_diff_compiled"] = rel["compiled"][-1]
    (out_dir / "numerics.json").write_text(json.dumps(result, indent=2) + "\n")
    return result




def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, a few steps (tests, CI)")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/bench"), help="folder for bench.json/bench.md")
    parser.add_argument("--cases", default="", help="comma-separated case keys to run (default: all)")
    parser.add_argument("--budget", type=float, default=0, help="seconds for the whole run; later variants are skipped")
    parser.add_argument("--no-extra", action="store_true", help="skip the extra (exploratory) variants")
    parser.add_argument("--variants", default="",
                        help="comma-separated variants to run, as `variant` (in every case) or `case:variant`")
    parser.add_argument("--no-numerics", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="GPU smoke test: real widths, 2 layers, 1+2 steps")
    parser.add_argument("--no-isolate", action="store_true",
                        help="GPU: run every case in this process (default: one child process per case, so that "
                             "memory a failed variant leaves behind cannot starve the next case)")
    parser.add_argument("--isolate", action="store_true", help="child processes per case also with --tiny")
    parser.add_argument("--phase", default="all", choices=["all", "main", "extra", "numerics"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        cases = select(tiny_cases() if args.tiny else gpu_cases(), args.cases, args.variants)
    except ValueError as error:
        parser.error(str(error))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.no_extra = args.no_extra or args.tiny  # compiled/flex variants are GPU explorations
    started = time.perf_counter()
    deadline = started + args.budget if args.budget else None

    def remaining():
        return None if deadline is None else deadline - time.perf_counter()

    report = {"mode": "tiny CPU" if args.tiny else ("GPU smoke" if args.smoke else "GPU"),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": {}, "argv": sys.argv,
              "cases": [{"key": case.key, "title": case.title, "target": case.target, "results": []} for case in cases]}
    in_children = (args.isolate or not args.tiny and not args.no_isolate) and args.phase == "all"
    (run_in_children if in_children else run_here)(args, cases, report, out_dir, remaining)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(report, out_dir)
    print(markdown(report), flush=True)
    return report


def skipped(variant: Variant) -> dict:
    return {"variant": variant.key, "label": variant.label, "error": "skipped: benchmark time budget spent"}


def run_here(args, cases: list[Case], report: dict, out_dir: Path, remaining) -> None:
    """The chosen phase's variants in this process: main variants, the numerics check, extras."""
    device = "cpu" if args.tiny else "cuda"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.tiny:
        torch.set_num_threads(1)
    report["versions"] = versions(device)
    if not args.tiny:
        report["varlen"] = register_varlen_attention(device)
        print(f"[bench] varlen attention: {report['varlen']}", flush=True)
    chosen = [(case, variant) for case in cases for variant in case.variants]
    main_first = [] if args.phase in ("extra", "numerics") else [(c, v) for c, v in chosen if not v.extra]
    extras = [] if args.no_extra or args.phase in ("main", "numerics") else [(c, v) for c, v in chosen if v.extra]
    entries = {entry["key"]: entry["results"] for entry in report["cases"]}
    numerics_done = args.no_numerics or args.phase in ("main", "extra")
    for case, variant in main_first + extras:
        if not numerics_done and variant.extra:
            numerics_done = True
            run_numerics(report, out_dir, args.tiny, remaining)
        left = remaining()
        if left is not None and left < (25 if args.tiny else 45):
            entries[case.key].append(skipped(variant))
            continue
        if args.smoke:
            case = dataclasses.replace(case, warmup=1, timed=2)
        print(f"[bench] {case.key} / {variant.key}: {variant.label}", flush=True)
        try:
            limit = None if left is None else max(left - 15, 10)
            if not args.tiny:
                limit = min(limit or 240, 240)
            with restoring_modeling_modules(), time_limit(limit):
                result = run_variant(case, variant, out_dir, args.tiny, layers=2 if args.smoke else None)
            print(f"[bench]   {result['tokens_per_s']:,.0f} tok/s, mfu {result.get('mfu')}, "
                  f"peak {result.get('peak_gib')}, loss {result['loss_first']:.3f}->{result['loss_last']:.3f}",
                  flush=True)
        except BaseException as error:  # one failure must not lose the other cases
            if isinstance(error, KeyboardInterrupt):
                raise
            text = f"{type(error).__name__}: {str(error).strip()}"
            print(f"[bench]   FAILED {text[:2000]}\n{traceback.format_exc()[-3000:]}", flush=True)
            result = {"case": case.key, "variant": variant.key, "label": variant.label,
                      "error": " ".join(text.split())[:400]}
        release_memory(device)
        if device == "cuda":
            result["left_behind_gib"] = torch.cuda.memory_allocated() / GIB
        entries[case.key].append(result)
        write_report(report, out_dir)
    if not numerics_done:
        run_numerics(report, out_dir, args.tiny, remaining)


def run_numerics(report: dict, out_dir: Path, tiny: bool, remaining) -> None:
    left = remaining()
    print("[bench] numerics check", flush=True)
    try:
        with time_limit(None if tiny else min(left or 120, 120)):
            report["numerics"] = numerics_check(out_dir, tiny, steps=4 if tiny else 20)
        print(f"[bench]   max rel diff {report['numerics']['max_rel_diff']:.4f}", flush=True)
    except Exception as error:
        report["numerics"] = {"error": f"{type(error).__name__}: {error}"[:400]}
        print(f"[bench]   FAILED {traceback.format_exc()[-3000:]}", flush=True)
    release_memory("cpu" if tiny else "cuda")
    write_report(report, out_dir)


def run_in_children(args, cases: list[Case], report: dict, out_dir: Path, remaining) -> None:
    """Each case's variants in child processes (cases.process_groups): main variants, the numerics check, extras."""
    jobs = [(case.key, "main", group) for case in cases for group in process_groups(case.variants, extra=False)]
    if not args.no_numerics:
        jobs.append(("", "numerics", []))
    if not args.no_extra:
        jobs += [(case.key, "extra", group) for case in cases for group in process_groups(case.variants, extra=True)]
    entries = {entry["key"]: entry["results"] for entry in report["cases"]}
    passthrough = [flag for flag in ("--smoke", "--tiny") if getattr(args, flag[2:])]
    for number, (key, phase, group) in enumerate(jobs):
        left = remaining()
        if left is not None and left < 45:
            for variant in group:
                entries[key].append(skipped(variant))
            continue
        part = out_dir / "parts" / f"{number:02d}-{key or 'numerics'}-{phase}"
        selection = ",".join(f"{key}:{variant.key}" for variant in group)
        command = [sys.executable, str(BENCH_SCRIPT), "--out", str(part), "--phase", phase, "--no-isolate",
                   *passthrough, "--cases", key or cases[0].key, *(["--variants", selection] if selection else [])]
        if left is not None:
            command += ["--budget", str(int(left - 10))]
        print(f"[bench] {key or 'numerics'} ({phase}): {' '.join(command[1:])}", flush=True)
        try:
            rc = subprocess.run(command, timeout=None if left is None else left - 5).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        child = json.loads((part / "bench.json").read_text()) if (part / "bench.json").is_file() else {}
        report["versions"] = report["versions"] or child.get("versions", {})
        report.setdefault("varlen", child.get("varlen"))
        if phase == "numerics":
            report["numerics"] = child.get("numerics") or {"error": f"numerics child exited with {rc}"}
        else:
            done = {r["variant"]: r for c in child.get("cases", []) for r in c["results"]}
            for variant in group:
                entries[key].append(done.get(variant.key) or {
                    "case": key, "variant": variant.key, "label": variant.label,
                    "error": f"case process exited with {rc} before this variant finished"})
        write_report(report, out_dir)
