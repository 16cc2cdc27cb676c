"""Fault injection on a single-process run of the tiny model (tests/preemption.py has the machinery): seeded SIGKILLs at
every moment of a step and a save, a SIGKILL from outside, SIGTERM, corrupted checkpoints, a full disk, a folder it may
not write to; each relaunch must end with exactly the weights and loss curve of the uninterrupted run."""

import json
import random
import shutil
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from finetune.errors import FINISHED_PREFIX
from finetune.run.saving import FINAL_ASIDE
from finetune.run_folder import FINAL_MARKER, MARKER, PREEMPTED_EXIT_CODE, checkpoint_problem
from tests.helpers import folder_digest, run_sft_in_process
from tests.preemption import (
    SEED,
    WEIGHTS,
    Launch,
    assert_same_checkpoint,
    complete_checkpoints,
    copy_run,
    error_line,
    kill_positions,
    reference,
    run_args,
    run_kill_chain,
    tmpfs,
    training_data,  # noqa: F401  (autouse fixture: the module's training data file)
)

# one worker: its launches are module fixtures
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_preemption_single")]


@pytest.fixture(scope="module")
def reference_single(tmp_path_factory):
    return reference(tmp_path_factory, 1)


def test_single_process_survives_seeded_kills_and_sigterm_with_bitwise_equal_weights(tmp_path, reference_single):
    """Killed while writing a checkpoint's weights and after its marker, before the older checkpoints are deleted (the
    other strategies' chains kill mid-step, while the optimizer state is written and before the marker); then killed
    from outside while it trains, and stopped by SIGTERM."""
    positions = kill_positions(random.Random(SEED), ["save_weights", "before_rotation"])
    run_kill_chain(tmp_path, 1, reference_single, positions, external_kill=True)


def test_sigterm_before_the_first_step_ends_the_run_at_once_with_nothing_to_save(tmp_path):
    """A first step that takes minutes (compiling on a GPU): SIGTERM to the launcher alone (as Kubernetes sends it)
    must not wait for that step, since there is nothing to save yet."""
    output_dir = tmp_path / "out"
    launch = Launch(tmp_path, 1, output_dir, fault="slow_step:1")
    deadline = time.monotonic() + 120
    while "[finetune] setup:" not in launch.text() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1)
    signalled = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    assert launch.wait(timeout=60) == PREEMPTED_EXIT_CODE, launch.text()[-3000:]
    assert time.monotonic() - signalled < 20, "the run waited for its slow first step"
    assert "SIGTERM before any step since step 0: nothing to save" in launch.text()
    assert not list(output_dir.glob("checkpoint-*"))


def test_relaunching_a_finished_run_says_so_and_changes_nothing(tmp_path, reference_single):
    """The README's advice after a preemption, and a requeue loop, relaunch the same command after the run ended: it
    must not train again, re-save the model or let save_total_limit delete its checkpoints."""
    output_dir = tmp_path / "out"
    shutil.copytree(reference_single, output_dir)
    before = folder_digest(output_dir)
    launch = Launch(tmp_path, 1, output_dir, "--save_total_limit", "1")
    assert launch.wait() == 0, launch.text()[-3000:]
    assert f"{FINISHED_PREFIX}{output_dir} holds this run's complete final model (step 12)" in launch.text()
    assert folder_digest(output_dir) == before


@pytest.fixture(scope="module")
def relaunched_after_a_cut_short_final_save(tmp_path_factory, reference_single):
    """The uninterrupted run's checkpoints without its final model's files (its final save cut short), and its run
    record cut short too, relaunched once: the two tests below read this one launch."""
    tmp = tmp_path_factory.mktemp("final-save-cut-short")
    output_dir = copy_run(reference_single, tmp / "out")
    (output_dir / "finetune_run.json").write_text('{"model_name_or_path": "meta-ll')
    launch = Launch(tmp, 1, output_dir)
    assert launch.wait() == 0, launch.text()[-3000:]
    return launch, output_dir


def test_a_run_record_cut_short_does_not_stop_the_relaunch(relaunched_after_a_cut_short_final_save, reference_single):
    """finetune_run.json was written in place: one cut short made every relaunch crash. It is written atomically now,
    and one left unreadable by an older version is written again by the relaunch, which resumes."""
    launch, output_dir = relaunched_after_a_cut_short_final_save
    assert "finetune_run.json is unreadable; taking" in launch.text()
    assert json.loads((output_dir / "finetune_run.json").read_text())["tiny"] is True
    assert_same_checkpoint(output_dir, reference_single)


