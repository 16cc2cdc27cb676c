"""The schema of run keys, read without importing TRL or transformers: every key a recipe may set (the fields of
ScriptArguments, SFTConfig, ModelConfig and finetune's own arguments), their defaults, and how a value is read
as a boolean, a whole number or a number. The run and the planner both read recipes against this one list."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
from pathlib import Path

# The dataclasses the run parses a recipe into (finetune/run/arguments.py: TRL's parser over these), each after the classes
# it inherits from, so that a later default wins as SFTConfig's wins over TrainingArguments'. Their defaults are read
# from their source: importing SFTConfig imports torch and transformers, about 14 s against 0.2-0.3 s for the whole
# plan (docs/planner.md). A file that another version of a library does not have is skipped.
RUN_DATACLASSES = (
    ("transformers", "training_args.py", "TrainingArguments"),
    ("trl", "trainer/base_config.py", "_BaseConfig"),
    ("trl", "trainer/sft_config.py", "SFTConfig"),
    ("trl", "trainer/model_config.py", "ModelConfig"),
    ("finetune", "run/arguments.py", "FinetuneArguments"),
)


# Defaults those dataclasses compute instead of writing them out, as they come out on the torch this toolkit needs
COMPUTED_DEFAULTS = {"optim": "adamw_torch_fused"}  # TrainingArguments: the fused AdamW from torch 2.8 on


# One setting under two names (transformers 5.2x renamed it); the run reads either (finetune/run/arguments.py)
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
