"""Throughput benchmark: plain TRL `SFTTrainer` against this project's recipes, in one process, on the same data.

The real architectures (Llama-3.2-1B/3B, GPT-OSS-20B, from `finetune/model_configs`) are built with random bf16 weights
directly on the GPU (there is no hub): speed and memory do not depend on the weights' values. Each case runs
  plain_default  plain TRL with its defaults for that model (as measured in shared/gpu/README.md),
  plain_best     plain TRL with the best settings a careful user finds (README table),
  finetune       the recipe YAML exactly as shipped, parsed by `finetune.config.parse_args`,
  finetune_fast  the recipe plus the overrides this benchmark proposes as the new recipe defaults,
and reports steady-state tokens/s (device synchronised, steps after warm-up), MFU against 790 TFLOP/s, peak memory and
the loss after N steps. `--tiny` runs every case with tiny models on the CPU in seconds (tests/test_bench.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from finetune import attention

PEAK_FLOPS = 790e12  # bf16 dense matmul measured on one H200 (shared/gpu/README.md)
GIB = 2**30
RECIPES = Path(__file__).resolve().parent.parent / "recipes"
VARLEN_ATTENTION = attention.VARLEN_ATTENTION
_VARLEN_CHECK: dict = {}


def register_varlen_attention() -> dict:
    """Register `torch_varlen` (finetune.attention) and, on a GPU, check its kernel against the dense block-diagonal
    reference, forward and backward, once per process. Returns what was found."""
    attention.register()
    if _VARLEN_CHECK or not torch.cuda.is_available():
        return _VARLEN_CHECK or {"ok": None, "error": "no GPU: packed rows use the block-diagonal sdpa path"}
    try:
        torch.manual_seed(0)
        lengths = [5, 130, 64, 300]
        total, heads, kv_heads, dim = sum(lengths), 8, 2, 64
        cu = torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device="cuda")
        q = torch.randn(1, heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
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


# --------------------------------------------------------------------------------------------------------------------
# Cases


@dataclass
class Variant:
    key: str
    label: str
    recipe: str | None = None  # finetune variants: recipes/<recipe>
    overrides: list[str] = field(default_factory=list)  # recipe flags
    sft: dict = field(default_factory=dict)  # plain variants: SFTConfig kwargs
    model: dict = field(default_factory=dict)  # plain variants: attn/experts implementation
    lora: dict | None = None  # plain variants: LoraConfig kwargs
    profile: bool = False
    extra: bool = False  # run only when time is left after the main variants


@dataclass
class Case:
    key: str
    title: str
    arch: str
    method: str  # full | lora
    data: str  # fixed | chat
    seq: int
    variants: list[Variant]
    target: str = ""
    warmup: int = 4
    timed: int = 8


def _plain(batch, **sft):
    return {"per_device_train_batch_size": batch, "gradient_checkpointing": False, **sft}


LLAMA_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}
OSS_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
OSS_FAST = {"attn_implementation": "flex_attention", "experts_implementation": "grouped_mm"}
OSS_EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def gpu_cases() -> list[Case]:
    return [
        Case("llama1b_full", "Llama-3.2-1B full", "llama-3.2-1b", "full", "fixed", 2048, [
            Variant("plain_default", "sdpa, batch 8", sft=_plain(8)),
            Variant("plain_best", "liger, batch 16", sft=_plain(16, use_liger_kernel=True)),
            Variant("finetune", "recipe as shipped", "llama-3.2-1b/full.yaml"),
            Variant("finetune_fast", "recipe, batch 16", "llama-3.2-1b/full.yaml",
                    ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"], profile=True,
                    extra=True),
            Variant("finetune_compile", "recipe, batch 16, no liger, torch_compile", "llama-3.2-1b/full.yaml",
                    ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
                     "--use_liger_kernel", "false", "--torch_compile", "true"], extra=True),
        ], target=">= 70k tok/s and >= 1.1x plain best"),
        Case("llama1b_chat", "Llama-3.2-1B full, chat rows 50-4,000 tokens (real tok/s)", "llama-3.2-1b", "full", "chat",
             4096, [
            Variant("plain_default", "padded, sdpa, batch 8", sft=_plain(8, max_length=4096)),
            Variant("plain_best", "TRL packing (BFD, padding-free), sdpa, liger, batch 4",
                    sft=_plain(4, max_length=4096, packing=True, use_liger_kernel=True)),
            Variant("finetune", "recipe as shipped (packing, padding-free, varlen attention)", "llama-3.2-1b/full.yaml",
                    ["--max_length", "4096"]),
            Variant("finetune_fast", "recipe, batch 4", "llama-3.2-1b/full.yaml",
                    ["--max_length", "4096", "--per_device_train_batch_size", "4"], profile=True, extra=True),
        ], target=">= 57k real tok/s (0.9x fixed-length)"),
        Case("llama3b_lora", "Llama-3.2-3B LoRA r16 all-linear", "llama-3.2-3b", "lora", "fixed", 2048, [
            Variant("plain_default", "batch 8", sft=_plain(8), lora=LLAMA_LORA),
            Variant("plain_best", "liger, batch 8", sft=_plain(8, use_liger_kernel=True), lora=LLAMA_LORA),
            Variant("finetune", "recipe as shipped (torch_compile, lora_dropout 0)", "llama-3.2-3b/lora.yaml"),
            Variant("finetune_liger", "recipe + liger", "llama-3.2-3b/lora.yaml", ["--use_liger_kernel", "true"],
                    extra=True),
            Variant("finetune_eager", "recipe without torch_compile", "llama-3.2-3b/lora.yaml",
                    ["--torch_compile", "false"], extra=True),
            Variant("finetune_b16", "recipe, batch 16", "llama-3.2-3b/lora.yaml",
                    ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"], extra=True),
        ], target=">= 32k tok/s (1.3x plain best) and faster than full"),
        Case("llama3b_lora_chat", "Llama-3.2-3B LoRA, chat rows 50-1,950 tokens (real tok/s)", "llama-3.2-3b", "lora",
             "chat", 2048, [
            Variant("plain_best", "TRL packing (BFD, padding-free), sdpa, liger, batch 8",
                    sft=_plain(8, packing=True, use_liger_kernel=True), lora=LLAMA_LORA, extra=True),
            Variant("finetune", "recipe as shipped (packing, varlen attention, torch_compile)", "llama-3.2-3b/lora.yaml",
                    extra=True),
            Variant("finetune_eager", "recipe without torch_compile", "llama-3.2-3b/lora.yaml",
                    ["--torch_compile", "false"], extra=True),
        ], target="the recipe's defaults pay on real data too", warmup=12, timed=8),
        Case("gptoss20b_lora", "GPT-OSS-20B LoRA r16", "gpt-oss-20b", "lora", "fixed", 2048, [
            Variant("plain_default", "attention LoRA; eager attention, eager experts, batch 2",
                    sft=_plain(2), lora=OSS_LORA, model={"attn_implementation": "eager", "experts_implementation": "eager"}),
            Variant("plain_best", "attention LoRA; grouped_mm + flex, batch 4", sft=_plain(4), lora=OSS_LORA,
                    model=OSS_FAST),
            Variant("finetune", "recipe as shipped (attention LoRA, torch_compile)", "gpt-oss-20b/lora.yaml"),
            Variant("finetune_48g", "recipe + checkpointing (<= 48 GiB)", "gpt-oss-20b/lora.yaml",
                    ["--gradient_checkpointing", "true"]),
            Variant("finetune_experts", "recipe + LoRA on the experts (lora_target_parameters), checkpointing",
                    "gpt-oss-20b/lora.yaml", ["--gradient_checkpointing", "true",
                                              "--lora_target_parameters", *OSS_EXPERT_PARAMETERS], extra=True),
        ], target=">= 20k tok/s; >= 15k within 48 GiB", warmup=3, timed=5),
        Case("llama3b_full", "Llama-3.2-3B full", "llama-3.2-3b", "full", "fixed", 2048, [
            Variant("plain_default", "sdpa, batch 4", sft=_plain(4)),
            Variant("plain_best", "liger, batch 8", sft=_plain(8, use_liger_kernel=True)),
            Variant("finetune", "recipe as shipped", "llama-3.2-3b/full.yaml"),
            Variant("finetune_fast", "recipe, batch 8", "llama-3.2-3b/full.yaml",
                    ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"], extra=True),
        ], target=">= 25k tok/s"),
        Case("llama1b_32k", "Llama-3.2-1B full, 32k sequence", "llama-3.2-1b", "full", "fixed", 32768, [
            Variant("plain_default", "TRL defaults (checkpointing), batch 1",
                    sft=_plain(1, gradient_checkpointing=True, max_length=32768)),
            Variant("plain_best", "checkpointing + liger, batch 1",
                    sft=_plain(1, gradient_checkpointing=True, use_liger_kernel=True, max_length=32768)),
            Variant("finetune", "recipe (no checkpointing, liger), batch 1", "llama-3.2-1b/full.yaml",
                    ["--max_length", "32768", "--per_device_train_batch_size", "1"]),
        ], target=">= 31k tok/s", warmup=2, timed=5),
    ]


def tiny_cases() -> list[Case]:
    """Every GPU case, with tiny models, short rows and two timed steps: the same code paths on a CPU."""
    cases = []
    for case in gpu_cases():
        seq = {"fixed": 32, "chat": 128}[case.data]
        case = dataclasses.replace(case, seq=seq, warmup=1, timed=2)
        for variant in case.variants:
            variant.profile = False
            variant.sft = {k: (seq if k == "max_length" else v) for k, v in variant.sft.items()}
            variant.sft["per_device_train_batch_size"] = min(variant.sft.get("per_device_train_batch_size", 2), 4)
            flags = list(variant.overrides)
            for i, flag in enumerate(flags[:-1]):
                if flag == "--max_length":
                    flags[i + 1] = str(seq)
                if flag == "--per_device_train_batch_size":
                    flags[i + 1] = str(min(int(flags[i + 1]), 4))
            variant.overrides = flags
        cases.append(case)
    return cases


# --------------------------------------------------------------------------------------------------------------------
# Data


def fixed_rows(n_rows: int, seq: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(n_rows, seq)).tolist()


def chat_lengths(n_rows: int, seed: int, low: int = 50, high: int = 4000, median: int = 550) -> np.ndarray:
    """Log-normal lengths like chat data: median ~550, clipped to [50, 4000]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.exp(rng.normal(math.log(median), 0.95, size=n_rows)), low, high).astype(int)


