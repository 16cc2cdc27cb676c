"""`finetune eval OUTPUT_DIR`: held-out loss, exact match and token F1 of a trained model on a data file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from finetune.commands.options import add_model_arguments, add_overwrite, check_writable_file, whole_number
from finetune.errors import UserError, say
from finetune.run_folder import recorded_run


def _run_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.data import load as data
    from finetune.run import evaluation
    from finetune.run import generation as inference

    names = [args.output_dir] + ([args.compare] if args.compare else [])
    conversations = evaluation.held_out_conversations(data.load_split(args.dataset_name, args.split), args.limit)
    if not conversations:
        raise UserError(f"{args.dataset_name}: no rows end in an assistant turn to score; pass conversations "
                        f"(`messages`) or prompt-completion rows.")
    if args.report is None and not Path(args.output_dir).is_dir():
        raise UserError(f"{args.output_dir}: not a local folder, so the report has no default place "
                        f"(OUTPUT_DIR/finetune_eval.json); pass --report FILE, or fix OUTPUT_DIR.")
    report_file = args.report or str(Path(args.output_dir) / "finetune_eval.json")
    check_writable_file(report_file, "--report", args.overwrite, own=args.report is None)
    loadable = [inference.check_trained(args.output_dir, args.base, args.device)]
    if args.compare:  # checked before the first model is scored, not after
        loadable.append(inference.check_trained(args.compare, None, args.device, "--compare"))
    scores = {}
    for name, checked in zip(names, loadable):
        model, tokenizer = inference.load_checked(checked)
        max_length = recorded_run(name).get("settings", {}).get("max_length")  # a run's rows were cut to it
        scores[name] = evaluation.score(model, tokenizer, conversations, args.batch_size, args.max_new_tokens,
                                        max_length, source=args.dataset_name)
        del model
    answers = {name: result.pop("answers") for name, result in scores.items()}
    Path(report_file).write_text(json.dumps({
        "dataset": args.dataset_name, "split": args.split, "scores": scores,
        "examples": evaluation.examples(conversations, answers),
    }, indent=2, ensure_ascii=False) + "\n")
    width = max(len(name) for name in names)
    for name in names:
        say(f"eval {name:<{width}}  {args.dataset_name} [{args.split}], {len(conversations)} rows: "
            f"{evaluation.summary(scores[name])}")
    say(f"report written to {report_file}")
    return 0


def add_eval(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="score a trained model on held-out conversations (loss, perplexity, exact match, token F1)",
        description="Loss and perplexity on the assistant tokens, and exact match and token F1 of the last assistant "
        "turn generated greedily from the turns before it. --compare scores a second model on the same rows.",
    )
    add_model_arguments(p)
    p.add_argument("--dataset_name", required=True, help="hub id, local folder or .jsonl/.json/.parquet/.csv file")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=whole_number(1), help="score only the first N rows")
    p.add_argument("--compare", help="a second output folder or model (e.g. the base) scored on the same rows")
    p.add_argument("--batch_size", type=whole_number(1), default=16)
    p.add_argument("--report", help="JSON report file, a new one (default: OUTPUT_DIR/finetune_eval.json, "
                   "replaced by each eval)")
    add_overwrite(p)
    p.set_defaults(func=_run_eval)
