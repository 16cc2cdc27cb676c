"""Preemption-safe checkpoints: a run killed at any moment resumes from a complete checkpoint, and SIGTERM is a save.

- **Completeness marker.** The Trainer writes `checkpoint-N/` file by file; a kill during that write leaves a folder
  that looks like a checkpoint but is not one. After every rank has finished writing, the main process fsyncs the
  files and writes `finetune_checkpoint.json` last (write aside, fsync, rename) listing every file and its size.
  Resume (`resume_point`) takes the newest checkpoint whose marker is there and whose files all match it, and prints
  which one it took and why it skipped any other (no marker, a file missing, a file truncated, a broken safetensors).
- **Rotation after the marker.** `save_total_limit` rotation is moved from inside the Trainer's save (before the
  marker exists) to after the marker is written, and it only ever deletes checkpoints older than the newest complete
  one, so it never deletes the only complete checkpoint.
- **SIGTERM is a save.** A SIGTERM only sets a flag; at the next step boundary every rank agrees on it (one all-reduce
  of a flag per step), the checkpoint of that step is written, training stops, and the process exits with
  `PREEMPTED_EXIT_CODE` (143 = 128 + SIGTERM, "terminated, not finished": a requeue loop relaunches it, and the
  relaunch resumes from that checkpoint). The time from the signal to the saved checkpoint is printed: the grace
  period the scheduler gives between SIGTERM and SIGKILL must be longer than that. A SIGTERM that arrives before any
  step since the last checkpoint (loading, compiling the first step) has nothing to save: the run exits at once
  instead of finishing a step that may take minutes. Each training process also gets SIGTERM when its launcher dies
  (`die_with_launcher`), so none outlives a launcher killed with SIGKILL.
- **Faults at save time.** A save that fails (no space left, no write permission, read-only file system) ends as a
  `UserError` naming the folder, the reason and the fix; the half-written folder is removed and the previous complete
  checkpoint is left as it was.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from finetune import outcome, patches, run_folder
from finetune.errors import UserError, first_line, say
from finetune.run_folder import MARKER, PREEMPTED_EXIT_CODE

IO_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EACCES: "no write permission",
             errno.EPERM: "no write permission", errno.EROFS: "the file system is read-only", errno.EDQUOT: "disk quota exceeded"}


IO_WORDS = {"no space left": errno.ENOSPC, "storagefull": errno.ENOSPC, "permission denied": errno.EACCES,
            "read-only file system": errno.EROFS, "readonlyfilesystem": errno.EROFS, "quota": errno.EDQUOT}


# What torch.save and safetensors say when a write fails without an errno (a full disk, as a rule).
UNSPECIFIC_WRITE_FAILURES = ("file write failed", "unexpected pos", "ioerror", "error while serializing")


def io_failure_reason(error: BaseException) -> str | None:
    """'no space left on the device' and the like, where the error's errno or its message names one."""
    if isinstance(error, OSError) and error.errno in IO_ERRNOS:
        return IO_ERRNOS[error.errno]
    text = str(error).lower().replace(" ", "")
    for words, code in IO_WORDS.items():
        if words.replace(" ", "") in text:
            return IO_ERRNOS[code]
    return None


def save_failure_reason(error: BaseException, folder: str | Path | None = None) -> str | None:
    """'no space left on the device' and the like when a save failed for a reason in the user's hands, else None."""
    if reason := io_failure_reason(error):
        return reason
    text = str(error).lower().replace(" ", "")
    if isinstance(error, OSError) or any(words.replace(" ", "") in text for words in UNSPECIFIC_WRITE_FAILURES):
        free = _free_bytes(folder)
        if free is not None and free < 16 * 2**20:
            return f"{IO_ERRNOS[errno.ENOSPC]}: {free // 1024} KiB free"
        return f"a write failed: {first_line(error)}"
    return None


def _free_bytes(folder: str | Path | None) -> int | None:
    try:
        return shutil.disk_usage(folder).free if folder is not None else None
    except OSError:
        return None