def chat_rows(n_rows: int, vocab: int, seed: int, high: int = 4000) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    scale = high / 4000
    lengths = np.maximum(chat_lengths(n_rows, seed) * scale, 8).astype(int)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in lengths]


def learnable_rows(n_rows: int, vocab: int, seed: int, low: int = 64, high: int = 1024) -> list[list[int]]:
    """Rows that repeat a short random motif: a model learns them within a few steps, so the loss moves."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        motif = rng.integers(0, min(vocab, 4096), size=int(rng.integers(4, 12)))
        length = int(rng.integers(low, high))
        rows.append(np.resize(motif, length).tolist())
    return rows


def make_dataset(rows):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": rows})


# --------------------------------------------------------------------------------------------------------------------
# Models


def family(arch: str) -> str:
    return "gpt-oss" if arch.startswith("gpt-oss") else "llama"


def architecture(arch: str, tiny: bool, tokenizer):
    from finetune import tiny as tiny_models
    from finetune.architectures import load_architecture

    if tiny:
        return tiny_models.tiny_config(family(arch), tokenizer)
    config = load_architecture(arch)
    config.pad_token_id = tokenizer.pad_token_id if config.pad_token_id is None else config.pad_token_id
    return config


def build_model(config, attn: str, experts: str | None, dtype, device: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "attn_implementation": attn}
    if experts and config.model_type == "gpt_oss":
        kwargs["experts_implementation"] = experts
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.config.use_cache = False
    return model


def flops_per_token(model, config, method: str, seq: int) -> float:
    """README formula: 6N (full) or 4N (LoRA) + 6 * layers * d_attn * seq, N = parameters active per token, the input
    embedding excluded (a lookup) unless tied to the LM head; experts counted top_k / num_experts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embed = base.get_input_embeddings().weight
    tied = base.get_output_embeddings() is not None and base.get_output_embeddings().weight is embed
    n_experts = getattr(config, "num_local_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    active = 0.0
    seen = set()
    for name, parameter in base.named_parameters():
        if id(parameter) in seen or "lora_" in name:
            continue
        seen.add(id(parameter))
        if parameter is embed and not tied:
            continue
        count = parameter.numel()
        if n_experts and ".experts." in name:
            count = count * top_k / n_experts
        active += count
    d_attn = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    return (6 if method == "full" else 4) * active + 6 * config.num_hidden_layers * d_attn * seq


@contextlib.contextmanager
def isolated_patches():
    """Liger patches transformers' modeling modules globally (RMSNorm/MLP classes, rope): undo them after a variant."""
    import importlib

    modules = [importlib.import_module(f"transformers.models.{name}.modeling_{name}") for name in ("llama", "gpt_oss")]
    saved = []
    for module in modules:
        classes = {name: dict(obj.__dict__) for name, obj in vars(module).items() if isinstance(obj, type)}
        saved.append((module, dict(vars(module)), classes))
    try:
        yield
    finally:
        for module, names, classes in saved:
            for name in list(vars(module)):
                if name not in names:
                    delattr(module, name)
            for name, value in names.items():
                setattr(module, name, value)
            for name, attributes in classes.items():
                cls = names[name]
                for attribute, value in attributes.items():
                    if attribute.startswith("__") or cls.__dict__.get(attribute) is value:
                        continue
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(cls, attribute, value)


# --------------------------------------------------------------------------------------------------------------------
# Timing


class StepTimer:
    """Device-synchronised wall time and real tokens of every optimizer step; an optional profile after the timed ones."""

    def __init__(self, trainer, warmup: int, timed: int, profile_steps: int = 0, profile_path: Path | None = None):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer.last = time.perf_counter()

            def on_step_begin(self, args, state, control, **kwargs):
                if timer.profile_steps and state.global_step == timer.warmup + timer.timed and timer.profiler is None:
                    timer._start_profile()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                now = time.perf_counter()
                tokens = int(getattr(trainer, "_total_train_tokens", 0))
                timer.steps.append((now - timer.last, tokens - timer.tokens))
                timer.last, timer.tokens = now, tokens
                if timer.profiler is not None and state.global_step >= timer.warmup + timer.timed + timer.profile_steps:
                    timer._stop_profile()

        self.callback = _Callback()
        self.warmup, self.timed = warmup, timed
        self.profile_steps, self.profile_path = profile_steps, profile_path
        self.profiler = None
        self.profile_summary = None
        self.steps: list[tuple[float, int]] = []
        self.last, self.tokens = 0.0, 0

    @staticmethod
    def _sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _start_profile(self):
        from torch.profiler import ProfilerActivity, profile

        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.profiler.__enter__()

    def _stop_profile(self):
        profiler, self.profiler = self.profiler, None
        profiler.__exit__(None, None, None)
        self.profile_summary = summarize_profile(profiler, self.profile_steps, self.profile_path)

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
    events = profiler.key_averages()
    kernels = []
    for event in events:
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


# --------------------------------------------------------------------------------------------------------------------
# Running one variant


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


def common_flags(steps: int, output_dir: str) -> list[str]:
    return ["--output_dir", output_dir, "--max_steps", str(steps), "--logging_steps", "1", "--save_strategy", "no",
            "--eval_strategy", "no", "--report_to", "none", "--assistant_only_loss", "false", "--disable_tqdm", "true"]


def finetune_run_config(variant: Variant, steps: int, output_dir: str, seq: int, tiny: bool):
    from finetune.config import parse_args

    argv = ["--config", str(RECIPES / variant.recipe), *common_flags(steps, output_dir), *variant.overrides]
    if "--max_length" not in variant.overrides and seq != 2048:
        argv += ["--max_length", str(seq)]
    if tiny:
        argv.append("--tiny")
    return parse_args(argv), argv


def plain_sft_config(variant: Variant, steps: int, output_dir: str, seq: int, tiny: bool):
    from trl import SFTConfig

    kwargs = {"max_length": seq, "bf16": True, **variant.sft}
    kwargs.update(output_dir=output_dir, max_steps=steps, logging_steps=1, save_strategy="no", eval_strategy="no",
                  report_to="none", disable_tqdm=True, seed=42)
    if tiny:
        kwargs.update(bf16=False, use_cpu=True, use_liger_kernel=False, optim="adamw_torch")
    return SFTConfig(**kwargs)


def run_variant(case: Case, variant: Variant, out_dir: Path, tiny: bool) -> dict:
    from peft import LoraConfig

    from finetune import tiny as tiny_models
    from finetune.model import lora_config as recipe_lora_config
    from finetune.model import model_init_kwargs

    device = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    tokenizer = tiny_models.build_tiny_tokenizer(family(case.arch))
    config = architecture(case.arch, tiny, tokenizer)
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
        run = None
        training = plain_sft_config(variant, steps, output_dir, case.seq, tiny)
        attn = variant.model.get("attn_implementation", "sdpa")
        experts = variant.model.get("experts_implementation")
        if tiny:
            from finetune.cpu import CPU_ATTENTION, CPU_EXPERTS

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
    if attn == VARLEN_ATTENTION:
        result["varlen"] = register_varlen_attention()
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
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()  # memory a previous variant left behind is not this one's
        result["baseline_gib"] = baseline / GIB
    start = time.perf_counter()
    model = build_model(config, attn, experts, dtype, device)
    dataset = make_dataset(rows)
    if variant.recipe:
        from finetune.train import build_trainer

        trainer = build_trainer(run, model, tokenizer, dataset, None)
    else:
        from trl import SFTTrainer

        trainer = SFTTrainer(model=model, args=training, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=peft_config)
    profile_path = out_dir / f"profile_{case.key}_{variant.key}.json" if variant.profile else None
    timer = StepTimer(trainer, warmup, timed, profile_steps, profile_path)
    trainer.add_callback(timer.callback)
    fpt = flops_per_token(trainer.model, config, case.method, case.seq)
    from torch._dynamo.utils import counters

    graphs_before = counters["stats"]["unique_graphs"]
    trainer.train()
    result["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs_before
    result.update(timer.summary())
    result["setup_s"] = round(time.perf_counter() - start - sum(t for t, _ in timer.steps), 1)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    result["loss_first"], result["loss_last"], result["losses"] = losses[0], losses[-1], losses
    result["tokens_per_s"] = result["tokens_per_s_median" if case.data == "fixed" else "tokens_per_s_mean"]
    result["flops_per_token"] = fpt
    result["mfu"] = result["tokens_per_s"] * fpt / PEAK_FLOPS if case.data == "fixed" else None
    if torch.cuda.is_available():
        result["peak_gib"] = (torch.cuda.max_memory_allocated() - baseline) / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    if timer.profile_summary:
        result["profile"] = timer.profile_summary
    if not tiny:
        with contextlib.suppress(Exception):
            trainer.accelerator.free_memory()
    del trainer, model, timer
    return result


def release_memory():
    # dynamo's caches of the last model go too: without this a second compiled GPT-OSS in one process fails with
    # NameError `__compiled_fn_...` (H200, torch 2.11; reproduced on CPU with torch 2.13)
    torch._dynamo.reset()
    if torch.cuda.is_available():  # on the CPU (tiny mode) the models are small: skip the slow full collection
        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------------------------
# Numerics check: the fast path and the plain path give the same losses (bf16 rounding aside)


def numerics_check(out_dir: Path, tiny: bool, steps: int = 20) -> dict:
    """Same small model (Llama-3.2-1B with 4 layers), same weights, same rows in the same order, 20 steps:
    plain path (padded batches, sdpa, no liger, non-fused AdamW) vs the fast path (padding-free batches with varlen
    attention, liger kernels, fused AdamW) and, on a GPU, the compiled path of the LoRA and GPT-OSS recipes (the fast
    path with torch_compile's regional compilation instead of liger). Returns the loss curves and each path's largest
    relative difference from the plain one."""
    from trl import SFTConfig, SFTTrainer

    from finetune import tiny as tiny_models
    from finetune.train import compile_per_layer

    tokenizer = tiny_models.build_tiny_tokenizer("llama")
    config = architecture("llama-3.2-1b", tiny, tokenizer)
    if not tiny:
        config.num_hidden_layers = 4
    high = 256 if tiny else 1024
    rows = learnable_rows(8 * steps, config.vocab_size, seed=3, low=16, high=high)
    varlen = register_varlen_attention()
    curves = {}
    paths = {
        "plain": ({"optim": "adamw_torch"}, "sdpa"),
        "fast": ({"optim": "adamw_torch_fused", "padding_free": True, "use_liger_kernel": True}, VARLEN_ATTENTION),
    }
    if not tiny:
        paths["compiled"] = ({"optim": "adamw_torch_fused", "padding_free": True, "torch_compile": True},
                             VARLEN_ATTENTION)
    for name, (extra, attn) in paths.items():
        with isolated_patches():
            kwargs = dict(output_dir=tempfile.mkdtemp(prefix=f"bench-numerics-{name}-"), max_steps=steps,
                          per_device_train_batch_size=8, learning_rate=3e-4, lr_scheduler_type="constant",
                          warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                          gradient_checkpointing=False, max_length=None, bf16=not tiny, seed=42, **extra)
            if tiny:
                kwargs.update(use_cpu=True, use_liger_kernel=False, optim="adamw_torch")
            model = build_model(config, attn, None, torch.float32 if tiny else torch.bfloat16,
                                "cpu" if tiny else "cuda", seed=0)
            training = SFTConfig(**kwargs)
            trainer = SFTTrainer(model=model, args=training, train_dataset=make_dataset(rows),
                                 processing_class=tokenizer, callbacks=compile_per_layer(training))
            trainer.train()
            curves[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            del trainer, model
            release_memory()
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


# --------------------------------------------------------------------------------------------------------------------
# Reporting


def versions() -> dict:
    import accelerate
    import peft
    import transformers
    import trl

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "peft": peft.__version__, "accelerate": accelerate.__version__}
    with contextlib.suppress(ImportError):
        from importlib.metadata import version


        info["liger_kernel"] = version("liger_kernel")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _fmt(value, spec=",.0f", missing="—"):
    return missing if value is None else format(value, spec)


def _throughput_cell(result: dict | None) -> str:
    if result is None:
        return "—"
    if "error" in result:
        return f"failed ({result['error'][:60]})"
    mfu = f", MFU {result['mfu']:.2f}" if result.get("mfu") is not None else ""
    memory = f", {result['peak_gib']:.1f} GiB" if result.get("peak_gib") is not None else ""
    return f"{result['tokens_per_s']:,.0f}{mfu}{memory}"


def markdown(report: dict) -> str:
    lines = [f"# Benchmark: plain TRL vs finetune recipes ({report['mode']})", "",
             f"Date: {report['date']}. " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".", "",
             "| case | plain TRL default | plain TRL best | finetune (recipe as shipped) | finetune fast | "
             "recipe / best | fast / best | fast / default | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        results = {r["variant"]: r for r in case["results"]}
        best_fast = max((r for r in case["results"] if r["variant"].startswith("finetune") and "error" not in r
                         and not r["variant"].startswith("finetune_48g")),
                        key=lambda r: r["tokens_per_s"], default=None)
        plain_best = results.get("plain_best", {}).get("tokens_per_s")
        plain_default = results.get("plain_default", {}).get("tokens_per_s")
        fast = best_fast["tokens_per_s"] if best_fast else None
        fast_cell = f"{_throughput_cell(best_fast)} ({best_fast['variant']})" if best_fast else "—"
        ratio_best = f"{fast / plain_best:.2f}x" if fast and plain_best else "—"
        recipe = results.get("finetune", {}).get("tokens_per_s")
        ratio_recipe = f"{recipe / plain_best:.2f}x" if recipe and plain_best else "—"
        ratio_default = f"{fast / plain_default:.2f}x" if fast and plain_default else "—"
        plain_cells = " | ".join(_throughput_cell(results.get(variant))
                                 for variant in ("plain_default", "plain_best", "finetune"))
        lines.append(f"| {case['title']} | {plain_cells} | {fast_cell} | {ratio_recipe} | {ratio_best} | {ratio_default} | "
                     f"{case['target']} |")
    lines += ["", "## Every variant", "",
              "| case | variant | settings | tokens/s | MFU | peak GiB | loss first → last | step s |",
              "|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        for r in case["results"]:
            if "error" in r:
                lines.append(f"| {case['key']} | {r['variant']} | {r['label']} | failed: {r['error'][:160]} | | | | |")
                continue
            lines.append(
                f"| {case['key']} | {r['variant']} | {r['label']} | {r['tokens_per_s']:,.0f} | {_fmt(r.get('mfu'), '.2f')}"
                f" | {_fmt(r.get('peak_gib'), '.1f')} | {r['loss_first']:.3f} → {r['loss_last']:.3f} | "
                f"{r['step_time_median_s']:.3f} |")
    numerics = report.get("numerics")
    if numerics:
        lines += ["", "## Numerics check", ""]
        if "error" in numerics:
            lines.append(f"failed: {numerics['error']}")
        else:
            lines.append(f"{numerics['model']}, {numerics['steps']} steps: max relative loss difference "
                         f"{numerics['max_rel_diff']:.4f} (final {numerics['final_rel_diff']:.4f}); "
                         f"{'PASSED' if numerics['passed'] else 'FAILED'}.")
            lines.append("")
            lines.append("plain: " + " ".join(f"{x:.3f}" for x in numerics["plain"]))
            lines.append("")
            lines.append("fast:  " + " ".join(f"{x:.3f}" for x in numerics["fast"]))
            if "compiled" in numerics:
                lines.append("")
                lines.append(f"compiled (max relative difference {numerics['max_rel_diff_compiled']:.4f}): "
                             + " ".join(f"{x:.3f}" for x in numerics["compiled"]))
    lines += ["", "## Commands (finetune rows)", ""]
    for case in report["cases"]:
        for r in case["results"]:
            if r.get("command"):
                lines.append(f"- {case['key']} / {r['variant']}: `{r['command']}`")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> None:
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "bench.md").write_text(markdown(report))


# --------------------------------------------------------------------------------------------------------------------


def rows_for(case: Case, rows_per_step: int, steps: int, vocab: int, tiny: bool):
    if case.data == "fixed":
        return fixed_rows(rows_per_step * (steps + 1), case.seq, vocab, seed=1)
    # Chat rows average ~860 tokens: enough rows for padded batches and for packed bins of max_length tokens
    n = max(rows_per_step * (steps + 1), rows_per_step * (steps + 1) * case.seq // 700)
    return chat_rows(n, vocab, seed=2, high=case.seq - 96 if not tiny else case.seq - 8)


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
    if (args.isolate or not args.tiny and not args.no_isolate) and args.phase == "all":
        return _isolated_main(args, argv if argv is not None else sys.argv[1:])

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.tiny:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(1)
        args.no_extra = True  # compiled/flex variants are GPU explorations
    started = time.perf_counter()
    deadline = started + args.budget if args.budget else None
    cases = select_variants(tiny_cases() if args.tiny else gpu_cases(), args.variants, parser)
    if args.cases:
        by_key = {case.key: case for case in cases}
        all_keys = [case.key for case in gpu_cases()]
        unknown = [key for key in args.cases.split(",") if key not in all_keys]
        if unknown:
            parser.error(f"unknown case {unknown[0]}; the cases are {', '.join(all_keys)}")
        cases = [by_key[key] for key in args.cases.split(",") if key in by_key]
    report = {"mode": "tiny CPU" if args.tiny else ("GPU smoke" if args.smoke else "GPU"),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "versions": versions(),
              "argv": sys.argv, "cases": []}
    if not args.tiny:
        report["varlen"] = register_varlen_attention()
        print(f"[bench] varlen attention: {report['varlen']}", flush=True)

    main_first = [(case, v) for case in cases for v in case.variants if not v.extra]
    extras = [] if args.no_extra else [(case, v) for case in cases for v in case.variants if v.extra]
    if args.phase == "main":
        extras, args.no_numerics = [], True
    elif args.phase == "extra":
        main_first, args.no_numerics = [], True
    elif args.phase == "numerics":
        main_first, extras = [], []
    entries = {case.key: {"key": case.key, "title": case.title, "target": case.target, "results": []} for case in cases}
    report["cases"] = list(entries.values())

    def remaining():
        return None if deadline is None else deadline - time.perf_counter()

    numerics_done = args.no_numerics
    for case, variant in main_first + extras:
        if not numerics_done and variant.extra:
            numerics_done = True
            _run_numerics(report, out_dir, args, remaining)
        left = remaining()
        if left is not None and left < (25 if args.tiny else 45):
            entries[case.key]["results"].append({"variant": variant.key, "label": variant.label,
                                                 "error": "skipped: benchmark time budget spent"})
            continue
        if args.smoke:
            case = dataclasses.replace(case, warmup=1, timed=2)
        print(f"[bench] {case.key} / {variant.key}: {variant.label}", flush=True)
        try:
            limit = None if left is None else max(left - 15, 10)
            if not args.tiny:
                limit = min(limit or 240, 240)
            with isolated_patches(), time_limit(limit), _smoke_layers(args.smoke):
                result = run_variant(case, variant, out_dir, args.tiny)
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
        release_memory()
        if torch.cuda.is_available():
            result["left_behind_gib"] = torch.cuda.memory_allocated() / GIB
        entries[case.key]["results"].append(result)
        write_report(report, out_dir)
    if not numerics_done:
        _run_numerics(report, out_dir, args, remaining)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(report, out_dir)
    print(markdown(report), flush=True)
    return report


def select_variants(cases: list[Case], keys: str, parser: argparse.ArgumentParser | None = None) -> list[Case]:
    """The cases with only the variants named in `keys`, as `variant` (in every case) or `case:variant` (all when
    empty); cases left without a variant are dropped."""
    if not keys:
        return cases
    wanted = set(keys.split(","))
    known = {variant.key for case in cases for variant in case.variants}
    if parser is not None and {key.split(":")[-1] for key in wanted} - known:
        unknown = sorted({key.split(":")[-1] for key in wanted} - known)[0]
        parser.error(f"unknown variant {unknown}; the variants are {', '.join(sorted(known))}")
    kept = [dataclasses.replace(case, variants=[v for v in case.variants if {v.key, f"{case.key}:{v.key}"} & wanted])
            for case in cases]
    return [case for case in kept if case.variants]


def compiles(variant: Variant) -> bool:
    """Whether the variant trains under torch.compile (its flags, else its recipe)."""
    if variant.sft.get("torch_compile"):
        return True
    if not variant.recipe:
        return False
    if "--torch_compile" in variant.overrides:
        return variant.overrides[variant.overrides.index("--torch_compile") + 1] == "true"
    from finetune.plan import read_recipe

    return bool(read_recipe(RECIPES / variant.recipe).get("torch_compile"))


def process_groups(variants: list[Variant], extra: bool) -> list[list[Variant]]:
    """The main (or extra) variants in the groups that share a child process. A compiled variant gets one of its
    own: a second compiled GPT-OSS in one process fails with dynamo's NameError `__compiled_fn_...` (H200 with
    torch 2.11, and CPU with 2.13), and on the GPU the failed run's memory stayed allocated for every later variant."""
    groups: list[list[Variant]] = []
    shared: list[Variant] = []
    for variant in (v for v in variants if v.extra == extra):
        if compiles(variant):
            groups.append([variant])
        else:
            shared.append(variant)
    return ([shared] if shared else []) + groups


def _isolated_main(args, argv: list[str]) -> dict:
    """Run each case's variants in child processes (process_groups): main variants, the numerics check, extras."""
    import subprocess

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    deadline = started + args.budget if args.budget else None
    all_cases = tiny_cases() if args.tiny else gpu_cases()
    keys = args.cases.split(",") if args.cases else [case.key for case in all_cases]
    cases = {case.key: case for case in select_variants(all_cases, args.variants)}
    keys = [key for key in keys if key in cases]
    if args.tiny:
        args.no_extra = True
    jobs = [(key, "main", group) for key in keys for group in process_groups(cases[key].variants, extra=False)]
    if not args.no_numerics:
        jobs.append(("", "numerics", []))
    if not args.no_extra:
        jobs += [(key, "extra", group) for key in keys for group in process_groups(cases[key].variants, extra=True)]
    report = {"mode": "tiny CPU" if args.tiny else ("GPU smoke" if args.smoke else "GPU"), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "versions": {}, "argv": sys.argv, "cases": []}
    entries = {key: {"key": key, "title": cases[key].title, "target": cases[key].target, "results": []} for key in keys}
    report["cases"] = list(entries.values())
    passthrough = [a for a in ("--smoke", "--tiny") if getattr(args, a[2:])]
    for number, (key, phase, group) in enumerate(jobs):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left < 45:
            for variant in group:
                entries[key]["results"].append({"variant": variant.key, "label": variant.label,
                                                "error": "skipped: benchmark time budget spent"})
            continue
        part = out_dir / "parts" / f"{number:02d}-{key or 'numerics'}-{phase}"
        selection = ",".join(f"{key}:{variant.key}" for variant in group)
        command = [sys.executable, "-m", "finetune.bench", "--out", str(part), "--phase", phase, "--no-isolate",
                   *passthrough, "--cases", key or keys[0], *(["--variants", selection] if selection else [])]
        if left is not None:
            command += ["--budget", str(int(left - 10))]
        print(f"[bench] {key or 'numerics'} ({phase}): {' '.join(command[1:])}", flush=True)
        try:
            completed = subprocess.run(command, timeout=None if left is None else left - 5)
            rc = completed.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        child = {}
        if (part / "bench.json").is_file():
            child = json.loads((part / "bench.json").read_text())
        report["versions"] = report["versions"] or child.get("versions", {})
        report.setdefault("varlen", child.get("varlen"))
        if phase == "numerics":
            report["numerics"] = child.get("numerics") or {"error": f"numerics child exited with {rc}"}
        else:
            done = {r["variant"]: r for c in child.get("cases", []) for r in c["results"]}
            for variant in group:
                entries[key]["results"].append(done.get(variant.key) or {
                    "case": key, "variant": variant.key, "label": variant.label,
                    "error": f"case process exited with {rc} before this variant finished"})
        write_report(report, out_dir)
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_report(report, out_dir)
    print(markdown(report), flush=True)
    return report


def _run_numerics(report, out_dir, args, remaining):
    left = remaining()
    print("[bench] numerics check", flush=True)
    try:
        with isolated_patches(), time_limit(None if args.tiny else min(left or 120, 120)):
            report["numerics"] = numerics_check(out_dir, args.tiny, steps=4 if args.tiny else 20)
        print(f"[bench]   max rel diff {report['numerics']['max_rel_diff']:.4f}", flush=True)
    except Exception as error:
        report["numerics"] = {"error": f"{type(error).__name__}: {error}"[:400]}
        print(f"[bench]   FAILED {traceback.format_exc()[-3000:]}", flush=True)
    release_memory()
    write_report(report, out_dir)


@contextlib.contextmanager
def _smoke_layers(enabled: bool):
    """GPU smoke test: the real architectures cut to 2 layers, to check every code path in seconds."""
    if not enabled:
        yield
        return
    from finetune import architectures

    original = architectures.load_architecture

    def two_layers(name):
        config = original(name)
        config.num_hidden_layers = 2
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:2]
        return config

    architectures.load_architecture = two_layers
    try:
        yield
    finally:
        architectures.load_architecture = original


if __name__ == "__main__":
    main()