def test_a_final_save_cut_short_is_redone_from_the_last_checkpoint_without_training_further(
        relaunched_after_a_cut_short_final_save, reference_single):
    launch, output_dir = relaunched_after_a_cut_short_final_save
    assert f"resuming from {output_dir / 'checkpoint-12'}" in launch.text(), launch.text()[-3000:]
    assert "'loss': " not in launch.text(), "a finished run trained again"
    assert_same_checkpoint(output_dir, reference_single)


def test_a_full_disk_at_the_final_save_leaves_the_previous_model_and_the_relaunch_finishes_it(tmp_path, reference_single):
    """The finished run trained on (max_steps 12 -> 15); its new final model does not fit: the previous final model
    stays as it was, and the relaunch writes the new one from checkpoint-15 without training again."""
    output_dir = tmp_path / "out"
    shutil.copytree(reference_single, output_dir)
    previous = {name: (output_dir / name).read_bytes() for name in (WEIGHTS, "adapter_config.json")}
    launch = Launch(tmp_path, 1, output_dir, "--max_steps", "15", fault="final_enospc")
    assert launch.wait() != 0, launch.text()[-3000:]
    last = error_line(launch.text())
    assert "could not write the final model (no space left on the device)" in last, last
    assert "checkpoint-15 is complete and a relaunch of the same command finishes the save" in last, last
    assert "Traceback" not in launch.text()
    assert {name: (output_dir / name).read_bytes() for name in previous} == previous
    assert not (output_dir / FINAL_ASIDE).exists()
    relaunched = Launch(tmp_path, 1, output_dir, "--max_steps", "15")
    assert relaunched.wait() == 0, relaunched.text()[-3000:]
    assert "'loss': " not in relaunched.text(), "the relaunch trained again"
    assert "checkpoint-15 is at max_steps: nothing left to train" in relaunched.text()
    assert (output_dir / FINAL_MARKER).is_file()
    final, saved = load_file(output_dir / WEIGHTS), load_file(output_dir / "checkpoint-15" / WEIGHTS)
    assert final.keys() == saved.keys() and all(torch.equal(final[name], saved[name]) for name in final)


def test_a_full_disk_after_the_final_model_is_one_sentence_and_leaves_the_run_unfinished(tmp_path, reference_single):
    output_dir = copy_run(reference_single, tmp_path / "out")
    launch = Launch(tmp_path, 1, output_dir, fault="plot_enospc")
    assert launch.wait() != 0
    last = error_line(launch.text())
    assert f"could not write {output_dir / 'loss.png'} (no space left on the device)" in last, last
    assert "checkpoint-12 is complete and a relaunch of the same command finishes the run from it" in last, last
    assert "Traceback" not in launch.text()
    assert not (output_dir / FINAL_MARKER).exists(), "a run whose records were not written is not marked finished"


def test_a_resume_applies_a_new_learning_rate_when_asked_and_the_new_logging_cadence(tmp_path, reference_single):
    output_dir = copy_run(reference_single, tmp_path / "out")
    shutil.rmtree(output_dir / "checkpoint-12")
    shutil.rmtree(output_dir / "checkpoint-9")
    launch = Launch(tmp_path, 1, output_dir, "--learning_rate", "2e-2", "--resume_with_new_schedule", "true",
                    "--logging_steps", "2")
    assert launch.wait() == 0, launch.text()[-3000:]
    applied = next(line for line in launch.text().splitlines() if "resuming from checkpoint-6 with" in line)
    assert "`learning_rate` (0.01 -> 0.02)" in applied and "`logging_steps` (1" in applied, applied
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    reference_rates = {entry["step"]: entry["learning_rate"] for entry in json.loads(
        (reference_single / "trainer_state.json").read_text())["log_history"] if "learning_rate" in entry}
    resumed = {entry["step"]: entry["learning_rate"] for entry in history if "learning_rate" in entry and entry["step"] > 6}
    assert sorted(resumed) == [8, 10, 12], resumed
    for step, rate in resumed.items():
        assert rate == pytest.approx(2 * reference_rates[step], rel=1e-6), (step, rate, reference_rates[step])


def test_corrupted_checkpoints_are_skipped_with_a_message_and_the_run_resumes_exactly(tmp_path, reference_single):
    output_dir = copy_run(reference_single, tmp_path / "out")
    weights = output_dir / "checkpoint-12" / WEIGHTS
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size - 1000)
    (output_dir / "checkpoint-9" / "optimizer.pt").unlink()
    (output_dir / "checkpoint-6" / MARKER).unlink()
    launch = Launch(tmp_path, 1, output_dir)
    assert launch.wait() == 0, launch.text()[-3000:]
    text = launch.text()
    assert f"skipping {output_dir / 'checkpoint-12'}: {WEIGHTS} is truncated or changed" in text
    assert f"skipping {output_dir / 'checkpoint-9'}: optimizer.pt is missing" in text
    assert f"resuming from {output_dir / 'checkpoint-3'}: the newest complete checkpoint" in text, text[-3000:]
    assert f"skipping {output_dir / 'checkpoint-6'}: no completeness marker" in text
    assert_same_checkpoint(output_dir, reference_single)


