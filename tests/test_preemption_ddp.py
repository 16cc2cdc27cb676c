"""Fault injection on a 2-process DDP run of the tiny model (tests/preemption.py has the machinery): seeded SIGKILLs and
SIGTERM, each relaunch ending bitwise equal to the uninterrupted 2-process run."""

import random
import time

import pytest

from tests.preemption import (
    MAX_STEPS,
    SEED,
    Launch,
    complete_checkpoints,
    kill_positions,
    reference,
    run_kill_chain,
    training_data,  # noqa: F401  (autouse fixture: the module's training data file)
)

# one worker: its launches are module fixtures
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_preemption_ddp")]


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory):
    return reference(tmp_path_factory, 2)


def test_ddp_two_processes_survive_seeded_kills_and_sigterm_with_bitwise_equal_weights(tmp_path, reference_ddp):
    rng = random.Random(SEED + 2)
    run_kill_chain(tmp_path, 2, reference_ddp, kill_positions(rng, ["mid_step", "before_marker"]))


def test_ranks_do_not_outlive_their_launcher_killed_with_sigkill(tmp_path):
    """The launcher SIGKILLed after a step (a job's time limit, the OOM killer): each rank gets SIGTERM from the
    kernel (finetune.run.saving.die_with_launcher), they save that step's checkpoint together and exit, instead of
    training on as orphans that hold their devices."""
    output_dir = tmp_path / "out"
    launch = Launch(tmp_path, 2, output_dir)
    deadline = time.monotonic() + 120
    while launch.steps_logged() < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    launch.process.kill()
    launch.wait(timeout=60)  # asserts that no process of the run is left
    text = launch.text()
    assert "SIGTERM: stopped after step" in text, text[-3000:]
    stopped = int(text.split("SIGTERM: stopped after step ", 1)[1].split()[0])
    assert stopped < MAX_STEPS and stopped in complete_checkpoints(output_dir)
