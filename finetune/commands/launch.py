"""`finetune launch`: check the accelerate config file, or let the planner choose one for the GPUs this machine has,
then hand over to `accelerate launch ... scripts/sft.py` with it.

    finetune launch [--config_file accelerate_configs/X.yaml] [--num_processes N ...] --config RECIPE [flags]

`accelerate launch` reads its config file before any of our code runs, so a typo there (broken YAML, an unknown
`distributed_type`, a misspelled key, a missing DeepSpeed JSON) ends in accelerate's own traceback. Here the same file
is read first with accelerate's own loader and every problem becomes one sentence naming the file, the field and the
fix, with exit code 2; so does a field this toolkit would not run as asked (finetune/checks/launch.py, which every
training process runs again against the recipe). Everything after the launcher flags goes to scripts/sft.py unchanged.
A run a SIGTERM stopped exits 143 (see `run_and_report`).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import yaml

from finetune import outcome
from finetune.config.files import local_or_shipped, read_yaml_mapping, shipped
from finetune.config.launch_request import (
    FSDP_V1_REFUSAL,
    LAUNCH_ARGUMENTS,
    arguments_after_accelerate_launch,
    read_deepspeed_config,
)
from finetune.errors import UserError, say


def _run_launch(args: argparse.Namespace, extra: list[str]) -> int:
    return main(extra)


def add_launch(subparsers) -> None:
    p = subparsers.add_parser(
        "launch", add_help=False,
        help="check the accelerate config (or plan one for the GPUs here), then accelerate launch scripts/sft.py",
        description="finetune launch [--config_file F] [--num_processes N] [--num_machines M --machine_rank R "
        "--main_process_ip IP --main_process_port P] --config recipes/M/METHOD.yaml [scripts/sft.py flags]",
    )
    p.set_defaults(func=_run_launch, accepts_extra=True)


SFT_SCRIPT = shipped("scripts/sft.py")


# The `accelerate launch` flags this command understands; any other flag is scripts/sft.py's.
LAUNCHER_FLAGS = ("config_file", "num_processes", "num_machines", "machine_rank", "main_process_ip",
                  "main_process_port")


def check_accelerate_config(config_file: str) -> str:
    """The accelerate config file to launch with, checked as accelerate will read it, or a UserError saying what to
    fix in it. A shipped file stands in for a relative path missing here (outside the repository), and a DeepSpeed
    JSON found that way is written into a copy of the file as an absolute path, since accelerate reads it from here."""
    given = config_file
    config_file = local_or_shipped(config_file)
    values = read_yaml_mapping(config_file, "accelerate config", "pass one of accelerate_configs/*.yaml")
    from accelerate.commands.config.config_args import load_config_from_file  # torch: only once the YAML reads
    from accelerate.utils import DistributedType

    if config_file != given:
        config_file = _with_deepspeed_file_found(config_file, values)
    kinds = sorted(kind.value for kind in DistributedType)
    if values.get("distributed_type", "NO") not in kinds:
        raise UserError(
            f"{config_file}: `distributed_type: {values['distributed_type']}` is not a type accelerate knows; use "
            f"MULTI_GPU (DDP), FSDP, DEEPSPEED or NO, as the files in accelerate_configs/ do."
        )
    if values.get("distributed_type") == "FSDP" and (values.get("fsdp_config") or {}).get("fsdp_version") != 2:
        raise UserError(f"{config_file}: {FSDP_V1_REFUSAL}")
    for key in ("num_processes", "num_machines"):
        if key in values and not (isinstance(values[key], int) and values[key] >= 1):
            raise UserError(f"{config_file}: `{key}: {values[key]}` must be a whole number of at least 1; fix it.")
    deepspeed_file = (values.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if values.get("distributed_type") == "DEEPSPEED" and deepspeed_file:
        read_deepspeed_config(deepspeed_file, config_file)
    try:
        load_config_from_file(config_file)
    except ValueError as error:
        text = " ".join(str(error).split())
        if "unknown keys" in text:
            keys = ast.literal_eval(text.split("(", 1)[1].split(")", 1)[0])  # accelerate lists them as a Python list
            named = ", ".join(f"`{key}`" for key in keys)
            raise UserError(f"{config_file}: unknown {'keys' if len(keys) > 1 else 'key'} {named}; remove "
                            f"{'them' if len(keys) > 1 else 'it'} or fix the spelling.") from None
        raise UserError(f"{config_file}: {text.rstrip('.')}; fix that field.") from None
    return config_file


def _with_deepspeed_file_found(config_file: str, values: dict) -> str:
    deepspeed = values.get("deepspeed_config") or {}
    relative = deepspeed.get("deepspeed_config_file")
    if not relative or local_or_shipped(relative) == relative:
        return config_file
    copy = Path(tempfile.mkdtemp(prefix="finetune-launch-")) / Path(config_file).name
    found = {**deepspeed, "deepspeed_config_file": local_or_shipped(relative)}
    copy.write_text(yaml.safe_dump({**values, "deepspeed_config": found}))
    return str(copy)


def planned_config(sft_args: list[str], nodes: int) -> tuple[str | None, int]:
    """No config file given: the planner's choice for the GPUs visible here; no GPU: one process on the CPU. The
    planner reads the recipe and flags as the run will (setup.setup_from_recipe); a mistake there is a UserError."""
    import torch

    from finetune.planner import choice, memory, setup

    gpus = torch.cuda.device_count()
    if gpus == 0:
        say("launch: no GPU visible, so one process on the CPU (no accelerate config file)")
        return None, 1
    if "--config" not in sft_args:
        raise UserError("command line: finetune launch without --config_file needs --config recipes/M/METHOD.yaml "
                        "to plan for; add it, or pass --config_file.")
    index = sft_args.index("--config")
    if index + 1 >= len(sft_args):
        raise UserError("command line: --config needs a recipe path; pass --config recipes/MODEL/METHOD.yaml.")
    recipe, flags = sft_args[index + 1], sft_args[:index] + sft_args[index + 2:]
    values = setup.recipe_with_flags(recipe, flags)
    if values.get("deepspeed"):  # transformers' own DeepSpeed JSON decides under a plain multi-GPU launch
        asked = "--deepspeed" if "--deepspeed" in flags or any(f.startswith("--deepspeed=") for f in flags) else \
            f"`deepspeed` in {recipe}"
        say(f"launch: {asked} decides the strategy: accelerate_configs/ddp.yaml on {gpus * nodes} GPU(s), not planned")
        return str(shipped(memory.CONFIG_FILES["ddp"])), gpus * nodes
    memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    result = choice.plan(values, gpus=gpus, gpu=torch.cuda.get_device_name(0),
                       gpu_memory_gib=memory_gib, nodes=nodes, recipe_path=recipe)
    print(choice.format_plan(result), flush=True)
    if not result.fits:
        raise UserError(f"{recipe}: no strategy fits {gpus * nodes} GPU(s) of {memory_gib:.0f} GiB; "
                        f"try one of the changes listed above.")
    return str(shipped(memory.CONFIG_FILES[result.technique])), gpus * nodes


def default_config_file() -> str:
    from accelerate.commands.config.config_args import default_config_file

    return default_config_file


def accelerate_command(argv: list[str]) -> list[str]:
    """`accelerate launch ...` for `finetune launch ARGV`: the launcher, then `launch_arguments(argv)`. The launch
    module itself, with the same parser and launcher as `accelerate launch`: the `accelerate` command first imports
    every other subcommand (`estimate-memory` imports transformers), 0.85 s before the training process starts."""
    return [sys.executable, "-m", "accelerate.commands.launch", *launch_arguments(argv)]


def launch_arguments(argv: list[str]) -> list[str]:
    """The arguments `accelerate launch` gets for `finetune launch ARGV`, its config file checked (or planned)."""
    parser = argparse.ArgumentParser(prog="finetune launch", add_help=False, allow_abbrev=False)
    for flag in LAUNCHER_FLAGS:
        parser.add_argument(f"--{flag}")
    launcher, sft_args = parser.parse_known_args(argv)
    for flag, lowest, highest in (("num_processes", 1, None), ("num_machines", 1, None), ("machine_rank", 0, None),
                                  ("main_process_port", 1, 65535)):
        value = getattr(launcher, flag)
        if value is not None and not (value.isdigit() and lowest <= int(value) <= (highest or int(value))):
            bounds = f"from {lowest} to {highest}" if highest else f"of at least {lowest}"
            raise UserError(f"command line: `--{flag} {value}` must be a whole number {bounds}; fix that flag.")
    nothing_configured = not launcher.config_file and not Path(default_config_file()).is_file()
    if launcher.config_file:
        launcher.config_file = check_accelerate_config(launcher.config_file)
    elif Path(default_config_file()).is_file():
        check_accelerate_config(default_config_file())  # what `accelerate launch` reads when given no file
    else:
        launcher.config_file, processes = planned_config(sft_args, int(launcher.num_machines or 1))
        launcher.num_processes = launcher.num_processes or (processes if launcher.config_file else None)
    arguments = ["--quiet"]  # a failed run ends with its own error, not the launcher's traceback repeating it
    for flag in LAUNCHER_FLAGS:
        if getattr(launcher, flag) is not None:
            arguments += [f"--{flag}", str(getattr(launcher, flag))]
    if nothing_configured and not launcher.config_file:
        arguments += _values_accelerate_would_warn_about(launcher.num_processes, int(launcher.num_machines or 1))
    arguments += [str(SFT_SCRIPT), *sft_args]
    from finetune.checks import launch as accelerate_checks  # torch: only once the config file reads

    request = accelerate_checks.request_from_command(arguments, default_config_file())
    if request is not None:  # else accelerate says what is wrong with the command itself
        accelerate_checks.check_request(request, int(request.value("num_processes") or 1))  # notes: in training
    return arguments


def _values_accelerate_would_warn_about(processes: str | None, machines: int) -> list[str]:
    """Without a config file `accelerate launch` fills these in itself and prints a warning listing them. Its own
    choices, passed explicitly; mixed precision stays the recipe's (`bf16: true` sets it in the training process)."""
    import psutil

    values = ["--num_machines", str(machines), "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes is None:
        values += ["--num_processes", "1"]
    if not os.environ.get("OMP_NUM_THREADS"):
        physical = psutil.cpu_count(logical=False) or 1
        values += ["--num_cpu_threads_per_process", str(max(physical // int(processes or 1), 1))]
    return values


ERROR_PREFIX = "error: "  # how finetune.errors.report prints a user mistake: what follows it is held back


def run_and_report(command: list[str]) -> tuple[int, str | None, str | None]:
    """Run `accelerate launch ...`, its output shown as it comes; once a process has printed a user mistake's one
    sentence, what the launcher prints after it (the other ranks stopping, torch's failure report) is held back.
    The training processes are given the launcher's arguments in the environment (config_files.LAUNCH_ARGUMENTS), and
    write back the user mistake's sentence and the folder the run saved to (finetune/outcome.py). Returns those with
    the exit code. The exit code of a run a SIGTERM stopped is 143, whatever the launcher made of
    it: accelerate 1.15 exits 1 after its torchrun re-raises the signal, and accelerate 1.15-1.16 exit 1 when only the
    training processes were signalled."""
    with tempfile.TemporaryDirectory(prefix="finetune-outcome-") as folder:
        outcome_file = Path(folder) / "outcome.json"
        environment = {**os.environ, outcome.OUTCOME_FILE: str(outcome_file)}
        arguments = arguments_after_accelerate_launch(command)
        if arguments is not None:  # the training processes check them against the recipe (checks/launch.py)
            environment[LAUNCH_ARGUMENTS] = json.dumps(arguments)
        code = _run_showing_output(command, environment)
        ended = outcome.read(outcome_file)
    if code != 0 and ended.get("status") == outcome.PREEMPTED:
        from finetune.run_folder import PREEMPTED_EXIT_CODE  # transformers: only once a run has ended

        code = PREEMPTED_EXIT_CODE
    sentence = ended.get("error") if ended.get("status") == outcome.USER_ERROR else None
    saved_to = ended.get("output_dir") if ended.get("status") in (outcome.SAVED, outcome.FINISHED_ALREADY) else None
    return code, sentence, saved_to


def _run_showing_output(command: list[str], environment: dict) -> int:
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment)
    error_shown = threading.Event()

    def copy(stream, target, stop_after_error: bool):
        pending = b""
        for chunk in iter(lambda: stream.read1(65536), b""):
            if error_shown.is_set() and stop_after_error:
                continue
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            for line in lines:
                text = line.decode(errors="replace")
                if stop_after_error and error_shown.is_set():
                    continue
                if stop_after_error and text.startswith(ERROR_PREFIX):
                    error_shown.set()
                target.write(text + "\n")
                target.flush()
            if pending and b"\r" in pending:  # progress bars redraw a line without ending it
                target.write(pending.decode(errors="replace"))
                target.flush()
                pending = b""
        if pending and not error_shown.is_set():
            target.write(pending.decode(errors="replace"))

    readers = [threading.Thread(target=copy, args=(child.stdout, sys.stdout, False), daemon=True),
               threading.Thread(target=copy, args=(child.stderr, sys.stderr, True), daemon=True)]
    for reader in readers:
        reader.start()
    forward = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: child.send_signal(signal.SIGTERM)) if forward else None
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        child.wait()
        raise
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)
        for reader in readers:
            reader.join(timeout=10)


def main(argv: list[str]) -> int:
    """Run `accelerate launch ...`: its exit code is the run's (2 after a user mistake, shown as its one line)."""
    command = accelerate_command(argv)
    say("launch: " + " ".join(shlex.quote(part) for part in command))
    code, sentence, _ = run_and_report(command)
    return 2 if sentence else code
