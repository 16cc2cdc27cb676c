"""A relaunch that would resume a checkpoint with other arguments (finetune/checks/resume.py, the README's "Relaunch and
resume" table): every field of the table is changed once against a run folder holding a complete checkpoint and the
run record of the original launch. No model loads here; tests/test_preemption_single.py resumes real runs with a new
learning rate and cadence and checks that they are applied."""

import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from finetune import run_folder as folder_files
from finetune.checks import recipe as recipe_checks
from finetune.checks import relaunch as relaunch_checks
from finetune.checks import resume
from finetune.checks.relaunch import run_identity, training_length
from finetune.errors import RunFinished, UserError
from finetune.run.arguments import parse_args
from finetune.run_folder import RUN_RECORD
from tests.helpers import ROOT, folder_digest, write

LORA = ["--config", str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"), "--tiny"]

FIXED = [
    ("lora_r", ["--lora_r", "8"]),
    ("lora_alpha", ["--lora_alpha", "64"]),
    ("use_rslora", ["--use_rslora", "true"]),
    ("use_dora", ["--use_dora", "true"]),
    ("lora_dropout", ["--lora_dropout", "0.1"]),
    ("lora_target_modules", ["--lora_target_modules", "q_proj", "v_proj"]),
    ("lora_modules_to_save", ["--lora_modules_to_save", "lm_head"]),
    ("dataset_train_split", ["--dataset_train_split", "test"]),
    ("columns", ["--columns", '{"dialog": "messages"}']),
    ("max_length", ["--max_length", "128"]),
    ("packing", ["--packing", "false"]),
    ("truncation", ["--truncation", "false"]),
    ("assistant_only_loss", ["--assistant_only_loss", "false"]),
    ("seed", ["--seed", "7"]),
    ("data_seed", ["--data_seed", "7"]),
    ("per_device_train_batch_size", ["--per_device_train_batch_size", "4"]),
    ("gradient_accumulation_steps", ["--gradient_accumulation_steps", "4"]),
    ("optim", ["--optim", "adamw_torch"]),
    ("weight_decay", ["--weight_decay", "0.1"]),
    ("adam_beta1", ["--adam_beta1", "0.8"]),
    ("adam_beta2", ["--adam_beta2", "0.99"]),
    ("adam_epsilon", ["--adam_epsilon", "1e-6"]),
]
ANOTHER_RUN = [  # what makes it another run altogether: refused even without a checkpoint
    ("model_name_or_path", ["--model_name_or_path", "meta-llama/Llama-3.2-3B-Instruct"]),
    ("tiny_width", ["--tiny_width", "32"]),
    ("dataset_name", ["--dataset_name", str(ROOT / "data" / "sample" / "test.jsonl")]),
]
SCHEDULE = [
    ("learning_rate", ["--learning_rate", "1e-4"]),
    ("lr_scheduler_type", ["--lr_scheduler_type", "linear"]),
    ("lr_scheduler_kwargs", ["--lr_scheduler_type", "cosine_with_restarts", "--lr_scheduler_kwargs", '{"num_cycles": 2}']),
    ("warmup_steps", ["--warmup_steps", "5"]),
]
CHANGEABLE = [
    ("max_steps", ["--max_steps", "20"]),
    ("num_train_epochs", ["--num_train_epochs", "2"]),
    ("logging_steps", ["--logging_steps", "5"]),
    ("logging_strategy", ["--logging_strategy", "epoch"]),
    ("eval_steps", ["--eval_steps", "50"]),
    ("eval_strategy", ["--eval_strategy", "no"]),
    ("save_steps", ["--save_steps", "100"]),
    ("save_strategy", ["--save_strategy", "epoch"]),
    ("save_total_limit", ["--save_total_limit", "3"]),
    ("max_grad_norm", ["--max_grad_norm", "0.5"]),
    ("gradient_checkpointing", ["--gradient_checkpointing", "true"]),
    ("eval_samples_before_after", ["--eval_samples_before_after", "4"]),
    ("sample_prompt", ["--sample_prompt", "Reverse: a b c"]),
]


def run_folder(tmp_path: Path, *extra: str) -> Path:
    """An output folder as a launch with `extra` leaves it: its run record and one complete checkpoint."""
    output_dir = tmp_path / "out"
    run = parse_args([*LORA, *extra, "--output_dir", str(output_dir)])
    record = {**run_identity(run), "settings": resume.settings(run)}
    write(output_dir / RUN_RECORD, json.dumps(record))
    checkpoint = output_dir / "checkpoint-4"
    checkpoint.mkdir()
    save_file({"weight": torch.zeros(2)}, str(checkpoint / "adapter_model.safetensors"))
    write(checkpoint / "trainer_state.json", '{"global_step": 4}')
    write(checkpoint / "optimizer.pt", "state")
    folder_files.write_marker(checkpoint, 4, 1)
    return output_dir


def relaunch(output_dir: Path, *extra: str):
    run = parse_args([*LORA, *extra, "--output_dir", str(output_dir)])
    recipe_checks.check(run)
    return run


@pytest.mark.parametrize("field, flags", FIXED + ANOTHER_RUN, ids=[name for name, _ in FIXED + ANOTHER_RUN])
def test_a_change_the_checkpoint_cannot_continue_with_is_refused_naming_it(field, flags, tmp_path):
    output_dir = run_folder(tmp_path)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, *flags)
    sentence = str(refused.value)
    assert field in sentence and "new --output_dir" in sentence, sentence
    assert sentence.count(". ") == 0 and sentence.endswith("."), sentence


