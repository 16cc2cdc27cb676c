"""Training from Python (a notebook cell): `finetune.train(...)` in the calling process, `finetune.launch(...)` as
N processes through `accelerate launch`. Both take a recipe and overrides named like the recipe's keys.

    import finetune
    result = finetune.train(config="recipes/llama-3.2-1b/lora.yaml", tiny=True, max_steps=20)
    result = finetune.launch(config="recipes/llama-3.2-1b/full.yaml", num_processes=2,
                             accelerate_config="accelerate_configs/ddp.yaml", tiny=True, max_steps=20)
    result.output_dir, result.metrics

`launch` starts `accelerate launch` as a subprocess rather than accelerate's `notebook_launcher`: the processes then
read the same accelerate config file as on the command line (FSDP, DeepSpeed), are checked the same way, and a
crashed or killed run cannot take the notebook's kernel with it. `notebook_launcher` takes no config file, forks the
kernel, and refuses to start N processes once bitsandbytes is imported in it ("Libraries known to initialize device
upon import have been imported already"), which peft does on import wherever it is installed (accelerate 1.16,
measured; `finetune.train` keeps it out of a run that does not quantize).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from finetune.errors import RunFinished, UserError, say_finished

TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainResult:
    output_dir: Path
    metrics: dict = field(default_factory=dict)  # the final train summary and the last eval loss
    log_history: list[dict] = field(default_factory=list)  # every logged step, as in trainer_state.json


def to_argv(config: str | os.PathLike | None, overrides: dict) -> list[str]:
    """`config` and keyword overrides as scripts/sft.py's flags: True/False as true/false, lists as several values,
    mappings as JSON."""
    argv = ["--config", str(config)] if config is not None else []
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, bool):
            value = str(value).lower()
        if isinstance(value, dict):
            value = json.dumps(value)
        argv += [f"--{key}", *(map(str, value) if isinstance(value, (list, tuple)) else [str(value)])]
    return argv


def result_of(output_dir: str | os.PathLike, log_history: list[dict] | None = None) -> TrainResult:
    output_dir = Path(output_dir)
    if log_history is None:
        state = output_dir / TRAINER_STATE
        log_history = json.loads(state.read_text())["log_history"] if state.is_file() else []
    metrics = next((dict(entry) for entry in reversed(log_history) if "train_runtime" in entry), {})
    evaluation = next((entry for entry in reversed(log_history) if "eval_loss" in entry), None)
    if evaluation is not None:
        metrics["eval_loss"] = evaluation["eval_loss"]
    return TrainResult(output_dir, metrics, log_history)


def train(config: str | os.PathLike | None = None, **overrides) -> TrainResult:
    """Train in this process, as `python scripts/sft.py --config CONFIG --key value ...` would; no arguments at all
    train the tiny default. A user mistake raises finetune.errors.UserError with its one sentence, before loading."""
    argv = to_argv(config, overrides)
    with process_state_kept():
        from finetune import sft

        try:
            run, trainer = sft.main(argv or None)
        except RunFinished as finished:
            say_finished(finished)
            return result_of(finished.output_dir)
    return result_of(run.training.output_dir, trainer.state.log_history)


@contextlib.contextmanager
def process_state_kept():
    """What a run changes in its process, put back for the notebook's next run: the environment (a recipe's `env:`,
    the launcher-style compile settings, the MLflow run it continues), inductor's activation budget, the SIGTERM
    handler (a run's saves its checkpoint on SIGTERM) and the libraries it kept out (patches.skip_unused_libraries)."""
    import signal

    environment = dict(os.environ)  # before torch is imported: importing it sets TORCHINDUCTOR_CACHE_DIR
    from finetune import patches

    budget = patches.activation_memory_budget()
    handler = signal.getsignal(signal.SIGTERM)
    present = set(sys.modules)
    try:
        yield
    finally:
        patches.bring_back(set(patches.HIDDEN_WHILE_IMPORTING) - present)
        patches.set_activation_memory_budget(budget)
        signal.signal(signal.SIGTERM, handler)
        os.environ.clear()
        os.environ.update(environment)


def launch(config: str | os.PathLike | None = None, num_processes: int | None = None,
           accelerate_config: str | os.PathLike | None = None, **overrides) -> TrainResult:
    """Train as `finetune launch [--config_file ACCELERATE_CONFIG] [--num_processes N] --config CONFIG ...`: the
    accelerate config checked first, the processes' output shown here, and back when they finish. A user mistake
    (in any process) raises UserError with its sentence; any other failure raises RuntimeError."""
    from finetune.commands import launch as launcher

    launcher_flags = []
    if accelerate_config is not None:
        launcher_flags += ["--config_file", str(accelerate_config)]
    if num_processes is not None:
        launcher_flags += ["--num_processes", str(num_processes)]
    command = launcher.accelerate_command([*launcher_flags, *to_argv(config, overrides)])
    code, sentence, saved_to = launcher.run_and_report(command)
    if sentence:
        raise UserError(sentence)
    if code != 0 or saved_to is None:
        raise RuntimeError(f"the training processes exited with code {code} (their output is above)")
    return result_of(saved_to)
