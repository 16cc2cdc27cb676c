"""What the throughput benchmark runs: for each case (architecture, method, data, sequence length) the plain-TRL
variants and the recipe variants, and which of them share a child process."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from finetune.config.files import read_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


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
    memory_cap_gib: float | None = None  # GPU: the allocator's limit (torch.cuda.set_per_process_memory_fraction)


@dataclass
class Case:
    key: str
    title: str
    arch: str
    method: str  # full | lora
    data: str  # fixed | chat | markov (learnable, models.markov_rows)
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
OSS_ATTENTION_ONLY = ["--lora_target_parameters", "none"]
CHECKPOINTED = ["--gradient_checkpointing", "true"]
OFFLOADED = [*CHECKPOINTED, "--activation_offloading", "true"]  # the layer inputs wait in pinned CPU memory
SMALL_CARD_GIB = 22  # what PyTorch can use of a 24 GB card (A10, L4: 22.5 GiB) less the CUDA context
# What a full recipe adds for FP8 (its header says so): float8 linears, each layer compiled, liger off (its kernels
# break inductor's graphs)
FP8 = ["--fp8", "true", "--torch_compile", "true", "--use_liger_kernel", "false"]


def gpu_cases() -> list[Case]:
    return [
        Case("llama1b_full", "Llama-3.2-1B full", "llama-3.2-1b", "full", "fixed", 2048, [
            Variant("plain_default", "sdpa, batch 8", sft=_plain(8)),
            Variant("plain_best", "liger, batch 16", sft=_plain(16, use_liger_kernel=True)),
            Variant("finetune", "recipe as shipped", "llama-3.2-1b/full.yaml"),
            Variant("finetune_fp8", "recipe + fp8 (float8 linears, torch_compile, no liger)", "llama-3.2-1b/full.yaml",
                    FP8),
            Variant("finetune_fp8_b16", "recipe + fp8, batch 16", "llama-3.2-1b/full.yaml",
                    [*FP8, "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"], profile=True,
                    extra=True),
            Variant("finetune_fp8_b32", "recipe + fp8, batch 32", "llama-3.2-1b/full.yaml",
                    [*FP8, "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "1"], extra=True),
            Variant("finetune_fast", "recipe, batch 16", "llama-3.2-1b/full.yaml",
                    ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"], profile=True,
                    extra=True),
            Variant("finetune_compile", "recipe, batch 16, no liger, torch_compile", "llama-3.2-1b/full.yaml",
                    ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1",
                     "--use_liger_kernel", "false", "--torch_compile", "true"], extra=True),
        ], target=">= 70k tok/s and >= 1.1x plain best; fp8 >= 72k"),
        Case("llama1b_chat", "Llama-3.2-1B full, chat rows 50-4,000 tokens (real tok/s)", "llama-3.2-1b", "full",
             "chat", 4096, [
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
            Variant("finetune_offload", "recipe + checkpointing + activation offloading", "llama-3.2-3b/lora.yaml",
                    OFFLOADED),
            Variant("finetune_24g", f"recipe + checkpointing, GPU memory capped at {SMALL_CARD_GIB} GiB (a 24 GB card)",
                    "llama-3.2-3b/lora.yaml", CHECKPOINTED, memory_cap_gib=SMALL_CARD_GIB),
            Variant("finetune_offload_only", "recipe + activation offloading, no checkpointing",
                    "llama-3.2-3b/lora.yaml", ["--activation_offloading", "true"], extra=True),
            Variant("finetune_budget1", "recipe, compiled layers saving what inductor saves by default "
                    "(activation_memory_budget 1)", "llama-3.2-3b/lora.yaml", ["--activation_memory_budget", "1"],
                    extra=True),
            Variant("finetune_budget06", "recipe, compiled layers saving at most 0.6 of their activations",
                    "llama-3.2-3b/lora.yaml", ["--activation_memory_budget", "0.6"], extra=True),
            Variant("finetune_fp8", "recipe + fp8 (frozen base layers in float8)", "llama-3.2-3b/lora.yaml",
                    ["--fp8", "true"], extra=True),
            Variant("finetune_fp8_budget1", "recipe + fp8, activation_memory_budget 1", "llama-3.2-3b/lora.yaml",
                    ["--fp8", "true", "--activation_memory_budget", "1"], extra=True),
            Variant("finetune_fp8_offload", "recipe + fp8 + checkpointing + activation offloading",
                    "llama-3.2-3b/lora.yaml", ["--fp8", "true", *OFFLOADED], extra=True),
        ], target=">= 31.5k tok/s within 42 GiB; offloaded checkpoints >= 24k within 8.5 GiB (Unsloth: 22.7k, "
                  f"8.3 GiB); runs in {SMALL_CARD_GIB} GiB"),
        Case("llama3b_lora_chat", "Llama-3.2-3B LoRA, chat rows 50-1,950 tokens (real tok/s)", "llama-3.2-3b", "lora",
             "chat", 2048, [
            Variant("plain_best", "TRL packing (BFD, padding-free), sdpa, liger, batch 8",
                    sft=_plain(8, packing=True, use_liger_kernel=True), lora=LLAMA_LORA, extra=True),
            Variant("finetune", "recipe as shipped (packing, varlen attention, torch_compile)",
                    "llama-3.2-3b/lora.yaml", extra=True),
            Variant("finetune_eager", "recipe without torch_compile", "llama-3.2-3b/lora.yaml",
                    ["--torch_compile", "false"], extra=True),
        ], target="the recipe's defaults pay on real data too", warmup=12, timed=8),
        Case("gptoss20b_lora", "GPT-OSS-20B LoRA r16", "gpt-oss-20b", "lora", "fixed", 2048, [
            Variant("plain_default", "attention LoRA; eager attention, eager experts, batch 2",
                    sft=_plain(2), lora=OSS_LORA,
                    model={"attn_implementation": "eager", "experts_implementation": "eager"}),
            Variant("plain_best", "attention LoRA; grouped_mm + flex, batch 4", sft=_plain(4), lora=OSS_LORA,
                    model=OSS_FAST),
            Variant("finetune", "recipe, attention LoRA (torch_compile)", "gpt-oss-20b/lora.yaml", OSS_ATTENTION_ONLY),
            Variant("finetune_48g", "recipe, attention LoRA, checkpointing (<= 48 GiB)", "gpt-oss-20b/lora.yaml",
                    [*OSS_ATTENTION_ONLY, *CHECKPOINTED]),
            Variant("finetune_offload", "recipe, attention LoRA, checkpointing + activation offloading",
                    "gpt-oss-20b/lora.yaml", [*OSS_ATTENTION_ONLY, *OFFLOADED]),
        ], target=">= 20k tok/s; >= 15k within 48 GiB; offloaded checkpoints >= 17k (30 GiB asked: below the 39 GiB of "
                  "bf16 weights)", warmup=3, timed=5),
        Case("gptoss20b_expert_lora", "GPT-OSS-20B LoRA r16 on attention + all experts", "gpt-oss-20b", "lora", "fixed",
             2048, [
            Variant("plain_best", "peft target_parameters; grouped_mm + flex, batch 4", sft=_plain(4),
                    lora={**OSS_LORA, "lora_dropout": 0.0, "target_parameters": OSS_EXPERT_PARAMETERS}, model=OSS_FAST),
            Variant("finetune_peft", "recipe, experts through peft's path", "gpt-oss-20b/lora.yaml",
                    ["--expert_lora_kernel", "peft"]),
            Variant("finetune", "recipe as shipped: experts through grouped GEMMs", "gpt-oss-20b/lora.yaml"),
            Variant("reference_attention", "recipe, attention only (the speed to match)", "gpt-oss-20b/lora.yaml",
                    OSS_ATTENTION_ONLY),
            Variant("finetune_gc", "recipe, checkpointing", "gpt-oss-20b/lora.yaml", ["--gradient_checkpointing", "true"]),
            Variant("reference_attention_gc", "recipe, attention only, checkpointing", "gpt-oss-20b/lora.yaml",
                    [*OSS_ATTENTION_ONLY, "--gradient_checkpointing", "true"]),
            Variant("finetune_peft_gc", "recipe, experts through peft's path, checkpointing", "gpt-oss-20b/lora.yaml",
                    ["--expert_lora_kernel", "peft", "--gradient_checkpointing", "true"], extra=True),
            Variant("finetune_offload", "recipe, checkpointing + activation offloading", "gpt-oss-20b/lora.yaml",
                    OFFLOADED, extra=True),
        ], target=">= 21k tok/s within 70 GiB; >= 16k within 45 GiB with checkpointing", warmup=3, timed=5),
        Case("llama3b_full", "Llama-3.2-3B full", "llama-3.2-3b", "full", "fixed", 2048, [
            Variant("plain_default", "sdpa, batch 4", sft=_plain(4)),
            Variant("plain_best", "liger, batch 8", sft=_plain(8, use_liger_kernel=True)),
            Variant("finetune", "recipe as shipped", "llama-3.2-3b/full.yaml"),
            Variant("finetune_fp8", "recipe + fp8 (float8 linears, torch_compile, no liger)", "llama-3.2-3b/full.yaml",
                    FP8),
            Variant("finetune_fast", "recipe, batch 8", "llama-3.2-3b/full.yaml",
                    ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"], extra=True),
            Variant("finetune_fp8_b8", "recipe + fp8, batch 8", "llama-3.2-3b/full.yaml",
                    [*FP8, "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"], extra=True),
        ], target=">= 25k tok/s; fp8 >= 31k"),
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
    return [tiny_case(case) for case in gpu_cases()]


def tiny_case(case: Case, warmup: int = 1, timed: int = 2) -> Case:
    """The case with tiny models' row lengths and batches, few steps, and nothing compiled."""
    seq = {"fixed": 32, "chat": 128, "markov": 32}[case.data]
    case = dataclasses.replace(case, seq=seq, warmup=warmup, timed=timed)
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
            # off on a CPU: inductor's C++ build would take minutes, there is nothing to offload without a GPU
            # (finetune.cpu), and no float8 matmul to measure (nor a need for torchao)
            if flag in ("--torch_compile", "--activation_offloading", "--fp8"):
                flags[i + 1] = "false"
        variant.overrides = flags
    return case