@pytest.mark.parametrize("field, flags", SCHEDULE, ids=[name for name, _ in SCHEDULE])
def test_a_schedule_change_is_refused_unless_asked_for(field, flags, tmp_path, capsys):
    output_dir = run_folder(tmp_path)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, *flags)
    assert field in str(refused.value) and "--resume_with_new_schedule true" in str(refused.value), str(refused.value)
    relaunch(output_dir, *flags, "--resume_with_new_schedule", "true")
    assert f"`{field}`" in capsys.readouterr().out


@pytest.mark.parametrize("field, flags", CHANGEABLE, ids=[name for name, _ in CHANGEABLE])
def test_a_change_that_a_resume_can_apply_is_printed(field, flags, tmp_path, capsys):
    output_dir = run_folder(tmp_path)
    relaunch(output_dir, *flags)
    printed = capsys.readouterr().out
    assert f"resuming from checkpoint-4 with `{field}`" in printed, printed


def test_every_changed_field_is_named_in_one_sentence(tmp_path):
    output_dir = run_folder(tmp_path)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, "--lora_r", "8", "--max_length", "128", "--learning_rate", "1e-4")
    assert "`lora_r` (16 -> 8)" in str(refused.value) and "`max_length` (256 -> 128)" in str(refused.value)


def test_the_same_arguments_resume_silently_and_without_a_checkpoint_anything_may_change(tmp_path, capsys):
    output_dir = run_folder(tmp_path)
    relaunch(output_dir)
    assert "resuming from" not in capsys.readouterr().out
    for folder in output_dir.glob("checkpoint-*"):
        (folder / folder_files.MARKER).unlink()  # no complete checkpoint: the relaunch starts over
    relaunch(output_dir, "--lora_r", "8", "--learning_rate", "1e-4")