def _any_rank(trainer, flag: bool) -> bool:
    import torch
    import torch.distributed as dist

    if trainer.accelerator.num_processes == 1 or not dist.is_available() or not dist.is_initialized():
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=trainer.accelerator.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def save_checkpoint_completely(trainer, save, model, trial=None) -> None:
    """Run the Trainer's own checkpoint save (`save`), then flush it and write the completeness marker; rotation
    after the marker; a failed write removes the half-written folder and ends in one sentence."""
    step = trainer.state.global_step
    run_dir = patches.trainer_output_dir(trainer, trial)
    folder = run_dir / f"checkpoint-{step}"
    main = trainer.accelerator.is_main_process
    if main and folder.is_dir() and not (folder / MARKER).is_file():
        shutil.rmtree(folder)  # an earlier save of this same step was interrupted; write it afresh
        say(f"removed {folder}: an interrupted save of the same step")
    trainer.accelerator.wait_for_everyone()
    started, failure = time.monotonic(), None
    try:
        with patches.rotation_deferred():
            save(model, trial)
    except Exception as error:  # a failed write is reported below; anything else is re-raised
        if save_failure_reason(error, run_dir) is None:
            raise
        failure = error
    if _any_rank(trainer, failure is not None):
        previous = run_folder.newest_complete(run_dir)
        if main:
            shutil.rmtree(folder, ignore_errors=True)
        if failure is None:
            sys.exit(2)  # another rank failed to write and reports it
        keep = f"{previous} is intact and a relaunch resumes from it" if previous else "no earlier checkpoint exists"
        raise UserError(
            f"{run_dir}: could not write {folder.name} ({save_failure_reason(failure, run_dir)}); {keep}; free space or fix "
            f"the folder's permissions (or pick another --output_dir) and relaunch."
        )
    if main:
        run_folder.write_marker(folder, step, trainer.accelerator.num_processes)
        for deleted in run_folder.rotate(run_dir, trainer.args.save_total_limit, {trainer.state.best_model_checkpoint} - {None}):
            say(f"deleted {deleted} (save_total_limit={trainer.args.save_total_limit})")
    trainer.accelerator.wait_for_everyone()
    trainer.last_save_seconds = time.monotonic() - started


@contextlib.contextmanager
def writes_reported(output_dir: str | Path):
    """A write that fails for want of space or permission (an end-of-training record, the loss plot, the state beside
    the final model) ends in one sentence saying what is intact, instead of a traceback."""
    try:
        yield
    except OSError as error:
        if error.errno not in IO_ERRNOS:
            raise
        newest = run_folder.newest_complete(output_dir)
        keep = (f"{newest.name} is complete and a relaunch of the same command finishes the run from it" if newest
                else "no complete checkpoint exists")
        raise UserError(
            f"{output_dir}: could not write {error.filename or 'a file'} ({IO_ERRNOS[error.errno]}); the run is not "
            f"marked finished, {keep}; free space or fix the folder's permissions and relaunch."
        ) from None


FINAL_ASIDE = ".final-save.tmp"  # the final model is written here, then moved into the output folder


