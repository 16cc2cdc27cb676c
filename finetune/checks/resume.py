"""Relaunching a run with other arguments: what a checkpoint can continue with and what it cannot.

The run record (`finetune_run.json`) keeps the settings of the launch that wrote the checkpoints. A relaunch that
would resume from a checkpoint is compared with it before any model loads (the data fingerprint once the rows load,
still before the model):

- `FIXED`: the weights, the optimizer state or the position in the data would no longer mean what they meant; refused,
  naming each changed field, with the way out (the old values, or a new output_dir).
- `SCHEDULE`: the Trainer would silently keep the checkpoint's learning rate (the scheduler's saved base rates and the
  optimizer's saved group rates win over the new value) while the shape of the schedule changes under it; refused
  unless `--resume_with_new_schedule true`, which then applies the new one from the resumed step.
- `CHANGEABLE`: applied and printed. The Trainer itself would keep the checkpoint's logging, eval and save cadence
  (TrainerState.load_from_json); `ResumedRun` recomputes them from the new arguments.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import pickle
import re
from pathlib import Path

from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from finetune import patches, run_folder
from finetune.errors import UserError, say
from finetune.json_files import read_object

FIXED = {
    "model_name_or_path": "the model", "tiny": "the model", "tiny_width": "the model", "use_peft": "the method",
    "load_in_4bit": "the method", "load_in_8bit": "the method", "lora_r": "the adapter's shape",
    "lora_alpha": "the adapter's scale", "use_rslora": "the adapter's scale", "use_dora": "the adapter's shape",
    "lora_dropout": "the adapter", "lora_target_modules": "the adapted modules",
    "lora_target_parameters": "the adapted modules", "lora_modules_to_save": "the adapted modules",
    "dataset_name": "the data", "dataset_config": "the data", "dataset_train_split": "the data",
    "dataset_mixture": "the data", "columns": "the data", "data_fingerprint": "the data",
    "max_length": "the rows", "packing": "the rows", "padding_free": "the rows", "truncation": "the rows",
    "assistant_only_loss": "the loss", "completion_only_loss": "the loss",
    "seed": "the data order", "data_seed": "the data order", "per_device_train_batch_size": "the data position",
    "gradient_accumulation_steps": "the data position",
    "optim": "the optimizer state", "weight_decay": "the optimizer state", "adam_beta1": "the optimizer state",
    "adam_beta2": "the optimizer state", "adam_epsilon": "the optimizer state",
}


SCHEDULE = ("learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps")  # a fraction below 1 too


CHANGEABLE = (
    "max_steps", "num_train_epochs", "logging_steps", "logging_strategy", "eval_steps", "eval_strategy", "save_steps",
    "save_strategy", "save_total_limit", "max_grad_norm", "gradient_checkpointing", "torch_compile",
    "use_liger_kernel", "attn_implementation", "dtype", "report_to", "eval_samples_before_after", "sample_prompt",
    "world_size",  # with the accumulation rescaled to keep the global batch (keep_global_batch), or refused
)


# What a checkpoint's own files say of the launch that wrote it, by the name the run record gives each field: peft's
# adapter_config.json for the adapter, the Trainer's trainer_state.json for the batch.
ADAPTER_CONFIG_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "use_rslora": "use_rslora", "use_dora": "use_dora",
                         "lora_dropout": "lora_dropout", "target_parameters": "lora_target_parameters"}
TRAINER_STATE_FIELDS = {"train_batch_size": "per_device_train_batch_size"}
# The Trainer's arguments, pickled into each checkpoint (training_args.bin): the fields the run record compares that
# do not depend on the process count (the accumulation may be rescaled for another one: keep_global_batch).
TRAINING_ARGS_FIELDS = ("seed", "data_seed", "optim", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                        "learning_rate", "lr_scheduler_type", "warmup_steps", "max_length", "packing", "padding_free",
                        "assistant_only_loss", "completion_only_loss")
# The only classes a checkpoint file may build beyond torch's own (tensors, torch.Size, dtypes, containers): every
# checkpoint file a run resumes from, or a command loads, is read with torch's weights-only unpickler and these
# (`read_safely`), so that no file of a checkpoint, whoever wrote it, can run code here. A file needing any other
# class is refused in one sentence naming it.
CHECKPOINT_CLASSES = (
    # training_args.bin: the Trainer's arguments (TRL's SFTConfig) with the enums and helpers they hold
    "trl.trainer.sft_config.SFTConfig", "transformers.training_args.TrainingArguments",
    "transformers.trainer_utils.SchedulerType", "transformers.training_args.OptimizerNames",
    "transformers.trainer_utils.IntervalStrategy", "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.HubStrategy", "transformers.trainer_utils.FSDPOption",
    "transformers.debug_utils.DebugOption", "transformers.trainer_pt_utils.AcceleratorConfig",
    "accelerate.state.PartialState", "accelerate.utils.dataclasses.DistributedType",
    # ... and under DeepSpeed its plugin and configs
    "accelerate.utils.dataclasses.DeepSpeedPlugin", "transformers.integrations.deepspeed.HfDeepSpeedConfig",
    "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig",
    # rng_state*.pth: numpy's random state (transformers' own safe_globals around its read)
    "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType",
    # DeepSpeed's global_stepN/*_optim_states.pt (its *_model_states.pt need nothing beyond torch's)
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
    # torch DCP's .metadata of a sharded FSDP2 state (pytorch_model_fsdp_0/, optimizer_0/)
    "torch.distributed.checkpoint.metadata.Metadata", "torch.distributed.checkpoint.metadata.StorageMeta",
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
    "torch.distributed.checkpoint.metadata.TensorProperties", "torch.distributed.checkpoint.metadata.MetadataIndex",
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo", "pathlib.PosixPath",
)


def checkpoint_classes() -> list:
    """CHECKPOINT_CLASSES as classes, of the libraries this process has imported (DeepSpeed is not imported for a run
    that does not use it: patches.skip_unused_deepspeed) and leaving out those this version of a library does not
    have: no file it writes holds them."""
    import importlib
    import sys

    classes = []
    for dotted in CHECKPOINT_CLASSES:
        module, _, name = dotted.rpartition(".")
        if sys.modules.get(module.split(".")[0]) is None:
            continue
        with contextlib.suppress(ImportError, AttributeError):
            classes.append(getattr(importlib.import_module(module), name))
    return classes


WOULD_BUILD = re.compile(r"GLOBAL ([\w.]+)")


def unreadable_reason(error: Exception) -> str:
    """Why torch's weights-only loader would not read a file, without its advice to unpickle it anyway."""
    wanted = WOULD_BUILD.search(str(error))
    if wanted:
        return f"it would build {wanted.group(1)}, which no checkpoint holds (a pickle that can run code)"
    if isinstance(error, pickle.UnpicklingError):
        return "it holds what a checkpoint never holds (a damaged file or a pickle that can run code)"
    detail = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
    return f"it cannot be read, cut short or damaged ({detail})"


