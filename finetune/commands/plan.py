"""`finetune plan --config RECIPE --gpus N`: the memory plan and the launch command, without loading anything."""

from __future__ import annotations

import argparse
import json

from finetune.commands.options import number, whole_number


def _run_plan(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.planner import choice, setup

    result = choice.plan(setup.recipe_with_flags(args.config, extra), gpus=args.gpus, gpu=args.gpu,
                          gpu_memory_gib=args.gpu_memory, nodes=args.nodes, recipe_path=args.config, extra_args=extra,
                          host_memory_gib=args.host_memory)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(choice.format_plan(result))
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
    p.add_argument("--host-memory", type=number(0, low_allowed=False),
                   help="host memory of one node in GiB (default: this machine's); a technique that needs more "
                        "(ZeRO-3 offload's CPU-side model, FSDP2's whole-model load) is not chosen")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run_plan, accepts_extra=True)
