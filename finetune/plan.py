"""Which technique (DDP, FSDP2, ZeRO-2, ZeRO-3, ZeRO-3 offload) on which GPUs: a per-GPU peak-memory model.

`finetune plan --config recipes/X.yaml --gpus 8 --gpu H100` reads the recipe and the model's architecture (the
project's copy of the hub config, or a local folder's config.json), estimates the peak memory of one GPU for each
technique, and picks the cheapest one that fits with a safety margin. It reads the recipe as the run does
(`setup_from_recipe`: what the recipe leaves out is the run's default). Only json/yaml are imported here, never torch
or transformers: the answer comes in well under a second.

How the peak is built (all per GPU, bytes), see docs/planner.md for the measurements behind the constants:

    static    = weights + optimizer states (+ DDP gradient buckets, + fp32 master copies where the technique keeps them)
    backward  = max(activations saved by the forward + head gradients + one layer's backward transients,
                    all gradients                                      + one layer's backward transients)
    allocated = static + backward + gathered layers (FSDP/ZeRO-3) + LM-head loss buffers
    reserved  = allocated * allocator fragmentation
    per GPU   = reserved + fixed CUDA context / NCCL / cuBLAS overhead (outside PyTorch's allocator)

With activation offloading (TRL's `activation_offloading`) the saved activations wait in pinned CPU memory for the
backward: with checkpointing the layer inputs, all but the last few still copying out; without it every layer's
activations, one layer brought back at a time.

Gradients are not counted on top of the full activations: `optimizer.zero_grad(set_to_none=True)` frees them before
each step, and backward creates a layer's gradients while it frees that layer's saved activations, so the two grow
and shrink against each other and the peak is at one end of the backward pass.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import json
import math
import shlex
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from finetune import numbers
from finetune.config_files import parse_overrides, read_foreign_keys, read_recipe, refuse_unknown_keys
from finetune.errors import UserError
from finetune.families import FAMILIES, config_values, family_of_type

GIB = 1024**3

# name: (marketing GB, GiB that PyTorch can see on the card: nvidia-smi's total)
KNOWN_GPUS = {
    "A10": (24, 22.5),
    "L4": (24, 22.5),
    "A100-40": (40, 40.0),
    "A100-80": (80, 80.0),
    "H100": (80, 79.6),
    "H200": (141, 140.4),
    "B200": (180, 179.0),
}
GPU_ALIASES = {"A100": "A100-80", "A100-40GB": "A100-40", "A100-80GB": "A100-80", "H100-80": "H100", "H200-141": "H200"}

# ---- Calibration constants (each named for what it stands for; docs/planner.md shows the measurements) -------------
SAFETY_MARGIN = 0.90  # a plan fits when its per-GPU peak is at most 90% of the card: allocator spikes, longer rows
FRAGMENTATION = 1.04  # max_memory_reserved / max_memory_allocated of PyTorch's caching allocator (measured 1.00-1.14)
CUDA_CONTEXT_GIB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces: outside the allocator, per process
NCCL_GIB = 0.75  # NCCL communicator buffers when more than one process talks
CHUNKED_LOGPROB_TOKENS = 4096  # TRL's fused LM head: tokens per tile (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE)
CHUNKED_LOGPROB_VOCAB = 32768  # ... and vocabulary columns per tile (trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE)
OFFLOAD_STASH_TENSORS = 5  # TRL's activation offloading keeps this many tensors on the GPU while they copy to the CPU
DS_BUCKET_ELEMENTS_PER_H2 = 1.0  # accelerate's "auto" reduce_bucket_size = hidden^2 (ZeRO), in elements
DS_PREFETCH_PER_H2 = 0.9  # accelerate's "auto" stage3_prefetch_bucket_size = 0.9 * hidden^2

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- Architecture ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or one expert's width for MoE
    vocab: int
    tied_embeddings: bool
    attention_bias: bool = False
    experts: int = 0  # 0: dense MLP
    experts_per_token: int = 0
    family: str = "llama"  # whose layer layout (finetune/families.py); one built by hand is a Llama's

    @property
    def attn_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def architecture_from_config(values: dict, name: str = "") -> Architecture:
    """The few numbers the planner needs, from a config.json's values."""
    text = values.get("text_config", values)
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    experts = text.get("num_local_experts") or text.get("num_experts") or 0
    return Architecture(
        name=name or text.get("model_type", "model"),
        hidden=hidden,
        layers=text["num_hidden_layers"],
        heads=heads,
        kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or hidden // heads,
        intermediate=text.get("moe_intermediate_size") or text["intermediate_size"],
        vocab=text["vocab_size"],
        tied_embeddings=bool(values.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_bias=bool(text.get("attention_bias", False)),
        experts=experts,
        experts_per_token=(text.get("num_experts_per_tok") or text.get("experts_per_token") or 0) if experts else 0,
        family=family_of_type(values.get("model_type"), name or "config.json").name,
    )


def architecture_of(model_name_or_path: str, source: str = "command line") -> Architecture:
    """The planner's numbers for a known hub id or a local folder with a config.json. Never downloads. A model it
    cannot read is a UserError naming `source` (the recipe) or the config.json."""
    try:
        name, values = config_values(model_name_or_path)
    except json.JSONDecodeError as error:
        raise UserError(f"{model_name_or_path}/config.json: not valid JSON at line {error.lineno}; fix the syntax "
                        f"there.") from None
    except ValueError as error:
        raise UserError(f"{source}: the planner cannot read `model_name_or_path: {model_name_or_path}` "
                        f"({str(error).rstrip('.')}); give a local folder holding the model's config.json, or pass "
                        f"--config_file to `finetune launch` to choose the technique yourself.") from None
    try:
        return architecture_from_config(values, name)
    except KeyError as missing:
        raise UserError(f"{model_name_or_path}/config.json: no `{missing.args[0]}`, which the planner needs for a "
                        f"decoder-only language model; give the folder of such a model.") from None


# ---- Parameter counts --------------------------------------------------------------------------------------------
def attention_linears(a: Architecture) -> dict[str, tuple[int, int]]:
    """Per decoder layer: (input features, output features) of q, k, v, o."""
    return {"q_proj": (a.hidden, a.attn_dim), "k_proj": (a.hidden, a.kv_dim), "v_proj": (a.hidden, a.kv_dim),
            "o_proj": (a.attn_dim, a.hidden)}


def attention_params(a: Architecture) -> dict[str, int]:
    """Per decoder layer: input features x output features (+ bias) of q, k, v, o."""
    bias = 1 if a.attention_bias else 0
    return {k: i * o + bias * o for k, (i, o) in attention_linears(a).items()}


def mlp_params(a: Architecture) -> dict[str, int]:
    """Per decoder layer, as the family lays it out (finetune/families.py): its MLP's linear layers (Llama: gate, up,
    down), or every expert's weights and biases (GPT-OSS: fused gate_up, and down)."""
    family = FAMILIES[a.family]
    linears = {name: i * o for name, (i, o) in family.mlp_linears(a).items()}
    return linears | {f"experts.{name}": a.experts * (i * o + o) for name, (i, o) in family.expert_weights(a).items()}


def layer_params(a: Architecture) -> int:
    norms = 2 * a.hidden
    other = FAMILIES[a.family].other_layer_parameters(a)  # GPT-OSS: the router and the per-head attention sinks
    return sum(attention_params(a).values()) + sum(mlp_params(a).values()) + norms + other


def embedding_params(a: Architecture) -> int:
    """Input embedding + LM head (one matrix when tied) + final norm."""
    return a.vocab * a.hidden * (1 if a.tied_embeddings else 2) + a.hidden


def total_params(a: Architecture) -> int:
    return a.layers * layer_params(a) + embedding_params(a)


def linear_params_per_layer(a: Architecture) -> int:
    """Weights that bitsandbytes quantizes to 4 bit: the decoder layers' nn.Linear weights (not MoE's 3-D experts)."""
    linears = attention_linears(a) | FAMILIES[a.family].mlp_linears(a)
    return sum(i * o for i, o in linears.values())


# ---- Recipe settings ---------------------------------------------------------------------------------------------
@dataclass
class Setup:
    """What the recipe (plus command-line overrides) says, in the planner's terms. These defaults are for a setup
    built by hand (tests, benchmarks); `setup_from_recipe` takes what a recipe leaves out from the run's defaults."""

    model: str
    method: str = "full"  # full | lora | qlora
    lora_r: int = 16
    lora_dropout: float = 0.05
    lora_target_modules: tuple[str, ...] = ()
    lora_target_parameters: tuple[str, ...] = ()
    max_length: int = 1024
    batch: int = 8
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    activation_offloading: bool = False  # TRL's: saved activations wait in pinned CPU memory for the backward
    optim: str = "adamw_torch_fused"
    dtype: str = "float32"  # TRL loads in float32 unless the recipe says otherwise
    bf16: bool = True
    use_liger_kernel: bool = False
    attn_implementation: str = "sdpa"
    torch_compile: bool = False
    fp8: bool = False  # finetune/fp8.py: the decoder's linear layers in float8, compiled
    activation_memory_budget: float = 1.0  # inductor's cap on what a compiled layer saves (1: what it saves by default)
    expert_lora_kernel: str = "grouped"  # grouped | peft (finetune/expert_lora.py)

    @property
    def tokens(self) -> int:
        return self.max_length * self.batch


# The dataclasses the run parses a recipe into (finetune/config.py: TRL's parser over these), each after the classes
# it inherits from, so that a later default wins as SFTConfig's wins over TrainingArguments'. Their defaults are read
# from their source: importing SFTConfig imports torch and transformers, about 14 s against 0.2-0.3 s for the whole
# plan (docs/planner.md). A file that another version of a library does not have is skipped.
RUN_DATACLASSES = (
    ("transformers", "training_args.py", "TrainingArguments"),
    ("trl", "trainer/base_config.py", "_BaseConfig"),
    ("trl", "trainer/sft_config.py", "SFTConfig"),
    ("trl", "trainer/model_config.py", "ModelConfig"),
    ("finetune", "config.py", "FinetuneArguments"),
)
# Defaults those dataclasses compute instead of writing them out, as they come out on the torch this toolkit needs
COMPUTED_DEFAULTS = {"optim": "adamw_torch_fused"}  # TrainingArguments: the fused AdamW from torch 2.8 on
# One setting under two names (transformers 5.2x renamed it); the run reads either (finetune/config.py)
CHECKPOINTING_NAMES = ("gradient_checkpointing", "activation_checkpointing")
# How the run's parser reads a yes/no value (transformers' string_to_bool); anything else it refuses
BOOLEAN_WORDS = {"yes": True, "true": True, "t": True, "y": True, "1": True,
                 "no": False, "false": False, "f": False, "n": False, "0": False}


@functools.cache
def run_fields() -> set[str]:
    """Every key a recipe may set: the fields of RUN_DATACLASSES and of TRL's ScriptArguments."""
    fields = set()
    for package, file, class_name in (*RUN_DATACLASSES, ("trl", "scripts/utils.py", "ScriptArguments")):
        source = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / file  # found, not imported
        if source.is_file():
            module = ast.parse(source.read_text(encoding="utf-8"))
            for node in ast.walk(module):
                if isinstance(node, ast.ClassDef) and node.name == class_name:
                    fields |= {statement.target.id for statement in node.body
                               if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)}
    return fields


