"""Fault injection on a 2-process DeepSpeed ZeRO-3 run of the tiny model (tests/preemption.py has the machinery): seeded
SIGKILLs and SIGTERM, each relaunch ending bitwise equal to the uninterrupted ZeRO-3 run."""

import random

import pytest

from tests.preemption import (
    SEED,
    kill_positions,
    reference,
    run_kill_chain,
    training_data,  # noqa: F401  (autouse fixture: the module's training data file)
)

# one worker: its launches are module fixtures
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_preemption_zero3")]


@pytest.fixture(scope="module")
def reference_zero3(tmp_path_factory):
    """Its tiny model is built by this ZeRO-3 launch itself (an empty cache): ZeRO-3 init must not write it empty.
    The kill chain's launches use the session's cache: the same seeded weights, built by non-ZeRO-3 runs."""
    return reference(tmp_path_factory, 2, "zero3", env={"FINETUNE_TINY_CACHE": str(tmp_path_factory.mktemp("cache"))})


def test_zero3_two_processes_survive_seeded_kills_and_sigterm_with_bitwise_equal_weights(tmp_path, reference_zero3):
    rng = random.Random(SEED + 3)
    run_kill_chain(tmp_path, 2, reference_zero3, kill_positions(rng, ["mid_step", "save_optimizer"]), config="zero3")