@contextlib.contextmanager
def read_safely(checkpoint: str | Path | None):
    """While resuming `checkpoint`: its files read with CHECKPOINT_CLASSES only, one that cannot be read refused
    naming it and the complete checkpoint before it to resume from instead."""
    if checkpoint is None:
        yield
        return
    checkpoint = Path(checkpoint)

    def refusal(file: Path | None, error: Exception) -> UserError:
        return UserError(f"{file or checkpoint}: {unreadable_reason(error)}, so {checkpoint.name} cannot be resumed; "
                         f"{fall_back(checkpoint)}.")

    with patches.weights_only_loads(checkpoint_classes(), refusal):
        yield


FINGERPRINT_ROWS = 1000  # rows hashed, evenly spaced: a re-staged copy of the same file matches, an edited one not


def _plain(value):
    """A value as JSON keeps it, so that a recorded value and a new one compare equal when they mean the same."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, (list, tuple, set)) and all(isinstance(item, str) for item in value):
        value = sorted(value)
    return json.loads(json.dumps(value, default=str))


def _value(run, name: str):
    if name == "world_size":
        return run.launch.world_size
    if name == "data_fingerprint":
        return run.data_fingerprint
    for section in (run.training, run.model, run.script, run.finetune):
        if hasattr(section, name):
            return getattr(section, name)
    return None


def settings(run) -> dict:
    """What the run record keeps of a launch, for the next relaunch to compare with."""
    return {name: _plain(_value(run, name)) for name in (*FIXED, *SCHEDULE, *CHANGEABLE)}


def checkpoint_settings(checkpoint: Path) -> dict:
    """The settings a checkpoint's own files hold: whether it is an adapter (adapter_config.json) or a full model
    (config.json), the adapter's shape and scale, and the per-device batch."""
    found = {}
    adapter = read_object(checkpoint / "adapter_config.json")
    if adapter:
        found["use_peft"] = True
        found |= {name: _plain(adapter[key]) for key, name in ADAPTER_CONFIG_FIELDS.items() if key in adapter}
    elif (checkpoint / "config.json").is_file():
        found["use_peft"] = False
    state = read_object(checkpoint / "trainer_state.json")
    found |= {name: state[key] for key, name in TRAINER_STATE_FIELDS.items() if key in state}
    return found | training_arguments(checkpoint)


