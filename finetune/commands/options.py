"""Argument types and options shared by the `finetune` subcommands: ranged numbers, writable files, the model
flags of chat, generate and eval."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from finetune.errors import UserError
from finetune.run_folder import RUN_RECORD

# A folder holding one of these is a model or a run's output folder: no command writes over a file in it.
MODEL_FOLDER_FILES = ("config.json", "adapter_config.json", RUN_RECORD)


def whole_number(minimum: int):
    """An argparse type: an int of at least `minimum` (a count of GPUs, tokens, rows)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}; give {minimum} or more")
        return value
    return parse


def number(low: float, high: float = math.inf, low_allowed: bool = True):
    """An argparse type: a finite float from `low` (included unless `low_allowed` is false) up to `high`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value > high or value < low or (value == low and not low_allowed):
            bounds = f"{'at least' if low_allowed else 'above'} {low:g}"
            if high < math.inf:
                bounds += f" and at most {high:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range; give a number {bounds}")
        return value
    return parse


def check_writable_file(path: str, flag: str, overwrite: bool = False, own: bool = False) -> None:
    """A file a command writes at its end (answers, a report), checked before any model loads: its folder exists
    and can be written, and the path is not a folder. An existing file is written over only with --overwrite, and
    never inside a model folder (its weights, its config, the prompts beside them) unless it is the command's `own`
    file there (eval's default report)."""
    file = Path(path)
    folder = file.absolute().parent
    if file.is_dir():
        raise UserError(f"{path}: a folder, not a file; give {flag} the name of a file to write.")
    if file.exists() and not own:
        if any((folder / name).is_file() for name in MODEL_FOLDER_FILES):
            raise UserError(f"{path}: already exists in the model folder {folder}, whose files no command writes "
                            f"over; give {flag} a new file outside it.")
        if not overwrite:
            raise UserError(f"{path}: already exists; give {flag} a new file, or add --overwrite to replace it.")
    if not folder.is_dir():
        raise UserError(f"{path}: its folder {folder} does not exist; create it or pick another {flag} (checked "
                        f"before any answer is generated).")
    if not os.access(folder, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise UserError(f"{path}: cannot be written ({folder} is read-only or not yours); pick another {flag}.")


def add_overwrite(p) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out/--report file (never one inside a model folder)")


def add_model_arguments(p) -> None:
    p.add_argument("output_dir", help="a training run's output_dir: a full model or a LoRA adapter")
    p.add_argument("--base", help="base model of a LoRA adapter (default: the one in its adapter_config.json)")
    p.add_argument("--device", help="cuda, cuda:1, cpu... (default: cuda when there is a GPU; bf16 there, float32 on CPU)")
    p.add_argument("--max_new_tokens", type=whole_number(1), default=256, help="most tokens generated per answer")