def test_changed_training_rows_are_refused_once_they_load(tmp_path):
    rows = (ROOT / "data" / "sample" / "train.jsonl").read_text().splitlines()
    data = write(tmp_path / "train.jsonl", "\n".join(rows[:40]) + "\n")
    output_dir = run_folder(tmp_path, "--dataset_name", str(data))
    run = relaunch(output_dir, "--dataset_name", str(data))
    from datasets import load_dataset

    def rows_of(path):
        return load_dataset("json", data_files=str(path), split="train")

    relaunch_checks.check_data_unchanged(run, rows_of(data))  # nothing recorded yet: it only takes the fingerprint
    record = json.loads((output_dir / RUN_RECORD).read_text())
    record["settings"]["data_fingerprint"] = run.data_fingerprint
    write(output_dir / RUN_RECORD, json.dumps(record))
    run = relaunch(output_dir, "--dataset_name", str(data))  # the record is read once, by the relaunch's checks
    copy = write(tmp_path / "restaged" / "train.jsonl", data.read_text())  # the same rows elsewhere still match
    relaunch_checks.check_data_unchanged(run, rows_of(copy))
    write(data, "\n".join(rows[:39] + [rows[41]]) + "\n")
    with pytest.raises(UserError) as refused:
        relaunch_checks.check_data_unchanged(run, rows_of(data))
    assert "training rows changed since checkpoint-4" in str(refused.value), str(refused.value)


def test_a_launch_into_a_folder_in_use_is_refused_naming_the_first_and_a_stale_lock_is_taken_over(tmp_path, capsys):
    output_dir = run_folder(tmp_path)
    first = os.getppid()  # a live process of this host that is not this launch
    holder = {"pid": first, "host": socket.gethostname(), "launch": "another launch",
              "started": folder_files._started(first), "since": "2026-01-01T00:00:00"}
    write(output_dir / folder_files.LOCK, json.dumps(holder))
    with pytest.raises(UserError) as refused:
        relaunch(output_dir)
    assert f"output_dir is in use by another launch (pid {first} on {socket.gethostname()}" in str(refused.value)
    with pytest.raises(UserError):
        folder_files.take_lock(output_dir)
    write(output_dir / folder_files.LOCK, json.dumps({**holder, "started": "0"}))  # that pid is another process now
    relaunch(output_dir)
    folder_files.take_lock(output_dir)
    assert "is gone; taking the folder over" in capsys.readouterr().out
    assert json.loads((output_dir / folder_files.LOCK).read_text())["pid"] == os.getpid()
    folder_files.release_lock(output_dir)
    assert not (output_dir / folder_files.LOCK).exists()


@pytest.mark.parametrize("state, flags, expected", [
    ('{"global_step": 40}', [], ["`global_step` is 40 in the folder of step 4", "resume from", "checkpoint-2 instead"]),
    ('{"global_step": 4}', ["--max_steps", "3"],
     ["`global_step` is 4, past this run's max_steps 3", "raise --max_steps above 4"]),
    ('{"log_history": []}', [], ["holds no step (`global_step`)", "checkpoint-2 instead"]),
], ids=["another step than its folder's", "past the run's max_steps", "no step"])
def test_a_trainer_state_contradicting_its_folder_or_the_run_is_refused_before_loading(state, flags, expected,
                                                                                       tmp_path):
    output_dir = run_folder(tmp_path)
    shutil.copytree(output_dir / "checkpoint-4", output_dir / "checkpoint-2")
    write(output_dir / "checkpoint-2" / "trainer_state.json", '{"global_step": 2}')
    folder_files.write_marker(output_dir / "checkpoint-2", 2, 1)
    write(output_dir / "checkpoint-4" / "trainer_state.json", state)
    folder_files.write_marker(output_dir / "checkpoint-4", 4, 1)  # the marker rewritten: the folder looks complete
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, *flags)
    sentence = str(refused.value)
    assert sentence.startswith(f"{output_dir / 'checkpoint-4' / 'trainer_state.json'}: "), sentence
    assert all(word in sentence for word in expected), sentence
    relaunch(output_dir, "--resume_from_checkpoint", str(output_dir / "checkpoint-2"), *flags)  # the way out works


