"""`finetune generate OUTPUT_DIR --prompts FILE`: answers of a trained model to a file of prompts, as JSONL."""

from __future__ import annotations

import argparse
import json

from finetune.commands.options import add_model_arguments, add_overwrite, check_writable_file, number, whole_number
from finetune.errors import say


def _run_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.run import generation as inference

    prompts = inference.read_prompts(args.prompts)
    check_writable_file(args.out, "--out", args.overwrite)
    model, tokenizer = inference.load_trained(args.output_dir, args.base, args.device)
    generation = inference.generation_kwargs(args.temperature, args.top_p, args.max_new_tokens)
    answers = inference.generate_answers(model, tokenizer, [turns for _, turns in prompts], args.batch_size,
                                         source=args.prompts, **generation)
    with open(args.out, "w", encoding="utf-8") as out:
        out.writelines(json.dumps({**row, "answer": answer}, ensure_ascii=False) + "\n"
                       for (row, _), answer in zip(prompts, answers))
    say(f"{len(answers)} answers written to {args.out}")
    return 0


def add_generate(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="answer a file of prompts in batches (one JSON line per prompt, with its answer)",
        description="PROMPTS is a .jsonl of `messages` or `prompt` rows, or a text file with one prompt per line.",
    )
    add_model_arguments(p)
    p.add_argument("--prompts", required=True, help=".jsonl of `messages`/`prompt` rows, or plain text lines")
    p.add_argument("--out", required=True, help="where to write the answers (.jsonl, a new file)")
    add_overwrite(p)
    p.add_argument("--batch_size", type=whole_number(1), default=16)
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top_p", type=number(0, 1, low_allowed=False))
    p.set_defaults(func=_run_generate)