def fall_back(checkpoint: Path) -> str:
    """The way out when `checkpoint` cannot be resumed: the newest complete checkpoint before it, or the start."""
    own_step = run_folder.step_of(checkpoint)
    older = [folder for step, folder in run_folder.checkpoint_folders(checkpoint.parent)
             if own_step is not None and step < own_step and run_folder.checkpoint_problem(folder) is None]
    if older:
        return f"resume from {older[-1]} instead (--resume_from_checkpoint {older[-1]})"
    return (f"no complete checkpoint before it is in {checkpoint.parent}: move {checkpoint} out of that folder (or "
            f"leave out --resume_from_checkpoint) to train from the start")


def check_checkpoint_weights(checkpoint: Path) -> None:
    """A checkpoint's weights (a full model's, or a LoRA adapter's against its base) checked from their safetensors
    headers as every model folder's are (finetune/checks/model_folder.py `check_model`): the Trainer loads them with
    strict=False, so a tensor missing from a checkpoint copied or damaged after its save would resume without a word
    (the base's value, or the adapter's untrained one). Sharded states (ZeRO, FSDP) are left to their readers."""
    from finetune.checks import model_folder

    full = (checkpoint / "config.json").is_file() and any(
        (checkpoint / name).is_file() for name in (model_folder.WEIGHTS, model_folder.WEIGHTS_INDEX))
    adapter = (checkpoint / model_folder.ADAPTER_CONFIG).is_file() and \
        (checkpoint / model_folder.ADAPTER_WEIGHTS[0]).is_file() and \
        isinstance(read_object(checkpoint / model_folder.ADAPTER_CONFIG).get("base_model_name_or_path"), str)
    if not (full or adapter):  # the run's own base is checked as it loads
        return
    try:
        model_folder.check_model(str(checkpoint), "--resume_from_checkpoint")
    except UserError as problem:
        what = str(problem).rsplit("; ", 1)[0]  # the fix a model folder gets: a checkpoint has another
        raise UserError(f"{what}; {fall_back(checkpoint)}.") from None
    for weights in sorted(checkpoint.glob("*.safetensors")):  # loaded after the model's own check_finite
        name = model_folder.nonfinite_tensor(weights)
        if name:
            raise UserError(f"{weights}: {name} holds NaN or infinite values, so the resumed run would train on NaN "
                            f"(its loss logged as 0); {fall_back(checkpoint)}.")


