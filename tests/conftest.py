"""Every test runs offline, and the tiny models are built once per session in a temporary cache; the shared helpers
are in tests/helpers.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One thread per torch process, inherited by every process a test starts: the tiny models gain nothing from more, and
# with two test workers (each starting training processes) on two cores, two threads per process wait for each other
# at every op (4 tiny LoRA steps in one process on a busy 2-core machine: 53 s with two threads, 3.4 s with one).
# `accelerate launch` without --cpu already gives its processes one; the rest (in-process runs, notebook kernels,
# `python scripts/sft.py`, `finetune launch`) would take two.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One folder for the ops DeepSpeed compiles on first use (CPU Adam for ZeRO-Offload), inherited by every launch: each
# op is built once, by the first launch that needs it, while the others wait for it (torch's lock in that folder).
# .ci/run points it at the fresh clone; locally it is kept across sessions.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "finetune" / "torch_extensions"))

def pytest_configure(config):
    """Refuse the versions with which pytest-xdist's loadgroup ignores xdist_group marks (pytest-dev/pytest-xdist#1386):
    the modules whose launches are shared module fixtures would repeat them on every worker, silently. Watch for
    processes started by tests not marked `launches` (below)."""
    subprocess.Popen.__init__ = _starts_a_process(subprocess.Popen.__init__)
    if config.getoption("dist", "no") != "loadgroup":
        return
    from importlib.metadata import version

    from packaging.version import Version

    if Version(version("pytest")) >= Version("9.2") and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {version('pytest')} with pytest-xdist {version('pytest-xdist')} ignores xdist_group marks: "
            "install the `test` extra's versions (pip install -e '.[test]') or run with -n 0.")


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory):
    """Tiny models are built by the first run that needs them, into a cache private to this test session."""
    cache = tmp_path_factory.mktemp("tiny-models")
    os.environ["FINETUNE_TINY_CACHE"] = str(cache)
    return cache


# ---- The fast tier: `pytest -m "not launches"` leaves out every test that starts a process -------------------------
# In the fast tier a test (or a fixture it sets up) that starts a process without the mark fails, so the tier stays
# fast and the mark stays true; FINETUNE_LAUNCH_RECORD=FILE lists such tests in FILE (in any run) instead.
_running = {"item": None}


def _starts_a_process(popen_init):
    def checked(self, *args, **kwargs):
        item = _running["item"]
        if item is not None and item.get_closest_marker("launches") is None and not _builds_a_cache(args):
            record = os.environ.get("FINETUNE_LAUNCH_RECORD")
            if record:
                with open(record, "a") as out:
                    out.write(item.nodeid + "\n")
            elif "not launches" in (item.config.getoption("markexpr") or ""):
                raise RuntimeError(f"{item.nodeid} starts a process: mark it `@pytest.mark.launches` (the fast tier, "
                                   f"pytest -m 'not launches', leaves such tests out)")
        return popen_init(self, *args, **kwargs)
    return checked


def _builds_a_cache(popen_args):
    """matplotlib lists the system's fonts with `fc-list` once per machine (its font cache, ~/.cache/matplotlib): the
    first test that draws a loss plot on a fresh machine would otherwise fail the fast tier for a process it never
    asked for."""
    command = popen_args[0] if popen_args else ()
    return isinstance(command, (list, tuple)) and bool(command) and os.path.basename(str(command[0])) == "fc-list"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running["item"] = item
    try:
        return (yield)
    finally:
        _running["item"] = None


@pytest.fixture(autouse=True)
def no_deepspeed_config_left_behind():
    """A test that parses a ZeRO-3 run in this process leaves transformers' global DeepSpeed config set, and every
    later from_pretrained in the same worker would then build its model under DeepSpeed's zero.Init."""
    yield
    deepspeed_integration = sys.modules.get("transformers.integrations.deepspeed")
    if deepspeed_integration is not None:
        deepspeed_integration.unset_hf_deepspeed_config()
