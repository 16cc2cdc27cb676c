"""The `finetune` console command: `finetune plan | check | merge | launch | chat | generate | eval ...`.

Each subcommand is a function `add_<name>(subparsers)` that declares its arguments and sets `func`; heavy imports
(torch, transformers) stay inside the subcommand's function so that `finetune plan` answers at once.
"""

from __future__ import annotations

import argparse
import sys

from finetune.commands.chat import add_chat
from finetune.commands.check import add_check
from finetune.commands.eval import add_eval
from finetune.commands.generate import add_generate
from finetune.commands.launch import add_launch
from finetune.commands.merge import add_merge
from finetune.commands.plan import add_plan
from finetune.errors import UserError, report

SUBCOMMANDS = [add_plan, add_check, add_merge, add_launch, add_chat, add_generate, add_eval]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tuning toolkit for Llama 3.2 and GPT-OSS.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) or 0
    except UserError as error:  # every subcommand's user mistake: one line, exit 2
        return report(error)


if __name__ == "__main__":
    sys.exit(main())