def check_optimizer_state(checkpoint: Path) -> None:
    """The Trainer's optimizer.pt (one process, DDP) holding NaN or infinite values in a tensor of its state (a moment
    of Adam's, of one parameter): the Trainer loads it as it is and its first step carries them into the weights (a run
    resumed from Adam moments holding NaN trained on NaN, logged its loss as 0 and saved NaN weights, exit 0). Read
    from its memory map one tensor at a time, weights-only (`read_safely`), ~1 s per GB on a 2-core CPU (a LoRA run's
    is megabytes, a full fine-tune's twice the model in float32). A file this read refuses (cut short, a pickle of
    another class, the format before torch 1.6, which cannot be mapped) is left to the Trainer's own read, which refuses
    or reads it as before; the sharded states of ZeRO (global_stepN/) and FSDP (optimizer_0/) to their readers."""
    import torch

    path = checkpoint / "optimizer.pt"
    if not path.is_file():
        return
    try:
        with read_safely(checkpoint):
            saved = torch.load(path, map_location="cpu", mmap=True)
    except UserError:
        return
    per_parameter = saved.get("state") if isinstance(saved, dict) else None
    for index, values in (per_parameter if isinstance(per_parameter, dict) else {}).items():
        for key, value in (values if isinstance(values, dict) else {}).items():
            if torch.is_tensor(value) and value.is_floating_point() and \
                    not torch.isfinite(torch.sum(value, dtype=torch.float32)):
                raise UserError(f"{path}: state[{index}].{key} holds NaN or infinite values, which the resumed run "
                                f"would carry into the weights it updates from its first step (its loss logged as 0 "
                                f"once they are NaN); {fall_back(checkpoint)}.")


def check_trainer_state(run, checkpoint: Path) -> None:
    """A checkpoint's trainer_state.json must agree with its folder and the run: the Trainer resumes at its
    `global_step` whatever the folder's name, and from a step beyond max_steps trains nothing and saves the run as
    finished there."""
    state_file = checkpoint / "trainer_state.json"
    step = read_object(state_file).get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{state_file}: holds no step (`global_step`), so {checkpoint.name} cannot be resumed; "
                        f"{fall_back(checkpoint)}.")
    own_step = run_folder.step_of(checkpoint)
    if own_step is not None and step != own_step:
        raise UserError(f"{state_file}: `global_step` is {step} in the folder of step {own_step}, so the file was "
                        f"changed or belongs to another checkpoint; {fall_back(checkpoint)}.")
    max_steps = run.training.max_steps
    if 0 < max_steps < step:
        raise UserError(f"{state_file}: `global_step` is {step}, past this run's max_steps {max_steps}, so resuming "
                        f"would train nothing and save the run as finished at step {step}; raise --max_steps above "
                        f"{step}, or pick a new --output_dir to train {max_steps} steps.")


def training_arguments(checkpoint: Path) -> dict:
    """TRAINING_ARGS_FIELDS as the checkpoint's training_args.bin holds them (read_safely)."""
    path = checkpoint / "training_args.bin"
    if not path.is_file():
        return {}
    import torch

    with read_safely(checkpoint):
        arguments = torch.load(path)
    return {name: _plain(getattr(arguments, name)) for name in TRAINING_ARGS_FIELDS if hasattr(arguments, name)}


