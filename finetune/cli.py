"""The `finetune` console command: `finetune plan | merge | launch | chat | generate | eval ...`.

Each subcommand is a function `add_<name>(subparsers)` that declares its arguments and sets `func`; heavy imports
(torch, transformers) stay inside the subcommand's function so that `finetune plan` answers at once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from finetune.errors import UserError, report, say


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


def _run_plan(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import plan as planner

    result = planner.plan(planner.recipe_with_flags(args.config, extra), gpus=args.gpus, gpu=args.gpu,
                          gpu_memory_gib=args.gpu_memory, nodes=args.nodes, recipe_path=args.config, extra_args=extra)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(planner.format_plan(result))
    return 0 if result.fits else 1


def add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="estimate per-GPU memory for DDP/FSDP2/ZeRO and print the accelerate command that fits",
        description="Estimate per-GPU peak memory of a recipe under DDP, ZeRO-2, FSDP2, ZeRO-3 and ZeRO-3 offload, "
        "choose the cheapest that fits, print the accelerate launch command. Extra --key value arguments override "
        "the recipe (e.g. --max_length 4096 --gradient_checkpointing false) and are passed on to the command; what "
        "the recipe leaves out is planned at the run's default. Exit status: 0 when something fits, 1 when nothing "
        "does, 2 after a mistake in the recipe or a flag (said in one `error:` line).",
    )
    p.add_argument("--config", required=True, help="recipe YAML (recipes/MODEL/METHOD.yaml)")
    p.add_argument("--gpus", type=whole_number(1), default=1, help="GPUs per node")
    p.add_argument("--nodes", type=whole_number(1), default=1,
                   help="machines (adds the multi-node flags to the command)")
    gpu = p.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--gpu", help="A10, L4, A100-40, A100-80, H100, H200, B200")
    gpu.add_argument("--gpu-memory", type=number(0, low_allowed=False), help="memory of one GPU in GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run_plan, accepts_extra=True)


def _run_merge(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.merge import merge_adapter

    print(f"merged model written to {merge_adapter(args.adapter_dir, args.output_dir, args.base_model)}")
    return 0


def add_merge(subparsers) -> None:
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (loads without peft)")
    p.add_argument("adapter_dir", help="a LoRA run's output_dir")
    p.add_argument("output_dir", help="where to write the merged model (new or empty)")
    p.add_argument("--base_model", help="base model id or folder (default: the one the adapter was trained on)")
    p.set_defaults(func=_run_merge)


def _run_launch(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import launcher

    return launcher.main(extra)


def add_launch(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", add_help=False,
        help="check the accelerate config (or plan one for the GPUs here), then accelerate launch scripts/sft.py",
        description="finetune launch [--config_file F] [--num_processes N] [--num_machines M --machine_rank R "
        "--main_process_ip IP --main_process_port P] --config recipes/M/METHOD.yaml [scripts/sft.py flags]",
    )
    p.set_defaults(func=_run_launch, accepts_extra=True)


def _add_model_arguments(p) -> None:
    p.add_argument("output_dir", help="a training run's output_dir: a full model or a LoRA adapter")
    p.add_argument("--base", help="base model of a LoRA adapter (default: the one in its adapter_config.json)")
    p.add_argument("--device", help="cuda, cuda:1, cpu... (default: cuda when there is a GPU; bf16 there, float32 on CPU)")
    p.add_argument("--max_new_tokens", type=whole_number(1), default=256, help="most tokens generated per answer")


def _run_chat(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import inference

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
    _add_model_arguments(p)
    p.add_argument("--system", help="a system message that opens every conversation")
    p.add_argument("--temperature", type=number(0), help="0 is greedy (default: the saved generation config)")
    p.add_argument("--top_p", type=number(0, 1, low_allowed=False),
                   help="nucleus sampling (default: the saved generation config)")
    p.set_defaults(func=_run_chat)


def _run_generate(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import inference

    prompts = inference.read_prompts(args.prompts)
    check_writable_file(args.out, "--out")
    model, tokenizer = inference.load_trained(args.output_dir, args.base, args.device)
    generation = inference.generation_kwargs(args.temperature, args.top_p, args.max_new_tokens)
    answers = inference.generate_answers(model, tokenizer, [turns for _, turns in prompts], args.batch_size, **generation)
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
    _add_model_arguments(p)
    p.add_argument("--prompts", required=True, help=".jsonl of `messages`/`prompt` rows, or plain text lines")
    p.add_argument("--out", required=True, help="where to write the answers (.jsonl)")
    p.add_argument("--batch_size", type=whole_number(1), default=16)
    p.add_argument("--temperature", type=number(0), default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top_p", type=number(0, 1, low_allowed=False))
    p.set_defaults(func=_run_generate)


def _run_eval(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import data, evaluation, inference

    names = [args.output_dir] + ([args.compare] if args.compare else [])
    conversations = evaluation.held_out_conversations(data.load_split(args.dataset_name, args.split), args.limit)
    if not conversations:
        raise UserError(f"{args.dataset_name}: no rows end in an assistant turn to score; pass conversations "
                        f"(`messages`) or prompt-completion rows.")
    if args.report is None and not Path(args.output_dir).is_dir():
        raise UserError(f"{args.output_dir}: not a local folder, so the report has no default place "
                        f"(OUTPUT_DIR/finetune_eval.json); pass --report FILE, or fix OUTPUT_DIR.")
    report_file = args.report or str(Path(args.output_dir) / "finetune_eval.json")
    check_writable_file(report_file, "--report")
    loadable = [inference.check_trained(args.output_dir, args.base, args.device)]
    if args.compare:  # checked before the first model is scored, not after
        loadable.append(inference.check_trained(args.compare, None, args.device, "--compare"))
    scores = {}
    for name, checked in zip(names, loadable):
        model, tokenizer = inference.load_checked(checked)
        scores[name] = evaluation.score(model, tokenizer, conversations, args.batch_size, args.max_new_tokens)
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
    _add_model_arguments(p)
    p.add_argument("--dataset_name", required=True, help="hub id, local folder or .jsonl/.json/.parquet/.csv file")
    p.add_argument("--split", default="test")
    p.add_argument("--limit", type=whole_number(1), help="score only the first N rows")
    p.add_argument("--compare", help="a second output folder or model (e.g. the base) scored on the same rows")
    p.add_argument("--batch_size", type=whole_number(1), default=16)
    p.add_argument("--report", help="JSON report file (default: OUTPUT_DIR/finetune_eval.json)")
    p.set_defaults(func=_run_eval)


SUBCOMMANDS = [add_plan, add_merge, add_launch, add_chat, add_generate, add_eval]


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