def _take_lock_slowly(output_dir, slowed: str, delay: float, taken, done) -> None:
    """take_lock in a process of its own with one step slowed by `delay` s: writing the lock's record ("write") or
    judging whether its holder is gone ("judge"); it says what happened, then stays alive (a live holder) until told."""
    import types

    if slowed == "write":
        def dumps(*args, **kwargs):
            time.sleep(delay)
            return json.dumps(*args, **kwargs)
        folder_files.json = types.SimpleNamespace(dumps=dumps, loads=json.loads)
    else:
        alive = folder_files._alive
        folder_files._alive = lambda *args: time.sleep(delay) or alive(*args)
    try:
        folder_files.take_lock(output_dir)
        taken.put("took it")
    except UserError as refused:
        taken.put(str(refused))
    done.wait(60)


@pytest.mark.launches
@pytest.mark.parametrize("slowed", ["write", "judge"])
def test_launches_taking_the_lock_together_never_both_take_it(tmp_path, slowed):
    output_dir = tmp_path / "out"
    if slowed == "judge":  # both find a stale lock and take it over, the second judging it later than the first
        output_dir.mkdir()
        write(output_dir / folder_files.LOCK, json.dumps(
            {"pid": os.getpid(), "host": socket.gethostname(), "launch": "a launch gone", "started": "0"}))
    context = multiprocessing.get_context("fork")
    taken, done = context.Queue(), context.Event()
    launches = [context.Process(target=_take_lock_slowly, args=(output_dir, slowed, 0.3 + 0.4 * index, taken, done))
                for index in range(2)]
    for launch in launches:
        launch.start()
    outcomes = sorted(taken.get(timeout=60) for _ in launches)
    done.set()
    for launch in launches:
        launch.join(30)
    assert outcomes[1] == "took it" and "output_dir is in use by another launch" in outcomes[0], outcomes
    holder = json.loads((output_dir / folder_files.LOCK).read_text())
    assert holder["pid"] in {launch.pid for launch in launches}
    assert sorted(path.name for path in output_dir.iterdir()) == [folder_files.LOCK]


def test_an_empty_lock_is_refused_naming_it_not_taken_over(tmp_path):
    output_dir = tmp_path / "out"
    write(output_dir / folder_files.LOCK, "")
    with pytest.raises(UserError) as refused:
        folder_files.take_lock(output_dir)
    assert str(refused.value).startswith(f"{output_dir / folder_files.LOCK}: this lock names no launch"), refused.value
    assert (output_dir / folder_files.LOCK).read_text() == ""


def test_a_lock_another_process_of_the_launch_is_writing_is_not_taken_for_someone_else_s_files(tmp_path):
    """Rank 0 writes the lock's record aside before linking it into place; the other ranks check the folder then."""
    output_dir = tmp_path / "out"
    write(output_dir / f"{folder_files.LOCK}.4242{folder_files.LOCK_BEING_WRITTEN}", "{}")
    relaunch(output_dir)  # an empty folder to this launch: nothing refused
    write(output_dir / "notes.txt", "mine")
    with pytest.raises(UserError, match="output_dir already holds files that no finetune run wrote"):
        relaunch(output_dir)


def with_adapter_config(checkpoint: Path, **settings) -> None:
    write(checkpoint / "adapter_config.json", json.dumps(
        {"r": 16, "lora_alpha": 32, "use_rslora": False, "use_dora": False, "lora_dropout": 0.05, **settings}))
    folder_files.write_marker(checkpoint, 4, 1)


def test_a_run_record_cut_short_still_compares_the_checkpoints_own_adapter_config(tmp_path):
    output_dir = run_folder(tmp_path)
    with_adapter_config(output_dir / "checkpoint-4")
    (output_dir / RUN_RECORD).write_text('{"model_name_or_path": "meta-ll')
    relaunch(output_dir)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, "--lora_alpha", "64")
    assert "`lora_alpha` (32 -> 64)" in str(refused.value), str(refused.value)


