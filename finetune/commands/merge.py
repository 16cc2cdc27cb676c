"""Merge a trained LoRA adapter into its base model, giving a folder that loads without peft.

Everything that can be refused is refused before the base model loads (the output folder, the adapter, its base);
the merged model is written aside and renamed into place, so a failed write leaves no half-written folder.
"""

from __future__ import annotations

import argparse
import shutil
from contextlib import contextmanager
from pathlib import Path

from finetune.config.files import blocked_folder
from finetune.errors import UserError, first_line, say


def _run_merge(args: argparse.Namespace, extra: list[str]) -> int:
    print(f"merged model written to {merge_adapter(args.adapter_dir, args.output_dir, args.base_model)}")
    return 0


def add_merge(subparsers) -> None:
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (loads without peft)")
    p.add_argument("adapter_dir", help="a LoRA run's output_dir")
    p.add_argument("output_dir", help="where to write the merged model (new or empty)")
    p.add_argument("--base_model", help="base model id or folder (default: the one the adapter was trained on)")
    p.set_defaults(func=_run_merge)


def merge_adapter(adapter_dir: str, output_dir: str, base_model: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only when merging

    from finetune.checks.model_folder import ADAPTER_CONFIG, check_model, nonfinite_problems
    from finetune.models import mxfp4, mxfp4_loading
    from finetune.run import merging
    from finetune.run.model import check_finite, load_adapter

    output = Path(output_dir)
    check_output_folder(output)
    base_model = check_model(adapter_dir, "ADAPTER_DIR", base_model, "--base_model")
    if base_model is None:
        raise UserError(f"{adapter_dir}: no {ADAPTER_CONFIG}, so it is not a LoRA output; pass a LoRA run's "
                        f"output_dir.")
    tokenizer_from = adapter_dir if _holds_tokenizer(Path(adapter_dir)) else base_model
    if tokenizer_from != adapter_dir:
        say(f"{adapter_dir} holds no tokenizer files (a plain peft adapter): the merged model gets {base_model}'s")
    if mxfp4.is_mxfp4_checkpoint(base_model):  # shard by shard: the 120B base dequantized would take 218 GiB
        for problem in nonfinite_problems(adapter_dir, base_model):  # what check_finite sees of a loaded model
            raise problem
        with base_not_loadable(base_model):
            checkpoint = mxfp4_loading.checkpoint_folder(base_model, None)

        def write_model(folder: Path) -> None:
            merging.merge(checkpoint, base_model, adapter_dir, folder)
    else:
        with base_not_loadable(base_model):
            base = AutoModelForCausalLM.from_pretrained(base_model, dtype="auto", use_safetensors=True)
        adapted = load_adapter(base, adapter_dir, base_model, "--base_model")
        check_finite(adapted, base_model, adapter_dir)
        write_model = adapted.merge_and_unload().save_pretrained

    def save(folder: Path) -> None:
        write_model(folder)
        AutoTokenizer.from_pretrained(tokenizer_from).save_pretrained(folder)

    write_aside(output, save)
    return output


@contextmanager
def base_not_loadable(base_model: str):
    try:
        yield
    except OSError as error:
        raise UserError(f"{base_model}: the base model could not be loaded ({first_line(error)}); without "
                        f"network pass a local copy of it with --base_model.") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _holds_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def check_output_folder(output: Path) -> None:
    """The merged model's folder: new or empty, and creatable and writable where it is to be."""
    if output.is_file():
        raise UserError(f"{output}: a file, not a folder; pass a new or empty folder to write the merged model to.")
    if output.is_dir() and any(output.iterdir()):
        raise UserError(f"{output}: already holds files; pass an empty or new folder to write the merged model.")
    blocked = blocked_folder(output.absolute().parent)  # the merged model is written beside it, then renamed
    if blocked and blocked[1] == "file":
        raise UserError(f"{output}: cannot be created because {blocked[0]} is a file; pick another output folder.")
    if blocked:
        raise UserError(f"{output}: cannot be written ({blocked[0]} is read-only or not yours); pick an output folder "
                        f"you can write to.")


def write_aside(output: Path, save) -> None:
    """`save(folder)` into a new folder beside `output`, then renamed to it (an empty `output` is replaced)."""
    from finetune.run import saving  # torch: only once a merge writes

    aside = output.parent / f".{output.name}.partial"
    shutil.rmtree(aside, ignore_errors=True)  # left by a merge that was killed
    try:
        aside.mkdir(parents=True)
        save(aside)
        aside.replace(output)
    except Exception as error:
        shutil.rmtree(aside, ignore_errors=True)
        reason = saving.save_failure_reason(error, output.parent)
        if reason is None:
            raise
        raise UserError(f"{output}: the merged model could not be written ({reason}); nothing was left there; free "
                        f"space or fix the folder's permissions and merge again.") from None
