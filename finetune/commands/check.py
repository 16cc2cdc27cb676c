"""`finetune check --config RECIPE [--config_file F] [launcher flags] [scripts/sft.py flags]`: every check a run makes
before it loads a model, without training, and every problem printed at once (as torchtune's `tune validate` does);
exit 2 if there is any. The launch is read as `finetune launch` reads it, and what the training process would see of
it (the variables accelerate exports) is made by accelerate's own launcher code; then the recipe is parsed and
checked by the same functions a run calls (finetune/checks/recipe.py `problems`), and the model folder is read: its
headers as a run reads them, then every weight's values, which a run reads only once loaded (NaN or infinite values:
model_folder.nonfinite_problems, one line per file). That read is on by default, as a check of every problem: it costs
0.6 to 1.1 s per GB of floating weights on a 2-core CPU (measured on a 3.2 GB bf16 file from the page cache; a cold
disk adds its read): 1.5 to 3 s for Llama-3.2-1B's 2.5 GB, and for GPT-OSS-120B its 4.3 GB of bf16 weights only (its
MXFP4 experts are uint8, never NaN; their scales are read as every run reads them, model_folder._scales_problem)."""

from __future__ import annotations

import argparse
import json
import os
from unittest import mock

from finetune.errors import UserError, report, say


def add_check(subparsers) -> None:
    p = subparsers.add_parser(
        "check", add_help=False,
        help="run every check that needs no model (recipe, launch files, model folder, output folder); all problems "
             "at once",
        description="finetune check [--config_file F] [--num_processes N] --config recipes/M/METHOD.yaml "
                    "[scripts/sft.py flags]",
    )
    p.set_defaults(func=_run_check, accepts_extra=True)


def _run_check(args: argparse.Namespace, extra: list[str]) -> int:
    from finetune.commands.launch import SFT_SCRIPT, launch_arguments

    arguments = launch_arguments(extra)  # the launch files' own refusals end here, as under finetune launch
    script_at = arguments.index(str(SFT_SCRIPT))
    launch_arguments, sft_arguments = arguments[:script_at + 1], arguments[script_at + 1:]
    environment, processes = training_process_environment(launch_arguments)
    with mock.patch.dict(os.environ, environment):
        found = problems_before_loading(sft_arguments, processes)
    for problem in found:
        report(problem)
    if found:
        return 2
    say("no problem found by the checks that need no model, nor in the weights' values; the data and the model's own "
        "loading are checked when the run starts.")
    return 0


def training_process_environment(launch_arguments: list[str]) -> tuple[dict[str, str], int]:
    """The variables `accelerate launch LAUNCH_ARGUMENTS` would export to its training processes (with the launch
    arguments themselves, as `finetune launch` hands them down), and how many processes it would start."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    from finetune import patches
    from finetune.config.launch_request import LAUNCH_ARGUMENTS

    args, defaults = patches.validate_launch_command(launch_command_parser().parse_args(launch_arguments))
    if args.use_deepspeed and not args.cpu:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config) if defaults else ""
        environment = prepare_deepspeed_cmd_env(args)[1]
    elif (args.use_fsdp or args.multi_gpu) and not args.cpu:
        environment = prepare_multi_gpu_env(args)
    else:
        environment = prepare_simple_launcher_cmd_env(args)[1]
    return {**environment, LAUNCH_ARGUMENTS: json.dumps(launch_arguments)}, int(args.num_processes or 1)


def problems_before_loading(sft_arguments: list[str], processes: int) -> list[UserError]:
    """What a run of these arguments would refuse before loading, in the order a run meets them (the first is the one
    it reports): the parse's (every unknown key and flag, every value of the wrong type or out of range), then every
    finding of the checks of the recipe, the launch and the output folder, then the model folder and the layers it
    names, then the weights' values. The parse sees one process (it sets up the training arguments' device); the
    checks see the launch's count."""
    from dataclasses import replace

    from finetune.run import arguments

    found = []
    try:
        run = arguments.parse_args(sft_arguments, found=found)
    except UserError as problem:  # one the parse cannot read past
        return [*found, problem]
    run.launch = replace(run.launch, world_size=processes)  # as each of the launch's processes reads it
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(processes)}):
        return _collected_problems(run, found)


def _collected_problems(run, found: list[UserError]) -> list[UserError]:
    from finetune.checks import model_folder
    from finetune.checks import recipe as recipe_checks

    try:
        found.extend(recipe_checks.problems(run))  # extended one by one: what was found stays if a check fails
        try:
            model_path = model_folder.resolve_model_path(run)
        except UserError as problem:  # the layers are read from config.json alone: a folder whose weights are
            found.append(problem)     # damaged still shows them (a folder that cannot be read shows none)
            model_path = None if run.finetune.tiny else run.model.model_name_or_path
            weights_whole = False
        else:
            weights_whole = not run.finetune.tiny  # the tiny stand-in's weights are made here, not read
        if model_path:
            found.extend(recipe_checks.each_refusal((model_folder.check_layers, run, model_path)))
        if weights_whole:  # what the load's check_finite would refuse, read from the files before it
            found.extend(model_folder.nonfinite_problems(run.model.model_name_or_path,
                                                         revision=run.model.model_revision))
    except UserError as problem:
        found.append(problem)
    except Exception:  # a check that cannot run past an earlier problem: that problem is the answer
        if not found:
            raise
    return found