def test_a_run_record_cut_short_still_compares_the_checkpoints_own_training_arguments(tmp_path):
    """The Trainer's arguments pickled in the checkpoint (training_args.bin, as the Trainer saves them) are read with
    torch's weights-only unpickler: a changed seed is refused with the run record gone; a pickle that would build any
    other class is refused in one sentence naming the file (tests/test_safety.py plants payloads that would run)."""
    output_dir = run_folder(tmp_path)
    written = parse_args([*LORA, "--output_dir", str(output_dir)]).training
    torch.save(written, output_dir / "checkpoint-4" / "training_args.bin")
    folder_files.write_marker(output_dir / "checkpoint-4", 4, 1)
    (output_dir / RUN_RECORD).write_text('{"model_name_or_path": "meta-ll')
    relaunch(output_dir)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, "--seed", "7")
    assert "`seed` (42 -> 7)" in str(refused.value), str(refused.value)
    assert resume.training_arguments(output_dir / "checkpoint-4")["lr_scheduler_type"] == "cosine"

    torch.save({"arguments": written, "code": print}, output_dir / "checkpoint-4" / "training_args.bin")
    with pytest.raises(UserError) as refused:
        resume.training_arguments(output_dir / "checkpoint-4")
    assert str(refused.value).startswith(f"{output_dir / 'checkpoint-4' / 'training_args.bin'}: it would build "
                                         f"print, which no checkpoint holds"), refused.value
    assert "weights_only" not in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("record", ["kept", "gone"])
def test_a_checkpoint_of_another_run_folder_is_compared_with_that_run(record, tmp_path):
    other = run_folder(tmp_path / "other", "--lora_r", "8")
    with_adapter_config(other / "checkpoint-4", r=8)
    if record == "gone":
        (other / RUN_RECORD).unlink()
    resumed = ["--resume_from_checkpoint", str(other / "checkpoint-4")]
    with pytest.raises(UserError) as refused:
        relaunch(tmp_path / "new", *resumed)
    assert "`lora_r` (8 -> 16)" in str(refused.value), str(refused.value)
    relaunch(tmp_path / "new", *resumed, "--lora_r", "8")


def test_a_checkpoint_of_another_run_refused_says_to_drop_the_flag_and_dropping_it_trains_a_new_run(tmp_path):
    """A new --output_dir would resume that checkpoint all the same: the way out the refusal gives is dropping
    --resume_from_checkpoint, and the relaunch without it trains a new run, the other run's folder untouched."""
    other = run_folder(tmp_path / "other", "--lora_r", "8")
    before = folder_digest(other)
    resumed = ["--resume_from_checkpoint", str(other / "checkpoint-4")]
    with pytest.raises(UserError) as refused:
        relaunch(tmp_path / "new", *resumed)
    sentence = str(refused.value)
    assert sentence.startswith(f"{other / 'checkpoint-4'} (--resume_from_checkpoint): "), sentence
    assert "or drop --resume_from_checkpoint to train a new run." in sentence and "--output_dir" not in sentence
    with pytest.raises(UserError):  # what the old advice, a new --output_dir, still meets
        relaunch(tmp_path / "newer", *resumed)
    assert relaunch(tmp_path / "new").resumes_from is None
    assert folder_digest(other) == before


def finished_without_checkpoints(tmp_path: Path) -> Path:
    """A run that finished at step 4 with `save_strategy: no`: its final model and marker, no checkpoint."""
    output_dir = run_folder(tmp_path)
    for folder in output_dir.glob("checkpoint-*"):
        shutil.rmtree(folder)
    save_file({"weight": torch.ones(2)}, str(output_dir / "adapter_model.safetensors"))
    run = parse_args([*LORA, "--output_dir", str(output_dir)])
    folder_files.write_final_marker(output_dir, 4, training_length(run.training))
    return output_dir