@functools.cache
def run_defaults() -> dict:
    """The default of each field of RUN_DATACLASSES that is written out as a literal, and COMPUTED_DEFAULTS."""
    defaults = dict(COMPUTED_DEFAULTS)
    for package, file, class_name in RUN_DATACLASSES:
        source = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / file  # found, not imported
        if source.is_file():
            defaults |= _declared_defaults(ast.parse(source.read_text(encoding="utf-8")), class_name)
    return defaults


def _declared_defaults(module: ast.Module, class_name: str) -> dict:
    """`name: type = value` and `name: type = field(default=value, ...)` of one class, where the value is a literal."""
    classes = (node for node in ast.walk(module) if isinstance(node, ast.ClassDef) and node.name == class_name)
    found = next(classes, None)
    defaults = {}
    for statement in found.body if found else []:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name) and statement.value):
            continue
        value = statement.value
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
            value = next((keyword.value for keyword in value.keywords if keyword.arg == "default"), None)
        with contextlib.suppress(ValueError):  # a name or a default_factory: computed (COMPUTED_DEFAULTS)
            defaults[statement.target.id] = ast.literal_eval(value)
    return defaults


def _as_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() not in BOOLEAN_WORDS:
        raise ValueError(value)
    return BOOLEAN_WORDS[str(value).lower()]


