"""A launch into an output folder that already holds a run: finished, to continue from its newest complete
checkpoint, or refused when a setting changed that the checkpoint cannot follow (finetune/checks/resume.py).
Also the run record's identity of a run and the checkpoint `--resume_from_checkpoint` names."""

from pathlib import Path

from finetune import run_folder
from finetune.checks import resume
from finetune.config.files import blocked_folder
from finetune.errors import RunFinished, UserError, say
from finetune.run_folder import RUN_RECORD, recorded_run


def check_resume_checkpoint(run) -> None:
    """--resume_from_checkpoint must name a complete checkpoint (see finetune/run/saving.py)."""
    from finetune import run_folder

    requested = run.training.resume_from_checkpoint
    if requested and str(requested).lower() not in ("true", "1", "yes"):
        run_folder.resume_point(requested, run.training.output_dir, announce=False)


def run_identity(run) -> dict:
    """What makes two launches the same run, so that a relaunch resumes and a different run is refused."""
    return {
        "model_name_or_path": run.model.model_name_or_path,
        "tiny": run.finetune.tiny,
        "tiny_width": run.finetune.tiny_width if run.finetune.tiny else None,
        "use_peft": run.model.use_peft,
        "dataset_name": run.script.dataset_name,
    }


def check_output_dir(run) -> None:
    """Never write over another run's files: an output folder is either empty, ours to resume, or refused."""
    output_dir = Path(run.training.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"{output_dir}: output_dir is a file, not a folder; pick a new or empty folder for "
                        f"--output_dir.")
    blocked = blocked_folder(output_dir)
    if blocked and blocked[1] == "file":
        raise UserError(f"{output_dir}: output_dir cannot be created because {blocked[0]} is a file; pick another "
                        f"--output_dir.")
    if blocked:
        raise UserError(f"{output_dir}: output_dir cannot be written ({blocked[0]} is read-only or not yours); pick "
                        f"a folder you can write to for --output_dir.")
    holder = run_folder.lock_holder(output_dir)
    if holder is not None:
        raise UserError(run_folder.in_use_sentence(output_dir, holder))
    if output_dir.is_dir() and any(not run_folder.is_lock(path.name) for path in output_dir.iterdir()):
        _check_run_in_folder(run, output_dir)
    run.resumes_from = resume_checkpoint(run)
    if run.resumes_from is None:
        check_finished_model_kept(run, output_dir)
    else:
        resume.check_trainer_state(run, run.resumes_from)
        run.recorded_settings = settings_of_checkpoint(run.resumes_from, output_dir, run.recorded_settings)
        if run.recorded_settings:
            resume.check_relaunch(run, run.recorded_settings, run.resumes_from, output_dir)
        resume.check_checkpoint_weights(run.resumes_from)
        resume.check_optimizer_state(run.resumes_from)


def _check_run_in_folder(run, output_dir: Path) -> None:
    """An output folder that holds files: this run's, not finished, or refused."""
    record_file = output_dir / RUN_RECORD
    if not record_file.is_file():
        raise UserError(
            f"{output_dir}: output_dir already holds files that no finetune run wrote; "
            f"pick an empty --output_dir so nothing there is overwritten."
        )
    recorded = recorded_run(output_dir)
    if not recorded:  # cut short by a crash before it was written atomically
        say(f"{record_file} is unreadable; taking {output_dir} as this run's folder and writing it "
              f"again.")
        recorded = run_identity(run)
    differing = [(key, recorded.get(key), value) for key, value in run_identity(run).items()
                 if recorded.get(key) != value]
    if differing:
        changes = ", ".join(f"{key} was {old!r}, now {new!r}" for key, old, new in differing)
        raise UserError(
            f"{output_dir}: output_dir holds another run ({changes}); pick a new --output_dir, or relaunch that run "
            f"to resume it."
        )
    step = run_folder.finished_step(output_dir, training_length(run.training))
    if step is not None:
        raise RunFinished(str(output_dir), step, run_folder.newest_complete(output_dir) is not None)
    run.recorded_settings = recorded.get("settings") if isinstance(recorded.get("settings"), dict) else {}


def check_finished_model_kept(run, output_dir: Path) -> None:
    """A finished run relaunched to train longer with no checkpoint to continue from would train from step 0 and
    replace its final model: refused, unless asked for, and then said."""
    finished = run_folder.finished_step(output_dir)
    if finished is None:
        return
    if not run.finetune.replace_finished_model:
        raise UserError(
            f"{output_dir}: output_dir holds this run's final model (step {finished}) and no checkpoint to train on "
            f"from (save_strategy), so this relaunch would train from step 0 and replace it; pick a new --output_dir, "
            f"or add --replace_finished_model true to train again from the start."
        )
    say(f"{output_dir}: no checkpoint to train on from, so training from step 0 as asked "
        f"(--replace_finished_model); its final model of step {finished} is replaced when this run saves.")


def settings_of_checkpoint(checkpoint: Path, output_dir: Path, recorded: dict) -> dict:
    """The settings a checkpoint was trained with: the run record of its own folder (this output folder's, already
    read, or another run's for a --resume_from_checkpoint from elsewhere), overruled by what the checkpoint's own
    files say, so that a run record cut short or another run's checkpoint is still compared field by field."""
    folder = checkpoint.parent
    if folder.resolve() != output_dir.resolve():
        other = recorded_run(folder).get("settings")
        recorded = other if isinstance(other, dict) else {}
    return {**recorded, **resume.checkpoint_settings(checkpoint)}


def resume_checkpoint(run) -> Path | None:
    """The checkpoint this launch would resume from (checked quietly; train.train_and_save announces it)."""
    requested = run.training.resume_from_checkpoint
    if requested and str(requested).lower() not in ("true", "1", "yes"):
        return Path(requested)
    return run_folder.newest_complete(run.training.output_dir)


def check_data_unchanged(run, train_set) -> None:
    """Once the rows load (before the model): a checkpoint resumes into the rows it was trained on."""
    resume.check_data_unchanged(run, run.recorded_settings, run.resumes_from, Path(run.training.output_dir), train_set)


def training_length(training) -> dict:
    """What decides how long a run trains: a relaunch with the same is the same finished run."""
    return {"max_steps": training.max_steps, "num_train_epochs": training.num_train_epochs}
