"""What the tests share: the project root, one way to launch a training run, and readers for what a run printed."""

import hashlib
import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def free_port() -> int:
    """A port no one listens on now: parallel test workers each launching accelerate on its default 29500 collide."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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


def run_sft_in_process(args: list[str], capfd, monkeypatch) -> subprocess.CompletedProcess:
    """`python scripts/sft.py ARGS`, run in this process so that the imports are paid once: its exit code and what
    it printed. For refusals only: loading a model fails the test, since every refusal must come before it."""
    from finetune.run import model

    def load_model(*_, **__):
        raise AssertionError("a model was loaded: the input was not refused before loading")

    monkeypatch.setattr(model, "load_model", load_model)
    script = str(ROOT / "scripts" / "sft.py")
    monkeypatch.setattr(sys, "argv", [script, *args])
    environment = dict(os.environ)  # a recipe's `env:` and the CPU settings write to it
    capfd.readouterr()
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = exit.code
    finally:
        os.environ.clear()
        os.environ.update(environment)
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([script, *args], code, out, err)


def folder_digest(folder: Path) -> dict:
    """Every file of a folder and its hash: what must not change when a run is refused."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.rglob("*") if path.is_file()}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cpu_offloading(monkeypatch):
    """TRL's activation offloading with the CPU standing in for the GPU: every offloaded tensor is copied into a new
    CPU tensor and copied back in backward, without pinned memory or a second stream (both need a GPU; on a machine
    without one the recipes turn `activation_offloading` off, finetune/models/cpu.py). Returns the context and the log of
    (phase, shape) of every tensor it offloaded."""
    import types

    import torch
    from trl.models.activation_offloading import OffloadActivations

    with monkeypatch.context() as patch:
        patch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cpu"))
        context = OffloadActivations(use_pin_memory=False, use_streams=False)
    context.device_module = types.SimpleNamespace(current_stream=torch.cpu.current_stream, stream=torch.cpu.stream,
                                                  empty_cache=lambda: None)
    offloaded, phase = [], ["forward"]
    pack = context.pack_hook

    def logged_pack(tensor):
        tensor_id = pack(tensor)
        if context.tracker[tensor_id][1]:  # True: copied to the CPU, not kept in place
            offloaded.append((phase[0], tuple(tensor.shape)))
        return tensor_id

    context.pack_hook = logged_pack
    return context, offloaded, phase


def loss_and_backward(model, ids, monkeypatch, offloading: bool):
    """One forward and backward of `ids` as their own labels, under cpu_offloading when `offloading`. Returns the
    loss and the log of what was offloaded."""
    import contextlib

    context, offloaded, phase = cpu_offloading(monkeypatch) if offloading else (None, [], ["forward"])
    if context:
        context.update_model_params(model)
    with context or contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids).loss
        phase[0] = "backward"
        loss.backward()
    return loss.detach(), offloaded