def _as_int(value) -> int:
    return int(str(value))  # as argparse reads the value: `2.0` and `true` are refused


def _as_float(value) -> float:
    return float(str(value))


# What a value must be, said in the refusal of one that is not
KINDS = {_as_bool: "true or false", _as_int: "a whole number", _as_float: "a number"}


def _as_tuple(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(str(v) for v in value)


def recipe_with_flags(recipe_path: str, argv: list[str]) -> dict:
    """The recipe with the command line's `--key value` flags on top (read_recipe: old names read as their new ones);
    a flag of either checkpointing name replaces the recipe's other one, as in the run."""
    flags = parse_overrides(argv)
    values = read_foreign_keys(read_recipe(recipe_path, flags), recipe_path, stream=sys.stderr)  # stdout: the plan
    refuse_unknown_keys(values, run_fields(), recipe_path)
    flagged = [name for name in CHECKPOINTING_NAMES if name in flags]
    if len(flagged) == 1:
        values.pop(next(name for name in CHECKPOINTING_NAMES if name != flagged[0]), None)
    return values


def _run_value(values: dict, key: str, source: str, read=None):
    """The recipe's value of `key`, else the run's default, read as the run's parser reads it."""
    value = values[key] if key in values else run_defaults()[key]
    if value is None or read is None:
        return value
    try:
        return read(value)
    except ValueError:
        raise UserError(f"{source}: `{key}: {value}` is not {KINDS[read]}; give {KINDS[read]} there.") from None


def _checkpointing(values: dict, source: str) -> bool:
    given = [name for name in CHECKPOINTING_NAMES if name in values]
    if len(given) == 2:
        raise UserError(f"{source}: both `gradient_checkpointing` and `activation_checkpointing` are set, one setting "
                        f"under its old and new name; keep one of them.")
    return bool(_run_value(values, (given or CHECKPOINTING_NAMES)[0], source, _as_bool))  # null: off, as in the run


def setup_from_recipe(values: dict, source: str = "recipe") -> Setup:
    """The planner's terms for a recipe's values (read_recipe's or recipe_with_flags'): a key the recipe leaves out
    at the run's default (run_defaults), each value read as the run reads it and one the run would refuse refused in
    a sentence naming `source`. The CPU's replacements (finetune/cpu.py) are not applied: the plan is for GPUs."""
    model = _run_value(values, "model_name_or_path", source)
    if not model:
        raise UserError(f"{source}: `model_name_or_path` is not set; give a hub id or a local folder.")
    peft = _run_value(values, "use_peft", source, _as_bool)
    numbers.check_numbers(lambda key: peft if key == "use_peft" else values.get(key, run_defaults().get(key)), source)
    four_bit = _run_value(values, "load_in_4bit", source, _as_bool)
    dtype = _run_value(values, "dtype", source) or "auto"  # the run loads with "auto" when the recipe empties it
    bf16 = _run_value(values, "bf16", source, _as_bool)
    return Setup(
        model=str(model),
        method="qlora" if four_bit and peft else ("lora" if peft else "full"),
        lora_r=_run_value(values, "lora_r", source, _as_int),
        lora_dropout=_run_value(values, "lora_dropout", source, _as_float),
        lora_target_modules=_as_tuple(_run_value(values, "lora_target_modules", source)),
        lora_target_parameters=_as_tuple(_run_value(values, "lora_target_parameters", source)),
        # null (no truncation): rows as long as the data, unknown here, so planned at TRL's default length
        max_length=_run_value(values, "max_length", source, _as_int) or run_defaults()["max_length"],
        batch=_run_value(values, "per_device_train_batch_size", source, _as_int),
        gradient_accumulation_steps=_run_value(values, "gradient_accumulation_steps", source, _as_int) or 1,
        gradient_checkpointing=_checkpointing(values, source),
        activation_offloading=bool(_run_value(values, "activation_offloading", source, _as_bool)),
        optim=str(_run_value(values, "optim", source)),
        dtype="bfloat16" if dtype == "auto" else str(dtype),  # the stored configs of the known models say bfloat16
        bf16=not _run_value(values, "fp16", source, _as_bool) if bf16 is None else bf16,  # TRL: bf16 unless fp16
        use_liger_kernel=bool(_run_value(values, "use_liger_kernel", source, _as_bool)),
        attn_implementation=str(_run_value(values, "attn_implementation", source) or "sdpa"),  # transformers' choice
        torch_compile=bool(_run_value(values, "torch_compile", source, _as_bool)),
        fp8=bool(_run_value(values, "fp8", source, _as_bool)),
        activation_memory_budget=_run_value(values, "activation_memory_budget", source, _as_float) or 1.0,
        expert_lora_kernel=str(_run_value(values, "expert_lora_kernel", source) or "grouped"),
    )


# ---- Trainable parameters ----------------------------------------------------------------------------------------
def lora_targets(a: Architecture, s: Setup) -> dict[str, tuple[int, int]]:
    """The adapted nn.Linear modules of one layer: name -> (in_features, out_features)."""
    shapes = attention_linears(a) | FAMILIES[a.family].mlp_linears(a)
    targets = s.lora_target_modules or ("q_proj", "v_proj")  # peft's default for Llama-like models
    if "all-linear" in targets:
        return shapes
    return {n: shapes[n] for n in shapes if any(t == n or t.endswith("." + n) for t in targets)}


def lora_expert_targets(a: Architecture, s: Setup) -> dict[str, tuple[int, int]]:
    """Adapted 3-D expert parameters (peft target_parameters): name -> (in, out) of one expert."""
    shapes = FAMILIES[a.family].expert_weights(a)
    return {n: shapes[n] for n in shapes if any(t.endswith(n) for t in s.lora_target_parameters)}


def trainable_params(a: Architecture, s: Setup) -> int:
    if s.method == "full":
        return total_params(a)
    r = s.lora_r
    per_layer = sum(r * (i + o) for i, o in lora_targets(a, s).values())
    per_layer += sum(a.experts * r * (i + o) for i, o in lora_expert_targets(a, s).values())
    return a.layers * per_layer


def trainable_bytes(s: Setup, technique: str) -> int:
    """Storage dtype of the trained parameters (and so of their gradients and Adam states)."""
    if s.method == "full":
        # FSDP2 in accelerate upcasts trainable low-precision parameters to fp32 for mixed precision.
        return 4 if technique == "fsdp2" else BYTES.get(s.dtype, 4)
    if s.method == "qlora" or technique in ("zero3", "zero3_offload"):
        return 2  # TRL casts QLoRA adapters to bf16; with ZeRO-3 it asks peft not to upcast them
    return 4  # peft upcasts LoRA adapters to fp32 (autocast_adapter_dtype=True)


def frozen_weight_bytes(a: Architecture, s: Setup) -> float:
    """Storage of the base model's weights. QLoRA: nf4 packs two weights per byte, plus one fp32 absmax per 64."""
    params = total_params(a)
    dtype_bytes = BYTES.get(s.dtype, 4)
    if s.method != "qlora":
        return params * dtype_bytes
    quantized = a.layers * linear_params_per_layer(a)
    return quantized * (0.5 + 4 / 64) + (params - quantized) * dtype_bytes


def optimizer_bytes_per_param(s: Setup, param_bytes: int) -> float:
    """Adam keeps two states (exp_avg, exp_avg_sq) in the parameter's dtype; 8-bit Adam keeps one byte each."""
    name = s.optim.lower()
    if "8bit" in name:
        return 2 + 8 / 2048  # + block-wise fp32 absmax
    if name.startswith("adafactor"):
        return 0.1 * param_bytes  # factored second moment: rows + columns, small
    if name.startswith("sgd"):
        return 0
    return 2 * param_bytes


# ---- Activations ------------------------------------------------------------------------------------------------
# torch.compile'd MoE layers: inductor recomputes the clamped SwiGLU's elementwise intermediates in backward instead of
# saving them. Fitted to one H200 measurement (GPT-OSS-20B attention LoRA, batch 4 x 2048, no checkpointing, compiled:
# 60.6 GiB peak against 83.1 GiB planned for eager, which eager measured at 84.2; docs/benchmarks.md).
COMPILED_EXPERT_SAVED_FRACTION = 0.18
# `fp8: true` (torchao's Float8Linear in compiled layers): the linear layers save float8 copies of their inputs and
# inductor recomputes the elementwise work around them, so a layer saves this fraction of what the compiled bf16 layer
# without liger is counted at. Fitted to one H200 measurement (Llama-3.2-1B full, batch 16 x 2048: 34.5 GiB); batch 8
# (21.5 GiB) and Llama-3.2-3B at batch 4 with 4 accumulation steps (39.8 GiB) are the checks (docs/benchmarks.md).
# Full fine-tuning only: the float8 copies replace inputs kept for weight gradients, which LoRA's frozen base layers
# never keep (Llama-3.2-3B LoRA at 8 x 2048 peaked at 48.7 GiB in fp8, 49.0 in bf16).
COMPILED_FP8_SAVED_FRACTION = 0.475


def layer_activation_bytes_per_token(a: Architecture, s: Setup) -> float:
    """Bytes a decoder layer saves for backward, per token, without checkpointing.

    Dense (Llama), counted with saved-tensor hooks on CPU and confirmed on the H200 within 0.2%:
    8*i (gate, up, silu(gate), silu*up in bf16) + 16*h + 4*attn (the RMSNorms keep fp32 copies of their inputs; q, attention
    output, residuals) + 4*kv (k, v) + 4*heads (fp32 logsumexp of the fused attention) + 8 (two fp32 rstd).
    Liger's SwiGLU recomputes silu(gate) and silu*up in backward: 4*i fewer.
    Frozen base (LoRA, QLoRA): the inputs kept only for weight gradients go (down_proj's input, the norms' and
    o_proj's inputs: 2*i + 8*h, measured); each adapted module with lora_dropout > 0 keeps its dropout output (bf16
    under autocast) and a bool mask: 3 bytes per input feature. With dropout 0 the adapter reads the same tensor.
    MoE (GPT-OSS): the attention part as above with its wider attention, then per *active* expert and token the
    routed input, gate_up output and the clamped SwiGLU's intermediates (5*h + 8*i, fitted to GPT-OSS-20B), the
    router's fp32 logits and the weighted sum.
    """
    h, i = a.hidden, a.intermediate
    attention = 16 * h + 4 * a.attn_dim + 4 * a.kv_dim + 4 * a.heads + 8
    if a.is_moe:
        experts = a.experts_per_token * (5 * h + 8 * i)
        mlp = experts * (COMPILED_EXPERT_SAVED_FRACTION if s.torch_compile else 1) + 4 * a.experts + 8 * h
    else:
        mlp = (4 if s.use_liger_kernel else 8) * i
    lora = 0.0
    if s.method != "full":
        if not a.is_moe:
            lora -= 2 * i + 8 * h
        for in_features, _ in lora_targets(a, s).values():
            if s.lora_dropout > 0:
                lora += in_features * 3
            lora += s.lora_r * 2  # lora_A's output
        if a.is_moe and s.expert_lora_kernel == "grouped":
            # finetune/expert_lora.py keeps each adapted expert GEMM's input (in expert order, one row per active
            # expert) and its rank-r projection for the factors' gradients: 8.4 GiB on GPT-OSS-20B at 4 x 2048
            lora += a.experts_per_token * sum(2 * in_features + 2 * s.lora_r
                                              for in_features, _ in lora_expert_targets(a, s).values())
    if s.attn_implementation == "eager":
        attention += 2 * a.heads * s.max_length * 2  # softmax probabilities (and their bf16 copy), per query
    if s.fp8 and not a.is_moe and s.method == "full":
        return (attention + 8 * i) * COMPILED_FP8_SAVED_FRACTION + lora
    return attention + mlp + lora


def adapted_expert_weight_bytes(a: Architecture, s: Setup) -> float:
    """peft's ParamWrapper adds B@A to a 3-D expert weight in the forward: the merged weight is saved per layer.
    The grouped path (finetune/expert_lora.py) never forms it."""
    if s.expert_lora_kernel == "grouped":
        return 0.0
    return sum(a.experts * i * o * 2 for i, o in lora_expert_targets(a, s).values())


def activation_bytes(a: Architecture, s: Setup) -> dict[str, float]:
    """Saved for backward at the end of the forward, one layer's recomputation (checkpointing), backward transients,
    and what activation offloading keeps in pinned CPU memory instead of on the GPU."""
    tokens = s.tokens
    per_layer = layer_activation_bytes_per_token(a, s) * tokens + adapted_expert_weight_bytes(a, s)
    outside = tokens * (6 * a.hidden + 8)  # embedding output, final norm's fp32 copy, hidden into the LM head
    layer_input = tokens * 2 * a.hidden  # bf16
    if s.gradient_checkpointing:
        # Each layer keeps only its input; in backward one layer at a time is recomputed. Offloaded, the inputs wait in
        # CPU memory: the GPU holds the last few still copying out (TRL's forward stash; the backward brings one back).
        inputs = a.layers * layer_input
        offloaded = inputs - min(a.layers, OFFLOAD_STASH_TENSORS) * layer_input if s.activation_offloading else 0.0
        saved, recompute = inputs - offloaded + outside, per_layer
    else:
        # `activation_memory_budget` below 1 lets inductor save at most that fraction of a compiled layer's default
        # (it recomputes the cheapest of the rest in backward); counted at the cap. Llama-3.2-3B LoRA at 8 x 2048 on
        # the H200: 0.8 measured 34.7 GiB (bf16) and 34.4 (fp8) against 49.0 at 1, 0.6 measured 32.0.
        if s.torch_compile:
            per_layer *= s.activation_memory_budget
        # Offloaded without checkpointing, every layer's activations go to the CPU and come back one layer at a time.
        inputs, recompute = 0.0, 0.0
        offloaded = (a.layers - 1) * per_layer if s.activation_offloading else 0.0
        saved = a.layers * per_layer - offloaded + outside
    # Backward through one layer holds the gradients of its activations: i-wide ones around the MLP (per active
    # expert for MoE) and h-wide ones, some fp32, around the norms and attention (measured ~26-108 KB/token on Llama).
    width = a.experts_per_token * a.intermediate if a.is_moe else a.intermediate
    transient = tokens * (8 * width + 12 * a.hidden)
    return {"saved": saved, "checkpoint_inputs": inputs, "recompute": recompute, "backward_transient": transient,
            "offloaded_to_cpu": offloaded}


def loss_buffer_bytes(a: Architecture, s: Setup, lm_head_trainable: bool) -> float:
    """TRL's fused LM head never builds (tokens x vocab) logits: one bf16 tile of 4096 x 32768, and in backward
    fp32 accumulators for the hidden-state gradient and, when the head trains, its weight gradient."""
    n = min(s.tokens, CHUNKED_LOGPROB_TOKENS)
    tile = n * min(a.vocab, CHUNKED_LOGPROB_VOCAB) * 2
    grad_hidden = s.tokens * a.hidden * (4 + 2)  # fp32 accumulator, then its bf16 copy
    grad_weight = a.vocab * a.hidden * (4 + 2) if lm_head_trainable else 0
    return tile + grad_hidden + grad_weight


# ---- Techniques --------------------------------------------------------------------------------------------------
TECHNIQUES = ("ddp", "zero2", "fsdp2", "zero3", "zero3_offload")
CONFIG_FILES = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "fsdp2": "accelerate_configs/fsdp.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "zero3_offload": "accelerate_configs/zero3_offload.yaml",
}
LABELS = {"ddp": "DDP", "zero2": "ZeRO-2", "fsdp2": "FSDP2", "zero3": "ZeRO-3", "zero3_offload": "ZeRO-3 offload"}


