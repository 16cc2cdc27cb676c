"""Shared helpers: every test runs offline, and the tiny models are built once per session in a temporary cache."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory):
    """Tiny models are built by the first run that needs them, into a cache private to this test session."""
    cache = tmp_path_factory.mktemp("tiny-models")
    os.environ["FINETUNE_TINY_CACHE"] = str(cache)
    return cache


def launch_sft(*args: str, cwd: Path = ROOT, launcher: list[str] | None = None, timeout: int = 600):
    """Run scripts/sft.py through the real `accelerate launch`, as a user would."""
    command = launcher if launcher is not None else [ACCELERATE, "launch", "-q"]
    return subprocess.run(
        [*command, str(ROOT / "scripts" / "sft.py"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy(),
    )


def printed_losses(stdout: str) -> list[float]:
    line = next(line for line in stdout.splitlines() if line.startswith("[finetune] train loss:"))
    return [float(value) for value in line.split(":", 1)[1].split("->")]


def printed_setup(stdout: str) -> dict:
    line = next(line for line in stdout.splitlines() if "[finetune] setup:" in line)
    return json.loads(line.split("[finetune] setup:", 1)[1])
