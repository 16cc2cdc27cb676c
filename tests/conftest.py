"""Every test runs offline, and the tiny models are built once per session in a temporary cache; the shared helpers
are in tests/helpers.py."""

import os

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

def pytest_configure(config):
    """Refuse the versions with which pytest-xdist's loadgroup ignores xdist_group marks (pytest-dev/pytest-xdist#1386):
    the modules whose launches are shared module fixtures would repeat them on every worker, silently."""
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