@dataclass
class Estimate:
    technique: str
    parts: dict[str, float]  # bytes
    allocated: float
    reserved: float
    per_gpu: float
    supported: bool = True
    note: str = ""

    @property
    def per_gpu_gib(self) -> float:
        return self.per_gpu / GIB


@dataclass(frozen=True)
class Sizes:
    """What every technique's estimate starts from, in parameters and bytes."""

    world: int  # GPUs in total
    parameters: int
    trainable: int
    full: bool
    trainable_bytes: int  # bytes per trainable parameter as the technique keeps it
    frozen_bytes: float  # the frozen base of a LoRA/QLoRA run
    largest_layer_bytes: float  # one decoder layer gathered in bf16 for compute
    root_unit_bytes: float  # FSDP2's root unit (embeddings, LM head, norm) stays gathered forward and backward
    bucket_bytes: float  # DeepSpeed's "auto" reduce bucket
    prefetch_bytes: float  # DeepSpeed's "auto" stage-3 prefetch bucket


def ddp_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Every GPU holds the whole model, its gradients and optimizer states; the parts and the gradient bytes."""
    weights = sizes.parameters * sizes.trainable_bytes if sizes.full else (
        sizes.frozen_bytes + sizes.trainable * sizes.trainable_bytes)
    parts = {"weights": weights, "optimizer": sizes.trainable * optimizer_bytes_per_param(setup, sizes.trainable_bytes)}
    gradients = sizes.trainable * sizes.trainable_bytes
    if sizes.world > 1:
        parts["ddp_buckets"] = gradients  # DDP's flat all-reduce buckets: a second copy of the gradients
    return parts, gradients


def zero2_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """DeepSpeed bf16: 16-bit weights everywhere; fp32 master weights + Adam states and fp32 gradients of the rank's
    partition; bf16 gradients reduced through buckets into the partition."""
    parts = {
        "weights": sizes.parameters * 2 if sizes.full else sizes.frozen_bytes + sizes.trainable * 2,
        "optimizer": sizes.trainable * (4 + optimizer_bytes_per_param(setup, 4)) / sizes.world,
        "fp32_grad_partition": sizes.trainable * 4 / sizes.world,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, sizes.trainable * 2 / sizes.world


def fsdp2_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Weights, gradients and optimizer states sharded; the current and the prefetched layer gathered."""
    sharded = sizes.world > 1
    frozen = 0 if sizes.full else sizes.frozen_bytes
    parts = {
        "weights": (frozen + sizes.trainable * sizes.trainable_bytes) / sizes.world,
        "optimizer": sizes.trainable * optimizer_bytes_per_param(setup, sizes.trainable_bytes) / sizes.world,
        "gathered": (2 * sizes.largest_layer_bytes + sizes.root_unit_bytes) if sharded else 0,
    }
    unsharded_to_reduce = 2 * sizes.largest_layer_bytes if sizes.full and sharded else 0
    return parts, sizes.trainable * sizes.trainable_bytes / sizes.world + unsharded_to_reduce


