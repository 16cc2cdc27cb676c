"""What the planner reads from a recipe: model, method, sequence length, batch, checkpointing and the rest of the
setup that decides memory, with the run's defaults for what the recipe leaves out."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from finetune.config import numbers
from finetune.config.files import parse_overrides, read_foreign_keys, read_recipe, refuse_unknown_keys
from finetune.config.schema import (
    CHECKPOINTING_NAMES,
    KINDS,
    _as_bool,
    _as_float,
    _as_int,
    _as_tuple,
    run_defaults,
    run_fields,
)
from finetune.errors import UserError


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
    fp8: bool = False  # finetune/models/fp8.py: the decoder's linear layers in float8, compiled
    activation_memory_budget: float = 1.0  # inductor's cap on what a compiled layer saves (1: what it saves by default)
    expert_lora_kernel: str = "grouped"  # grouped | peft (finetune/models/expert_lora.py)
    dequantize_mxfp4: bool = True  # false: an MXFP4 checkpoint's experts stay MXFP4 on the GPU (models/mxfp4_experts.py)
    router_aux_loss: bool = True  # TRL's MoE load-balancing loss: off only with router_aux_loss_coef 0

    @property
    def tokens(self) -> int:
        return self.max_length * self.batch


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
    a sentence naming `source`. The CPU's replacements (finetune/models/cpu.py) are not applied: the plan is for GPUs."""
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
        dequantize_mxfp4=bool(_run_value(values, "dequantize_mxfp4", source, _as_bool)),
        router_aux_loss=_run_value(values, "router_aux_loss_coef", source, _as_float) != 0,
    )
