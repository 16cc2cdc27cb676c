"""The `finetune` console command: `finetune plan ...`, `finetune merge ...`, `finetune launch ...` (more subcommands register themselves the same way).

Each subcommand is a function `add_<name>(subparsers)` that declares its arguments and sets `func`; heavy imports
(torch, transformers) stay inside the subcommand's function so that `finetune plan` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys


def _run_plan(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import plan as planner
    from finetune.config_files import parse_overrides, read_recipe
    from finetune.errors import UserError, report

    try:
        values = read_recipe(args.config, parse_overrides(extra))
        result = planner.plan(values, gpus=args.gpus, gpu=args.gpu, gpu_memory_gib=args.gpu_memory, nodes=args.nodes,
                              recipe_path=args.config, extra_args=extra)
    except UserError as error:
        return report(error)
    except ValueError as e:
        print(f"finetune plan: {e}", file=sys.stderr)
        return 2
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
        "the recipe (e.g. --max_length 4096 --gradient_checkpointing false) and are passed on to the command. "
        "Exit status: 0 when something fits, 1 when nothing does.",
    )
    p.add_argument("--config", required=True, help="recipe YAML (recipes/MODEL/METHOD.yaml)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node")
    p.add_argument("--nodes", type=int, default=1, help="machines (adds the multi-node flags to the command)")
    gpu = p.add_mutually_exclusive_group(required=True)
    gpu.add_argument("--gpu", help="A10, L4, A100-40, A100-80, H100, H200, B200")
    gpu.add_argument("--gpu-memory", type=float, help="memory of one GPU in GiB")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run_plan, accepts_extra=True)


def _run_merge(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.errors import UserError, report
    from finetune.merge import merge_adapter

    try:
        print(f"merged model written to {merge_adapter(args.adapter_dir, args.output_dir, args.base_model)}")
    except UserError as error:
        return report(error)
    return 0


def add_merge(subparsers) -> None:
    p = subparsers.add_parser("merge", help="merge a LoRA adapter into its base model (loads without peft)")
    p.add_argument("adapter_dir", help="a LoRA run's output_dir")
    p.add_argument("output_dir", help="where to write the merged model (new or empty)")
    p.add_argument("--base_model", help="base model id or folder (default: the one the adapter was trained on)")
    p.set_defaults(func=_run_merge)


def _run_launch(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune import launch
    from finetune.errors import UserError, report

    try:
        return launch.main(extra)
    except UserError as error:
        return report(error)


def add_launch(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", add_help=False,
        help="check the accelerate config (or plan one for the GPUs here), then accelerate launch scripts/sft.py",
        description="finetune launch [--config_file F] [--num_processes N] [--num_machines M --machine_rank R "
        "--main_process_ip IP --main_process_port P] --config recipes/M/METHOD.yaml [scripts/sft.py flags]",
    )
    p.set_defaults(func=_run_launch, accepts_extra=True)


SUBCOMMANDS = [add_plan, add_merge, add_launch]


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
    return args.func(args, extra) or 0


if __name__ == "__main__":
    sys.exit(main())