def zero3_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """ZeRO-2's partitions plus 16-bit weights sharded; layers gathered as they run."""
    weights = sizes.parameters * 2 if sizes.full else sizes.frozen_bytes + sizes.trainable * 2
    parts = {
        "weights": weights / sizes.world,
        "optimizer": sizes.trainable * (4 + optimizer_bytes_per_param(setup, 4)) / sizes.world,
        "fp32_grad_partition": sizes.trainable * 4 / sizes.world,
        "gathered": (2 * sizes.largest_layer_bytes + sizes.prefetch_bytes) if sizes.world > 1 else 0,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, sizes.trainable * 2 / sizes.world


def zero3_offload_memory(sizes: Sizes, setup: Setup) -> tuple[dict[str, float], float]:
    """Weights, fp32 master and Adam states live in CPU memory; the GPU gathers layers as it goes."""
    parts = {
        "gathered": 2 * sizes.largest_layer_bytes + sizes.root_unit_bytes + sizes.prefetch_bytes,
        "buckets": 2 * sizes.bucket_bytes,
    }
    return parts, 2 * sizes.bucket_bytes


TECHNIQUE_MEMORY = {"ddp": ddp_memory, "zero2": zero2_memory, "fsdp2": fsdp2_memory, "zero3": zero3_memory,
                    "zero3_offload": zero3_offload_memory}


def estimate(a: Architecture, s: Setup, technique: str, world: int) -> Estimate:
    """Per-GPU peak for one technique (one of TECHNIQUES) on `world` GPUs in total."""
    deepspeed = technique.startswith("zero")
    sizes = Sizes(
        world=max(world, 1),
        parameters=total_params(a),
        trainable=trainable_params(a, s),
        full=s.method == "full",
        trainable_bytes=2 if deepspeed else trainable_bytes(s, technique),
        frozen_bytes=frozen_weight_bytes(a, s),
        largest_layer_bytes=layer_params(a) * 2,
        root_unit_bytes=embedding_params(a) * 2,
        bucket_bytes=DS_BUCKET_ELEMENTS_PER_H2 * a.hidden**2 * 2,
        prefetch_bytes=DS_PREFETCH_PER_H2 * a.hidden**2 * 2,
    )
    supported, note = True, ""
    if s.method == "qlora" and technique in ("fsdp2", "zero3", "zero3_offload"):
        supported, note = False, "4-bit weights cannot be sharded here"
    parts, grads = TECHNIQUE_MEMORY[technique](sizes, s)

    acts = activation_bytes(a, s)
    # The peak is at one end of the backward pass (see the module docstring):
    #   start: every saved activation + the LM head's loss buffers (its fp32 weight gradient among them);
    #   end:   every gradient + the recomputed layer (checkpointing) + one layer's backward transients.
    # With checkpointing the start also runs the last layer's recomputation before any layer gradient exists.
    start = acts["saved"] + loss_buffer_bytes(a, s, lm_head_trainable=sizes.full)
    if s.gradient_checkpointing:
        start = max(start, acts["saved"] + acts["recompute"] + acts["backward_transient"])
    if s.gradient_accumulation_steps > 1 and not deepspeed:
        # The gradients of the earlier micro-batches are held through this one's forward and backward (DeepSpeed
        # accumulates into its fp32 partition, already counted).
        start += grads
    end = grads + acts["recompute"] + acts["backward_transient"]
    parts["activations_and_grads"] = max(start, end)
    allocated = sum(parts.values())
    reserved = allocated * FRAGMENTATION
    overhead = (CUDA_CONTEXT_GIB + (NCCL_GIB if sizes.world > 1 else 0)) * GIB
    if technique == "zero3_offload":
        overhead += 0.5 * GIB  # pinned staging buffers for the CPU <-> GPU copies
    return Estimate(technique, parts, allocated, reserved, reserved + overhead, supported, note)


# ---- The choice --------------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: str
    method: str
    gpu: str
    gpu_memory_gib: float
    gpus_per_node: int
    nodes: int
    estimates: dict[str, Estimate]
    technique: str | None
    fits: bool
    command: str | None
    suggestions: list[str] = field(default_factory=list)
    offloaded_gib: float = 0.0  # pinned CPU memory per process that activation offloading fills

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "method": self.method,
            "gpu": self.gpu,
            "gpu_memory_gib": self.gpu_memory_gib,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "technique": self.technique,
            "config_file": CONFIG_FILES.get(self.technique) if self.technique else None,
            "fits": self.fits,
            "command": self.command,
            "per_gpu_gib": {t: round(e.per_gpu_gib, 2) for t, e in self.estimates.items()},
            "supported": {t: e.supported for t, e in self.estimates.items()},
            "breakdown_gib": {t: {k: round(v / GIB, 3) for k, v in e.parts.items()} for t, e in self.estimates.items()},
            "budget_gib": round(self.gpu_memory_gib * SAFETY_MARGIN, 2),
            "suggestions": self.suggestions,
            "offloaded_to_cpu_gib": round(self.offloaded_gib, 2),
        }