def test_training_on_a_finished_run_without_a_checkpoint_is_refused_unless_asked_and_then_said(tmp_path, capsys):
    output_dir = finished_without_checkpoints(tmp_path)
    with pytest.raises(RunFinished) as finished:
        relaunch(output_dir)
    assert "no checkpoint to train on from" in str(finished.value) and "raise --max_steps" not in str(finished.value)
    before = folder_digest(output_dir)
    with pytest.raises(UserError) as refused:
        relaunch(output_dir, "--max_steps", "20")
    sentence = str(refused.value)
    assert "holds this run's final model (step 4) and no checkpoint" in sentence, sentence
    assert "--replace_finished_model true" in sentence and sentence.count(". ") == 0, sentence
    relaunch(output_dir, "--max_steps", "20", "--replace_finished_model", "true")
    assert "training from step 0 as asked" in capsys.readouterr().out
    assert folder_digest(output_dir) == before


def test_a_finished_run_with_a_checkpoint_is_told_to_raise_max_steps(tmp_path):
    output_dir = run_folder(tmp_path)
    run = parse_args([*LORA, "--output_dir", str(output_dir)])
    folder_files.write_final_marker(output_dir, 4, training_length(run.training))
    with pytest.raises(RunFinished) as finished:
        relaunch(output_dir)
    assert "raise --max_steps to train on from its last checkpoint" in str(finished.value)


def test_training_on_past_the_end_of_a_schedule_starts_a_new_one_over_the_new_steps(tmp_path, capsys):
    """The old cosine ended at rate 0 at step 6; the Trainer's scheduler, rebuilt over 9 steps, would have the first
    new step train at the optimizer's saved rate 0 (6 -> 7 steps left the adapter bit-identical)."""
    from transformers import TrainerState, get_scheduler

    args = parse_args([*LORA, "--output_dir", str(tmp_path / "out")]).training
    optimizer = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},  # decayed and not, as the Trainer's
                                 {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=args.learning_rate)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=6)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0
    checkpoint = write(tmp_path / "checkpoint-6" / "trainer_state.json", json.dumps({"global_step": 6, "max_steps": 6}))
    start = resume.schedule_start(checkpoint.parent)
    assert start == 6
    saved = scheduler.state_dict()
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=9)  # as the Trainer builds it
    scheduler.load_state_dict(saved)
    optimizer.param_groups[0]["lr"] = 0.0  # as the checkpoint's optimizer state loads it
    state = TrainerState(global_step=6, max_steps=9)
    callback = resume.ResumedRun(False, args.learning_rate, start)
    callback.on_train_begin(args, state, None, optimizer=optimizer, lr_scheduler=scheduler)
    rates = [optimizer.param_groups[0]["lr"]]
    for _ in range(2):
        scheduler.step()
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([args.learning_rate, 0.75 * args.learning_rate, 0.25 * args.learning_rate])
    assert "a new cosine schedule over steps 7-9, without warmup, instead of its end's rate 0" in capsys.readouterr().out
    kept = write(tmp_path / "checkpoint-8" / "trainer_state.json", json.dumps(
        {"global_step": 8, "max_steps": 9, "stateful_callbacks": {"ResumedRun": callback.state()}}))
    assert resume.schedule_start(kept.parent) == 6  # a later resume goes on with the new schedule


def test_a_warmup_covering_the_whole_run_is_said(tmp_path, capsys):
    from transformers import TrainerState

    from finetune.run.trainer import WarmupNotice

    args = parse_args([*LORA, "--output_dir", str(tmp_path / "out")]).training  # warmup_steps 0.03: 1 step of 1
    WarmupNotice().on_train_begin(args, TrainerState(global_step=0, max_steps=1), None)
    assert "covering all 1 steps of this run: its first step trains at learning rate 0 and it trains nothing" in \
        capsys.readouterr().out
    WarmupNotice().on_train_begin(args, TrainerState(global_step=0, max_steps=40), None)
    assert capsys.readouterr().out == ""


# The comparison table of finetune/checks/resume.py, field by field: each case below is generated from it, and the
# README's table must name the same fields the same way, so a field deleted from checks/resume.py fails here.
TABLE = {**{name: "refused" for name in resume.FIXED}, **{name: "schedule" for name in resume.SCHEDULE},
         **{name: "applied" for name in resume.CHANGEABLE}}
