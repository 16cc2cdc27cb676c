"""Argument types and options shared by the `finetune` subcommands: ranged numbers, writable files, the model
flags of chat, generate and eval."""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from finetune.errors import UserError


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


def check_writable_file(path: str, flag: str) -> None:
    """A file a command writes at its end (answers, a report), checked before any model loads: its folder exists
    and can be written, and the path is not a folder."""
    file = Path(path)
    folder = file.absolute().parent
    if file.is_dir():
        raise UserError(f"{path}: a folder, not a file; give {flag} the name of a file to write.")
    if not folder.is_dir():
        raise UserError(f"{path}: its folder {folder} does not exist; create it or pick another {flag} (checked "
                        f"before any answer is generated).")
    if not os.access(folder, os.W_OK | os.X_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise UserError(f"{path}: cannot be written ({folder} is read-only or not yours); pick another {flag}.")


def add_model_arguments(p) -> None:
    p.add_argument("output_dir", help="a training run's output_dir: a full model or a LoRA adapter")
    p.add_argument("--base", help="base model of a LoRA adapter (default: the one in its adapter_config.json)")
    p.add_argument("--device", help="cuda, cuda:1, cpu... (default: cuda when there is a GPU; bf16 there, float32 on CPU)")
    p.add_argument("--max_new_tokens", type=whole_number(1), default=256, help="most tokens generated per answer")