def resolve_gpu(name: str | None, memory_gib: float | None) -> tuple[str, float]:
    if memory_gib is not None:
        return (name or "custom", float(memory_gib))
    if name is None:
        raise UserError("command line: no GPU given; pass --gpu NAME or --gpu-memory GIB.")
    key = name.upper().replace(" ", "")
    key = GPU_ALIASES.get(key, key)
    if key not in KNOWN_GPUS:
        raise UserError(f"command line: `--gpu {name}` is not a GPU the planner knows ({', '.join(KNOWN_GPUS)}); "
                        f"give one of them, or the memory of one GPU with --gpu-memory GIB.")
    return key, KNOWN_GPUS[key][1]


def launch_command(technique: str, recipe: str, world: int, nodes: int, extra_args: list[str] | None = None) -> str:
    parts = ["accelerate", "launch", "--config_file", CONFIG_FILES[technique]]
    if nodes > 1:
        parts += ["--num_machines", str(nodes), "--machine_rank", "$RANK", "--main_process_ip", "$MASTER_ADDR",
                  "--main_process_port", "29500"]
    parts += ["--num_processes", str(world), "scripts/sft.py", "--config", recipe] + list(extra_args or [])
    return " ".join(p if p.startswith("$") else shlex.quote(p) for p in parts)