def save_final_completely(trainer, output_dir: str | Path) -> None:
    """`trainer.save_model`, written aside and moved into place file by file (renames on one file system): a failed
    write (a full disk) leaves the output folder as it was and ends in one sentence; a kill during the moves leaves no
    final marker, so a relaunch redoes the save from the last checkpoint."""
    output_dir = Path(output_dir)
    aside = output_dir / FINAL_ASIDE
    main = trainer.accelerator.is_main_process
    if main:
        shutil.rmtree(aside, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    fsdp = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if fsdp is not None:
        # save_model writes nothing under a sharded state dict, FSDP2's default (its checkpoints stay sharded):
        # the final model is the full one, as accelerate's FSDP2 state dict always gathers it
        fsdp.set_state_dict_type("FULL_STATE_DICT")
    failure = None
    try:
        trainer.save_model(str(aside))
    except Exception as error:  # a failed write is reported below; anything else is re-raised
        if save_failure_reason(error, output_dir) is None:
            raise
        failure = error
    if _any_rank(trainer, failure is not None):
        if main:
            shutil.rmtree(aside, ignore_errors=True)
        if failure is None:
            sys.exit(2)  # another rank failed to write and reports it
        newest = run_folder.newest_complete(output_dir)
        keep = (f"{newest.name} is complete and a relaunch of the same command finishes the save from it without "
                f"training further" if newest
                else "no checkpoint was saved (save_strategy), so a relaunch trains again")
        raise UserError(
            f"{output_dir}: could not write the final model ({save_failure_reason(failure, output_dir)}); the model "
            f"files already there are as they were and {keep}; free space or fix the folder's permissions and relaunch."
        )
    if main:
        for path in sorted(aside.iterdir()):
            target = output_dir / path.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(path, target)
        aside.rmdir()
    trainer.accelerator.wait_for_everyone()


class Preemption(TrainerCallback):
    """SIGTERM → finish the step, save a checkpoint on every rank, stop; `exit_if_preempted` then exits."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.saved_step: int | None = None  # the step of the newest checkpoint (or of the start)
        self.signal_time: float | None = None
        self.stopped_at: int | None = None
        self.longest_step = 0.0
        self._step_started = None
        self._previous_handler = None

    def _on_signal(self, signum, frame):
        if self.signal_time is None:
            self.signal_time = time.monotonic()
        if self.trainer.state.global_step == self.saved_step:
            say(f"SIGTERM before any step since step {self.saved_step}: nothing to save; exiting with code "
                 f"{PREEMPTED_EXIT_CODE} now. Relaunch the same command to resume.")
            outcome.record(outcome.PREEMPTED, output_dir=self.trainer.args.output_dir)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(PREEMPTED_EXIT_CODE)  # not SystemExit: raised inside a compilation it was seen to be swallowed

    def on_train_begin(self, args, state, control, **kwargs):
        self.saved_step = state.global_step
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    def on_save(self, args, state, control, **kwargs):
        self.saved_step = state.global_step

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_started = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_started is not None:
            self.longest_step = max(self.longest_step, time.monotonic() - self._step_started)
        if self.stopped_at is None and _any_rank(self.trainer, self.signal_time is not None):
            if self.signal_time is None:
                self.signal_time = time.monotonic()  # another rank got the signal
            if state.global_step < state.max_steps:
                self.stopped_at = state.global_step
                control.should_save = True
                control.should_training_stop = True
        return control


def die_with_launcher() -> None:
    """Linux: SIGTERM this process when its parent (accelerate launch, torchrun) dies, even of SIGKILL, so that it
    saves what it can and exits instead of holding the GPU as an orphan."""
    if not sys.platform.startswith("linux") or "LOCAL_RANK" not in os.environ:
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def exit_if_preempted(trainer) -> None:
    """After `trainer.train()`: when a SIGTERM stopped it, say what was saved and how long it took, and exit 143."""
    preemption = trainer.preemption
    if preemption.stopped_at is None:
        return
    if trainer.accelerator.is_main_process:
        outcome.record(outcome.PREEMPTED, output_dir=trainer.args.output_dir)
        after_signal = time.monotonic() - preemption.signal_time
        save_seconds = trainer.last_save_seconds
        say(
            f"SIGTERM: stopped after step {preemption.stopped_at} of {trainer.state.max_steps} and saved "
            f"checkpoint-{preemption.stopped_at} {after_signal:.2f} s after the signal (longest step "
            f"{preemption.longest_step:.2f} s, save {save_seconds:.2f} s); the grace period between SIGTERM and "
            f"SIGKILL must exceed the longest step plus the save ({preemption.longest_step + save_seconds:.2f} s here). "
            f"Relaunch the same command to resume; exiting with code {PREEMPTED_EXIT_CODE}."
        )
    sys.exit(PREEMPTED_EXIT_CODE)
