"""`finetune chat OUTPUT_DIR`: talk to a trained model in the terminal."""

from __future__ import annotations

import argparse

from finetune.commands.options import add_model_arguments, number


def _run_chat(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.run import generation as inference

    model, tokenizer = inference.load_trained(args.output_dir, args.base, args.device)
    generation = inference.generation_kwargs(args.temperature, args.top_p, args.max_new_tokens)
    inference.chat(model, tokenizer, system=args.system, generation=generation)
    return 0


def add_chat(subparsers) -> None:
    p = subparsers.add_parser(
        "chat", help="talk to a trained model (reads stdin line by line: `echo hi | finetune chat OUTPUT_DIR`)",
        description="Chat with a trained model through its saved chat template and generation config; answers are "
        "streamed. /reset starts a new conversation, /exit quits.",
    )
    add_model_arguments(p)
    p.add_argument("--system", help="a system message that opens every conversation")
    p.add_argument("--temperature", type=number(0), help="0 is greedy (default: the saved generation config)")
    p.add_argument("--top_p", type=number(0, 1, low_allowed=False),
                   help="nucleus sampling (default: the saved generation config)")
    p.set_defaults(func=_run_chat)
