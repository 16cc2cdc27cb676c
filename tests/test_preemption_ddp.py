"""Fault injection on a 2-process DDP run of the tiny model (tests/preemption.py has the machinery): seeded SIGKILLs and
SIGTERM, each relaunch ending bitwise equal to the uninterrupted 2-process run."""

import random

import pytest

from tests.preemption import (
    SEED,
    kill_positions,
    reference,
    run_kill_chain,
    training_data,  # noqa: F401  (autouse fixture: the module's training data file)
)

pytestmark = pytest.mark.xdist_group("test_preemption_ddp")  # one worker: its launches are module fixtures


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory):
    return reference(tmp_path_factory, 2)


def test_ddp_two_processes_survive_seeded_kills_and_sigterm_with_bitwise_equal_weights(tmp_path, reference_ddp):
    rng = random.Random(SEED + 2)
    run_kill_chain(tmp_path, 2, reference_ddp, kill_positions(rng, ["mid_step", "before_marker", "save_optimizer"]),
                   sigterm_after_steps=1, external_kill_delay=None)