def choose(a: Architecture, s: Setup, world: int, budget_bytes: float) -> tuple[dict[str, Estimate], str | None]:
    """Cheapest first: DDP (no sharding traffic), ZeRO-2 (shards only optimizer state and gradients), FSDP2 then
    ZeRO-3 (also shard the weights, gather each layer on the fly), ZeRO-3 with CPU offload (slowest, PCIe bound).
    With one GPU sharding saves nothing, so only DDP (a plain single process) and offload are candidates."""
    estimates = {t: estimate(a, s, t, world) for t in TECHNIQUES}
    order = TECHNIQUES if world > 1 else ("ddp", "zero3_offload")
    for t in order:
        e = estimates[t]
        if e.supported and e.per_gpu <= budget_bytes:
            return estimates, t
    return estimates, None


def _fits_somehow(a: Architecture, s: Setup, world: int, budget: float) -> bool:
    return choose(a, s, world, budget)[1] is not None


def suggestions(a: Architecture, s: Setup, world: int, gpus_per_node: int, budget: float) -> list[str]:
    """What would fit, tried one change at a time, cheapest change first."""
    out = []
    checkpointing_fits = _fits_somehow(a, replace(s, gradient_checkpointing=True), world, budget)
    if not s.gradient_checkpointing and checkpointing_fits:
        out.append("turn on activation checkpointing: --gradient_checkpointing true")
    offloaded = replace(s, gradient_checkpointing=True, activation_offloading=True)
    if not checkpointing_fits and not s.activation_offloading and _fits_somehow(a, offloaded, world, budget):
        out.append("checkpointing with the layer inputs in CPU memory: --gradient_checkpointing true "
                   "--activation_offloading true")
    if s.batch > 1:
        for b in range(s.batch - 1, 0, -1):
            if _fits_somehow(a, replace(s, batch=b), world, budget):
                out.append(f"a smaller micro-batch: --per_device_train_batch_size {b} (raise gradient_accumulation_steps)")
                break
    length = s.max_length // 2
    while length >= 256:
        if _fits_somehow(a, replace(s, max_length=length), world, budget):
            out.append(f"shorter sequences: --max_length {length}")
            break
        length //= 2
    if s.method == "full":
        lora = replace(s, method="lora", lora_target_modules=("all-linear",))
        if _fits_somehow(a, lora, world, budget):
            out.append("LoRA instead of full fine-tuning: --use_peft true --lora_target_modules all-linear")
    if s.method in ("full", "lora") and not a.is_moe:
        qlora = replace(s, method="qlora", lora_target_modules=s.lora_target_modules or ("all-linear",))
        if _fits_somehow(a, qlora, world, budget):
            out.append("QLoRA (4-bit base weights): --use_peft true --load_in_4bit true")
    per_node = max(gpus_per_node, 8)  # more GPUs: fill a node of 8, then add nodes of 8
    for total in (2, 4, 8, 16, 32, 64, 128):
        if total <= world or not _fits_somehow(a, s, total, budget):
            continue
        nodes = math.ceil(total / per_node)
        out.append(f"more GPUs: {total} of this kind" + (f" ({nodes} nodes of {per_node}, --nodes {nodes})" if nodes > 1 else ""))
        break
    if not out:
        out.append("no single change fits: combine checkpointing, LoRA/QLoRA, shorter sequences, more or larger GPUs")
    return out