def fp8_parity_case(steps: int, seq: int, batch: int, learning_rate: float, method: str = "full") -> Case:
    """Llama-3.2-1B trained by its `method` recipe (full or lora) as shipped (bf16) and with the FP8 flags, from the
    same random weights on the same Markov-chain rows in the same order, one micro-batch per step; only the learning
    rate is raised, as the weights start random rather than pretrained."""
    flags = ["--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", "1",
             "--learning_rate", str(learning_rate)]
    recipe = f"llama-3.2-1b/{method}.yaml"
    title = {"full": "Llama-3.2-1B full", "lora": "Llama-3.2-1B LoRA"}[method]
    return Case("fp8_parity", f"{title}, bf16 recipe vs fp8, same weights and rows", "llama-3.2-1b", method,
                "markov", seq, [Variant("bf16", "recipe as shipped", recipe, flags),
                                Variant("fp8", "recipe + fp8", recipe, flags + FP8)],
                warmup=2, timed=steps - 2)


def select(cases: list[Case], case_keys: str, variant_keys: str) -> list[Case]:
    """The cases named in `case_keys` (all when empty), each with only the variants named in `variant_keys`, as
    `variant` (in every case) or `case:variant` (all when empty); cases left without a variant are dropped."""
    by_key = {case.key: case for case in cases}
    keys = case_keys.split(",") if case_keys else list(by_key)
    wanted = set(variant_keys.split(",")) if variant_keys else set()
    known = {variant.key for case in cases for variant in case.variants}
    if unknown := [key for key in keys if key not in by_key]:
        raise ValueError(f"unknown case {unknown[0]}; the cases are {', '.join(by_key)}")
    if unknown := sorted({key.split(":")[-1] for key in wanted} - known):
        raise ValueError(f"unknown variant {unknown[0]}; the variants are {', '.join(sorted(known))}")
    chosen = [dataclasses.replace(by_key[key], variants=[
        v for v in by_key[key].variants if not wanted or {v.key, f"{key}:{v.key}"} & wanted]) for key in keys]
    return [case for case in chosen if case.variants]


def compiles(variant: Variant) -> bool:
    """Whether the variant trains under torch.compile (its flags, else its recipe)."""
    if variant.sft.get("torch_compile"):
        return True
    if not variant.recipe:
        return False
    if "--torch_compile" in variant.overrides:
        return variant.overrides[variant.overrides.index("--torch_compile") + 1] == "true"
    return bool(read_recipe(str(RECIPES / variant.recipe)).get("torch_compile"))


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