COMPARED_ONCE_THE_ROWS_LOAD = "data_fingerprint"


def readme_table() -> dict[str, str]:
    """Each field the README's relaunch table names (in backticks, in its first column), and what happens to it."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| a relaunch that changes |"):].split("\n\n", 1)[0].splitlines()[2:]
    found = {}
    for row in table:
        fields, happens = row.split(" | ")[:2]
        kind = ("schedule" if "--resume_with_new_schedule" in happens else
                "applied" if happens.startswith("applied") else "refused")
        found |= {name: kind for name in re.findall(r"`(\w+)`", fields)}
    return found


def test_the_readme_names_every_field_of_the_comparison_table_as_it_is_treated():
    assert readme_table() == TABLE


@pytest.mark.parametrize("field", TABLE)
def test_each_field_of_the_comparison_table_changed_alone_is_treated_as_the_table_says(field, tmp_path, capsys):
    """The run record says another value for this one field (what a relaunch that changes it meets)."""
    output_dir = run_folder(tmp_path)
    run = parse_args([*LORA, "--output_dir", str(output_dir)])
    sections = (run.training, run.model, run.script, run.finetune)
    assert field in ("world_size", COMPARED_ONCE_THE_ROWS_LOAD) or any(hasattr(s, field) for s in sections), field
    run.data_fingerprint = "4 rows, sha256 0"
    another = 2 if field == "world_size" else ["another value"]  # two processes wrote it, one relaunches it
    recorded = {**resume.settings(run), field: another}
    checkpoint = output_dir / "checkpoint-4"
    if field == COMPARED_ONCE_THE_ROWS_LOAD:
        from datasets import Dataset

        with pytest.raises(UserError, match="training rows changed since checkpoint-4"):
            resume.check_data_unchanged(run, recorded, checkpoint, output_dir, Dataset.from_list([{"text": "a"}]))
        return
    if TABLE[field] == "applied":
        assert resume.check_relaunch(run, recorded, checkpoint, output_dir) == [field]
        assert f"resuming from checkpoint-4 with `{field}`" in capsys.readouterr().out
        return
    with pytest.raises(UserError) as refused:
        resume.check_relaunch(run, recorded, checkpoint, output_dir)
    sentence = str(refused.value)
    assert f"`{field}` (['another value'] -> " in sentence and sentence.count(". ") == 0, sentence
    if TABLE[field] == "schedule":
        run.finetune.resume_with_new_schedule = True
        assert resume.check_relaunch(run, recorded, checkpoint, output_dir) == [field]


def test_another_process_count_rescales_the_accumulation_under_ddp_and_is_refused_where_it_cannot(tmp_path, monkeypatch,
                                                                                               capsys):
    output_dir = run_folder(tmp_path)  # one process, gradient_accumulation_steps 2
    run = parse_args([*LORA, "--output_dir", str(output_dir)])
    # what a launch of 2 DDP processes reads (parsed as one process: the arguments would set up a process group)
    run.launch = dataclasses.replace(run.launch, world_size=2, strategy="ddp")
    relaunch_checks.check_output_dir(run)
    assert run.training.gradient_accumulation_steps == 1
    assert "of 1 process(es) with 2: gradient_accumulation_steps 2 -> 1, so each step takes the same rows" in \
        capsys.readouterr().out
    for world_size, strategy in (("4", "ddp"), ("2", "zero3")):
        run = parse_args([*LORA, "--output_dir", str(output_dir)])
        run.launch = dataclasses.replace(run.launch, world_size=int(world_size), strategy=strategy)
        with pytest.raises(UserError) as refused:
            relaunch_checks.check_output_dir(run)
        assert f"was trained by 1 process(es) and this relaunch runs {world_size}" in str(refused.value)
        assert f"under {strategy}" in str(refused.value) and str(refused.value).count(". ") == 0