def faster_than_offload(a: Architecture, s: Setup, world: int, technique: str, budget: float) -> list[str]:
    """When only ZeRO-3 offload fits (PCIe bound), checkpointing on the GPU is usually much faster if it fits without
    offload: say so beside the command."""
    if technique != "zero3_offload" or s.gradient_checkpointing:
        return []
    _, checkpointed = choose(a, replace(s, gradient_checkpointing=True), world, budget)
    if checkpointed in (None, "zero3_offload"):
        return []
    return [f"activation checkpointing fits {LABELS[checkpointed]} without offloading, usually much faster: "
            f"--gradient_checkpointing true ({CONFIG_FILES[checkpointed]})"]


def plan(recipe_values: dict, gpus: int, gpu: str | None = None, gpu_memory_gib: float | None = None,
         nodes: int = 1, recipe_path: str = "RECIPE", extra_args: list[str] | None = None) -> Plan:
    s = setup_from_recipe(recipe_values, recipe_path)
    a = architecture_of(s.model, recipe_path)
    gpu_name, memory = resolve_gpu(gpu, gpu_memory_gib)
    world = gpus * nodes
    budget = memory * GIB * SAFETY_MARGIN
    estimates, technique = choose(a, s, world, budget)
    command = launch_command(technique, recipe_path, world, nodes, extra_args) if technique else None
    tips = suggestions(a, s, world, gpus, budget) if technique is None else faster_than_offload(a, s, world, technique,
                                                                                                  budget)
    return Plan(s.model, s.method, gpu_name, memory, gpus, nodes, estimates, technique, technique is not None,
                command, tips, activation_bytes(a, s)["offloaded_to_cpu"] / GIB)


def format_plan(p: Plan) -> str:
    budget = p.gpu_memory_gib * SAFETY_MARGIN
    lines = [
        f"{p.model} ({p.method}) on {p.nodes} node{'s' if p.nodes > 1 else ''} x {p.gpus_per_node} {p.gpu} "
        f"({p.gpu_memory_gib:.1f} GiB each; budget {budget:.1f} GiB = {SAFETY_MARGIN:.0%})",
        "",
        f"{'technique':<16}{'per GPU GiB':>12}  {'weights':>8} {'optim':>8} {'act/grad':>9} {'other':>8}  verdict",
    ]
    for t, e in p.estimates.items():
        w = e.parts.get("weights", 0) / GIB
        o = e.parts.get("optimizer", 0) / GIB
        ag = e.parts.get("activations_and_grads", 0) / GIB
        other = e.per_gpu_gib - w - o - ag
        if not e.supported:
            verdict = f"not supported ({e.note})"
        elif p.world == 1 and t not in ("ddp", "zero3_offload"):
            verdict = "(no sharding on 1 GPU)"
        else:
            verdict = "fits" if e.per_gpu_gib <= budget else "too big"
        mark = "*" if t == p.technique else " "
        lines.append(f"{mark}{LABELS[t]:<15}{e.per_gpu_gib:>12.1f}  {w:>8.1f} {o:>8.1f} {ag:>9.1f} {other:>8.1f}  {verdict}")
    lines.append("")
    if p.offloaded_gib:
        lines += [f"Activation offloading keeps {p.offloaded_gib:.1f} GiB of activations in pinned CPU memory per GPU.",
                  ""]
    if p.fits:
        lines.append(f"Use {LABELS[p.technique]} ({CONFIG_FILES[p.technique]}):")
        lines.append(f"  {p.command}")
        lines += [f"  Faster: {tip}" for tip in p.suggestions]
    else:
        lines.append("Nothing fits. What would:")
        lines += [f"  - {tip}" for tip in p.suggestions]
    return "\n".join(lines)