def test_a_truncated_safetensors_is_caught_even_when_its_size_matches_the_marker(tmp_path):
    from safetensors.torch import save_file

    from finetune.run_folder import safetensors_problem

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(100)}, str(path))
    assert safetensors_problem(path) is None
    path.write_bytes(path.read_bytes()[:-40])
    assert "truncated" in safetensors_problem(path)


def test_an_explicit_resume_from_an_incomplete_checkpoint_is_refused(tmp_path, reference_single, capfd, monkeypatch):
    output_dir = copy_run(reference_single, tmp_path / "out")
    (output_dir / "checkpoint-6" / "optimizer.pt").unlink()
    arguments = [*run_args(tmp_path, output_dir), "--resume_from_checkpoint", str(output_dir / "checkpoint-6")]
    result = run_sft_in_process(arguments, capfd, monkeypatch)
    assert result.returncode == 2
    last = error_line(result.stderr)
    assert "checkpoint-6" in last and "optimizer.pt is missing" in last, last


def test_full_disk_at_save_time_is_a_clear_error_and_the_previous_checkpoint_survives(tmp_path, reference_single):
    """A real full disk (an 800 kB tmpfs holds the run files and one checkpoint) where mounting is allowed, else a
    mocked ENOSPC in the second checkpoint's write; then space is freed and the relaunch resumes exactly."""
    disk = tmp_path / "disk"
    real = tmpfs(disk, "800k")
    try:
        output_dir = disk / "out"
        launch = Launch(tmp_path, 1, output_dir, fault=None if real else "enospc:6")
        assert launch.wait() != 0
        last = error_line(launch.text())
        assert "no space left on the device" in last and "Traceback" not in launch.text(), launch.text()[-3000:]
        failed = int(last.split("could not write checkpoint-", 1)[1].split()[0])
        kept = sorted(complete_checkpoints(output_dir))
        assert kept and kept == [step for step in (3, 6, 9, 12) if step < failed], (kept, last)
        assert f"{output_dir / f'checkpoint-{kept[-1]}'} is intact and a relaunch resumes from it" in last, last
        assert not (output_dir / f"checkpoint-{failed}").exists(), "the half-written checkpoint is removed"
        for step in kept:
            assert_same_checkpoint(output_dir / f"checkpoint-{step}", reference_single / f"checkpoint-{step}")
        if real:
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = Launch(tmp_path, 1, output_dir)
        assert resumed.wait() == 0, resumed.text()[-3000:]
        assert_same_checkpoint(output_dir, reference_single)
        print(f"\n[preemption] full disk: {'a real 800 kB tmpfs' if real else 'a mocked ENOSPC'}: {last}")
    finally:
        if real:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_no_write_permission_at_save_time_is_a_clear_error_and_the_previous_checkpoint_survives(tmp_path, reference_single):
    output_dir = tmp_path / "out"
    launch = Launch(tmp_path, 1, output_dir, fault="eacces:6")  # root ignores chmod, so the write failure is mocked
    assert launch.wait() != 0
    last = error_line(launch.text())
    assert "no write permission" in last and "checkpoint-3 is intact" in last, last
    assert "Traceback" not in launch.text()
    assert [path.name for path in output_dir.glob("checkpoint-*")] == ["checkpoint-3"]
    assert_same_checkpoint(output_dir / "checkpoint-3", reference_single / "checkpoint-3")


def test_save_total_limit_one_never_leaves_no_complete_checkpoint(tmp_path, reference_single):
    """With save_total_limit 1, a kill after the new checkpoint is written but before its marker must still find the
    previous checkpoint: the Trainer's own rotation (which runs before the marker) is deferred until after it."""
    output_dir = tmp_path / "out"
    launch = Launch(tmp_path, 1, output_dir, "--save_total_limit", "1", fault="before_marker:6")
    assert launch.wait() == -signal.SIGKILL
    assert sorted(complete_checkpoints(output_dir)) == [3]
    assert checkpoint_problem(output_dir / "checkpoint-6").startswith("no completeness marker")
    assert_same_checkpoint(output_dir / "checkpoint-3", reference_single / "checkpoint-3")