def data_fingerprint(dataset) -> str:
    """The training rows' count and a hash of up to FINGERPRINT_ROWS of them, evenly spaced."""
    count = len(dataset)
    digest = hashlib.sha256(str(count).encode())
    step = max(1, count // FINGERPRINT_ROWS)
    for row in dataset.select(range(0, count, step)):
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"{count} rows, sha256 {digest.hexdigest()[:16]}"


def _changes(recorded: dict, now: dict, names) -> list[tuple[str, object, object]]:
    return [(name, recorded[name], now[name]) for name in names if name in recorded and recorded[name] != now[name]]


def _listed(changes) -> str:
    return ", ".join(f"`{name}` ({old!r} -> {new!r})" for name, old, new in changes)


def check_relaunch(run, recorded: dict, checkpoint: Path, output_dir: Path) -> list[str]:
    """Refuse what a resume from `checkpoint` cannot continue with; return the changed names it will apply."""
    now = settings(run)
    if keep_global_batch(run, recorded, checkpoint, output_dir):  # what a step takes is kept: compared as before
        now["gradient_accumulation_steps"] = recorded["gradient_accumulation_steps"]
    fixed = _changes(recorded, now, [name for name in FIXED if name != "data_fingerprint"])
    where, way_out = _whose(run, checkpoint, output_dir)
    if fixed:
        reasons = sorted({FIXED[name] for name, _, _ in fixed})
        raise UserError(
            f"{where}: this relaunch changes {_listed(fixed)}, which {checkpoint.name} cannot continue with (they "
            f"change {' and '.join(reasons)}); relaunch with the values it was trained with, or {way_out} to train a "
            f"new run."
        )
    schedule = _changes(recorded, now, SCHEDULE)
    if schedule and not run.finetune.resume_with_new_schedule:
        raise UserError(
            f"{where}: this relaunch changes {_listed(schedule)}, which resuming from {checkpoint.name} would "
            f"silently ignore (the checkpoint's learning rate wins); add --resume_with_new_schedule true to apply it "
            f"from the resumed step, or relaunch with the old value."
        )
    applied = schedule + _changes(recorded, now, CHANGEABLE)
    if applied and int(os.environ.get("RANK", "0")) == 0:
        say(f"resuming from {checkpoint.name} with {_listed(applied)} applied from its step on.")
    return [name for name, _, _ in applied]


def keep_global_batch(run, recorded: dict, checkpoint: Path, output_dir: Path) -> bool:
    """Another process count: under DDP (a full optimizer state) the accumulation is rescaled so that each step
    takes the same rows as before (accelerate deals batch i to process i mod N, so N processes accumulating k batches
    take the batches one process accumulating N*k takes); said in one line. Refused where that cannot hold: a sharded
    FSDP or ZeRO state, an accumulation that does not divide, or one changed by this relaunch too. True when
    rescaled."""
    before, after = recorded.get("world_size"), _value(run, "world_size")
    accumulation = recorded.get("gradient_accumulation_steps")
    if before is None or before == after or accumulation is None:
        return False
    if (run.launch.strategy not in ("single", "ddp") or accumulation != run.training.gradient_accumulation_steps
            or (accumulation * before) % after):
        where, way_out = _whose(run, checkpoint, output_dir)
        raise UserError(
            f"{where}: {checkpoint.name} was trained by {before} process(es) and this relaunch runs {after}, which "
            f"it cannot continue with under {run.launch.strategy} with `gradient_accumulation_steps` "
            f"{run.training.gradient_accumulation_steps} (the global batch and the rows each step takes would change); "
            f"relaunch with {before} processes, or {way_out}."
        )
    run.training.gradient_accumulation_steps = accumulation * before // after
    say(f"resuming {checkpoint.name} of {before} process(es) with {after}: gradient_accumulation_steps {accumulation} "
        f"-> {run.training.gradient_accumulation_steps}, so each step takes the same rows as before.")
    return True


def check_data_unchanged(run, recorded: dict, checkpoint: Path | None, output_dir: Path, train_set) -> None:
    """Once the rows load (before the model): the data a checkpoint resumes into is the data it was trained on."""
    run.data_fingerprint = data_fingerprint(train_set)
    before = recorded.get("data_fingerprint")
    if checkpoint is None or before is None or before == run.data_fingerprint:
        return
    where, way_out = _whose(run, checkpoint, output_dir)
    raise UserError(
        f"{where}: the training rows changed since {checkpoint.name} was saved ({before}, now "
        f"{run.data_fingerprint}), so resuming would skip or repeat rows; relaunch with the same data, or {way_out} "
        f"to train on the new rows."
    )


def _whose(run, checkpoint: Path, output_dir: Path) -> tuple[str, str]:
    """Where a refusal to resume points, and the way out that trains a new run instead: a checkpoint named by
    --resume_from_checkpoint (another run's, it may be) is left by dropping the flag, where a new --output_dir would
    still resume it; the output folder's own checkpoint by a new --output_dir."""
    asked = run.training.resume_from_checkpoint
    if asked and str(asked).lower() not in ("true", "1", "yes"):
        return f"{checkpoint} (--resume_from_checkpoint)", "drop --resume_from_checkpoint"
    return str(output_dir), "pick a new --output_dir"


class NothingLeftToTrain(Exception):
    """The checkpoint resumed from is at max_steps (its final save was cut short): nothing is left to train."""


def schedule_start(checkpoint: Path | None) -> int | None:
    """The step a new schedule starts from when resuming `checkpoint`: its own step when the schedule that wrote it
    had ended there (a finished run trained on), the start a run trained on that way recorded, else None (the
    checkpoint's own schedule goes on)."""
    if checkpoint is None:
        return None
    state = read_object(checkpoint / "trainer_state.json")
    step, ended_at = state.get("global_step"), state.get("max_steps")
    if isinstance(step, int) and isinstance(ended_at, int) and 0 < ended_at <= step:
        return step
    recorded = (state.get("stateful_callbacks") or {}).get(ResumedRun.__name__) or {}
    return (recorded.get("args") or {}).get("schedule_start")


class ResumedRun(TrainerCallback, ExportableState):
    """On a resumed run: the new logging/eval/save cadence, and with --resume_with_new_schedule the new learning rate
    (the scheduler's lambdas already follow the new arguments; its base rates and the groups' rates come from the
    checkpoint). A run trained on past the end of its schedule gets a new schedule over the new steps (the old one
    ended at rate 0, where the first new step would train; its start is kept in each checkpoint's trainer_state.json
    for a later resume). A run resumed at max_steps stops before the step the Trainer would otherwise train past it
    (its loop checks max_steps only after a step)."""

    def __init__(self, new_schedule: bool, learning_rate: float, schedule_start: int | None = None):
        self.new_schedule = new_schedule
        self.learning_rate = learning_rate
        self.schedule_start = schedule_start

    def state(self) -> dict:
        return {"args": {"new_schedule": self.new_schedule, "learning_rate": self.learning_rate,
                         "schedule_start": self.schedule_start}, "attributes": {}}

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == 0:
            return
        state.compute_steps(args, state.max_steps)
        if optimizer is None or lr_scheduler is None:
            return
        if self.schedule_start is not None and state.max_steps > self.schedule_start:
            start_new_schedule(args, optimizer, lr_scheduler, self.schedule_start, state.max_steps)
            if state.global_step == self.schedule_start:
                say(f"training on past step {self.schedule_start}, where the run's schedule ended: a new "
                    f"{getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)} schedule over steps "
                    f"{self.schedule_start + 1}-{state.max_steps}, without warmup, instead of its end's rate 0.")
        if self.new_schedule:
            apply_learning_rate(optimizer, lr_scheduler, self.learning_rate)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps > 0:
            raise NothingLeftToTrain()


def start_new_schedule(args, optimizer, lr_scheduler, start: int, max_steps: int) -> None:
    """Give the scheduler (every group) the shape of the run's schedule over the steps from `start` to `max_steps`,
    and set each group's rate to where it begins."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import get_scheduler

    if not isinstance(lr_scheduler, LambdaLR):  # a schedule of DeepSpeed's or one on plateaus does not end at 0
        return
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # get_scheduler writes to its groups
    # no warmup: the optimizer's moments are warm already, and a warmup of the recipe's fraction of a few new steps
    # would train the first of them at rate 0 again
    fresh = get_scheduler(args.lr_scheduler_type, stand_in, num_warmup_steps=0, num_training_steps=max_steps - start,
                          scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    shape = fresh.lr_lambdas[0]
    lr_scheduler.lr_lambdas = [lambda step: shape(step - start)] * len(lr_scheduler.lr_lambdas)
    rates = [base * factor(lr_scheduler.last_epoch) for base, factor in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate


def apply_learning_rate(optimizer, lr_scheduler, learning_rate: float) -> None:
    """Scale every group's base rate so that the largest becomes `learning_rate` (groups keep their ratios), and set
    each group's current rate to where the new schedule is at the resumed step."""
    from torch.optim.lr_scheduler import LambdaLR

    if not isinstance(lr_scheduler, LambdaLR):
        raise UserError(
            f"command line: --resume_with_new_schedule applies to the Trainer's own schedules, not to "
            f"{type(lr_scheduler).__name__}; relaunch without it and with the old learning rate."
        )
    scale = learning_rate / max(lr_scheduler.base_lrs)
    lr_scheduler.base_lrs = [base * scale for base in lr_scheduler.base_lrs]
    rates = [base * factor(lr_scheduler.last_epoch)
             for base, factor in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
    for group, base, rate in zip(optimizer.param_groups, lr_scheduler.base_lrs, rates):
        group["initial_lr"], group["lr"] = base, rate
