"""Fault injection, shared by tests/test_preemption_*.py: runs of the tiny model are killed (SIGKILL) at seeded random steps and save moments, stopped by
SIGTERM, given a full disk, a folder they may not write to, and corrupted checkpoints; every one is relaunched with the
same command and must end with exactly the weights and loss curve of an uninterrupted run.

Kills are chained: one run is killed at K positions in increasing order (each relaunch resumes and runs on to the next
kill), so K kills cost K + 1 launches; every complete checkpoint left behind after each kill is compared with the
uninterrupted run's checkpoint of the same step, and the final weights and full-precision losses at the end.
"""

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.run_folder import PREEMPTED_EXIT_CODE, checkpoint_problem
from tests.helpers import ACCELERATE, ROOT, free_port

SEED = 20260601  # the kill positions are drawn from this: CI kills at the same places every time
RECIPE = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
MAX_STEPS, SAVE_STEPS = 12, 3
WEIGHTS = "adapter_model.safetensors"

# Runs in every rank instead of scripts/sft.py: arms one fault from FAULT="kind:step", then runs the real script.
# Kinds: slow_step (that step sleeps two minutes first), mid_step (after the first backward of that step, before the
# optimizer step), save_weights (the weights file
# of checkpoint-step half written), save_optimizer (weights written, optimizer not yet), before_marker (every file
# written, no marker yet), before_rotation (marker written, older checkpoints not yet rotated), enospc / eacces (the
# optimizer write of checkpoint-step fails), final_enospc (the final model's write fails once its files are written),
# plot_enospc (the loss plot's write fails, after the final model is in place). A kill is a SIGKILL of the whole process group: launcher and all ranks.
INJECT = r'''
import errno, os, runpy, signal, sys
kind, _, step = os.environ.get("FAULT", "none:0").partition(":")
step = int(step or 0)

def kill():
    # The launcher's process group (the launcher, and a single-process run's training process), and every rank:
    # torchrun starts each rank in a session of its own, so the ranks are found as the launcher's children.
    sys.stdout.flush()
    leader = os.getppid()  # the launcher: a session leader (the test starts it so), parent of every rank
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if parent == leader and int(entry) != os.getpid():
            try:
                os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.killpg(leader, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)

import safetensors.torch
import transformers
from finetune.run import saving
from finetune import run_folder
Trainer = transformers.Trainer
if kind == "mid_step":
    original_training_step = Trainer.training_step
    def training_step(self, *args, **kwargs):
        result = original_training_step(self, *args, **kwargs)
        if self.state.global_step + 1 == step and int(os.environ.get("RANK", "0")) == 0:
            kill()
        return result
    Trainer.training_step = training_step
if kind == "slow_step":  # a step that takes minutes, as the first one does while the layers compile on a GPU
    import time
    original_step = Trainer.training_step
    def slow_training_step(self, *args, **kwargs):
        if self.state.global_step + 1 == step:
            time.sleep(120)
        return original_step(self, *args, **kwargs)
    Trainer.training_step = slow_training_step
if kind == "save_weights":
    original_save_file = safetensors.torch.save_file
    def save_file(tensors, filename, *args, **kwargs):
        original_save_file(tensors, filename, *args, **kwargs)
        if f"checkpoint-{step}" in str(filename):
            with open(filename, "r+b") as handle:
                handle.truncate(os.path.getsize(filename) // 2)
            kill()
    safetensors.torch.save_file = save_file
    import peft.peft_model, transformers.modeling_utils
    peft.peft_model.safe_save_file = transformers.modeling_utils.safe_save_file = save_file  # imported by name
if kind in ("save_optimizer", "enospc", "eacces"):
    original_save_optimizer = Trainer._save_optimizer_and_scheduler
    def save_optimizer(self, output_dir):
        if self.state.global_step == step:
            if kind == "save_optimizer":
                kill()
            code = errno.ENOSPC if kind == "enospc" else errno.EACCES
            raise OSError(code, os.strerror(code), os.path.join(output_dir, "optimizer.pt"))
        return original_save_optimizer(self, output_dir)
    Trainer._save_optimizer_and_scheduler = save_optimizer
if kind == "final_enospc":  # the final model's write runs out of space half way
    original_save_model = Trainer.save_model
    def save_model(self, output_dir=None, *args, **kwargs):
        original_save_model(self, output_dir, *args, **kwargs)
        if str(output_dir).endswith(saving.FINAL_ASIDE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(output_dir, "adapter_model.safetensors"))
    Trainer.save_model = save_model
if kind == "plot_enospc":  # the disk fills up after the final model is in place
    from finetune.run import trainer
    def save_loss_plot(log_history, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    trainer.save_loss_plot = save_loss_plot
if kind == "before_marker":
    original_write_marker = run_folder.write_marker
    def write_marker(folder, at_step, world_size):
        if at_step == step:
            kill()
        return original_write_marker(folder, at_step, world_size)
    run_folder.write_marker = write_marker
if kind == "before_rotation":
    original_rotate = run_folder.rotate
    def rotate(output_dir, *args, **kwargs):
        if (__import__("pathlib").Path(output_dir) / f"checkpoint-{step}" / run_folder.MARKER).exists():
            kill()
        return original_rotate(output_dir, *args, **kwargs)
    run_folder.rotate = rotate
sys.argv = [os.environ["SFT_SCRIPT"], *sys.argv[1:]]
runpy.run_path(os.environ["SFT_SCRIPT"], run_name="__main__")
'''

# Order of the moments within one step, for sorting kill positions.
PHASES = ["mid_step", "save_weights", "save_optimizer", "before_marker", "before_rotation"]
SAVE_PHASES = PHASES[1:]


def launcher(processes: int, config: str) -> list[str]:
    if processes == 1:
        return [ACCELERATE, "launch", "-q"]
    return [ACCELERATE, "launch", "-q", "--config_file", str(ROOT / "accelerate_configs" / f"{config}.yaml"),
            "--num_processes", str(processes), "--main_process_port", str(free_port())]


class Launch:
    """One `accelerate launch` in its own process group, so that a kill takes the launcher and every rank."""

    def __init__(self, tmp: Path, processes: int, output_dir: Path, *extra: str, fault: str | None = None,
                 config: str = "ddp", env: dict | None = None):
        self.log = tmp / f"launch-{time.monotonic_ns()}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "SFT_SCRIPT": str(ROOT / "scripts" / "sft.py"), **(env or {})}
        if fault:
            env["FAULT"] = fault
        inject = tmp / "inject.py"
        if not inject.exists():
            inject.write_text(INJECT)
        command = [*launcher(processes, config), str(inject), *run_args(tmp, output_dir), *extra]
        self.handle = open(self.log, "w")
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.handle, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self.pgid = self.process.pid
        self.output_dir = str(output_dir)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def steps_logged(self) -> int:
        return self.text().count("'loss': ")

    def group_alive(self) -> bool:
        """The launcher's group, or any rank (torchrun puts ranks in sessions of their own) of this output_dir."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            pass
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                if self.output_dir in Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace"):
                    return True
            except OSError:
                continue
        return False

    def wait(self, timeout: float = 300) -> int:
        code = self.process.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.group_alive() and time.monotonic() < deadline:  # the ranks outlive a launcher killed by SIGTERM
            time.sleep(0.05)
        assert not self.group_alive(), "a process of this run outlived the wait"
        self.handle.close()
        return code

    def kill(self, sig=signal.SIGKILL) -> None:
        os.killpg(self.pgid, sig)


DATA: list[Path] = []  # one training file for the whole module: a run's identity includes its dataset path


@pytest.fixture(scope="module", autouse=True)
def training_data(tmp_path_factory):
    """96 rows of the sample data: 16 rows a step (8 x 2 accumulated) is 6 steps an epoch, so 12 steps cross one."""
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    rows = (ROOT / "data" / "sample" / "train.jsonl").read_text().splitlines()[:96]
    path.write_text("\n".join(rows) + "\n")
    DATA[:] = [path]
    return path


def run_args(tmp: Path, output_dir: Path) -> list[str]:
    return ["--config", str(RECIPE), "--tiny", "--dataset_name", str(DATA[0]), "--output_dir", str(output_dir),
            "--max_steps", str(MAX_STEPS), "--save_steps", str(SAVE_STEPS), "--logging_steps", "1",
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2",
            "--eval_strategy", "no", "--report_to", "none", "--max_length", "64"]


def complete_checkpoints(output_dir: Path) -> dict[int, Path]:
    return {int(path.name.split("-")[1]): path for path in output_dir.glob("checkpoint-*") if checkpoint_problem(path) is None}


def losses(folder: Path) -> list[float]:
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def optimizer_tensors(folder: Path) -> list[torch.Tensor]:
    state = torch.load(folder / "optimizer.pt", weights_only=True)["state"]
    return [tensor for key in sorted(state) for _, tensor in sorted(state[key].items()) if torch.is_tensor(tensor)]


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Bitwise: the weights, the optimizer state, and the full-precision loss history."""
    got_weights, want_weights = load_file(got / WEIGHTS), load_file(want / WEIGHTS)
    assert got_weights.keys() == want_weights.keys()
    for name in want_weights:
        difference = (got_weights[name] - want_weights[name]).abs().max().item()
        assert torch.equal(got_weights[name], want_weights[name]), f"{got}: {name} differs by {difference:.3e}"
    if (want / "optimizer.pt").exists():
        assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(got), optimizer_tensors(want), strict=True)), got
    assert losses(got) == losses(want), f"{got}: the loss curve differs, so the data order after resume differs"


def reference(tmp_path_factory, processes: int, config: str = "ddp", env: dict | None = None) -> Path:
    tmp = tmp_path_factory.mktemp(f"reference-{processes}-{config}")
    output_dir = tmp / "out"
    launch = Launch(tmp, processes, output_dir, "--save_total_limit", "None", config=config, env=env)
    assert launch.wait() == 0, launch.text()[-3000:]
    assert sorted(complete_checkpoints(output_dir)) == [3, 6, 9, 12]
    assert len(losses(output_dir)) == MAX_STEPS
    return output_dir


def kill_positions(rng: random.Random, phases: list[str]) -> list[tuple[int, str]]:
    """One kill per phase at a seeded random step (any step for mid_step, a saving step otherwise), in the order a
    run reaches them; all in steps 1-9, so that the relaunches after them still have steps left for the outside kill and
    the SIGTERM."""
    last = MAX_STEPS - SAVE_STEPS
    positions = set()
    for phase in phases:
        steps = range(1, last + 1) if phase == "mid_step" else range(SAVE_STEPS, last + 1, SAVE_STEPS)
        positions.add((rng.choice([step for step in steps if (step, phase) not in positions]), phase))
    return sorted(positions, key=lambda position: (position[0], PHASES.index(position[1])))


def wait_for_steps(launch: Launch, steps: int) -> None:
    """Until the launch has logged `steps` losses (or ended): a moment the run signals, not a wall-clock delay."""
    while launch.steps_logged() < steps and launch.process.poll() is None:
        time.sleep(0.05)


def run_kill_chain(tmp: Path, processes: int, reference_dir: Path, positions, external_kill: bool = False,
                   config: str = "ddp") -> None:
    """The seeded SIGKILLs in order; with `external_kill`, a SIGKILL of the whole process group from outside (the OOM
    killer, a scheduler) while the next launch trains; a SIGTERM after one more logged step; the last relaunch then
    ends bitwise equal to the uninterrupted run. Every launch after the first injected kill resumes from step 9 or
    earlier, so the outside kill and the SIGTERM both land with steps still to train."""
    output_dir = tmp / "out"
    name = f"{processes}-process" if config == "ddp" else f"{processes}-process {config}"
    for step, phase in positions:
        launch = Launch(tmp, processes, output_dir, "--save_total_limit", "2", fault=f"{phase}:{step}", config=config)
        code = launch.wait()
        assert code == -signal.SIGKILL, f"the {phase}:{step} kill did not happen (exit {code}):\n{launch.text()[-3000:]}"
        assert_complete_checkpoints_match(output_dir, reference_dir)
        if phase in SAVE_PHASES and phase != "before_rotation":
            assert step not in complete_checkpoints(output_dir), "a checkpoint killed mid-write must not count as complete"
    if external_kill:
        launch = Launch(tmp, processes, output_dir, "--save_total_limit", "2", config=config)
        wait_for_steps(launch, 1)
        assert launch.process.poll() is None, f"the run ended before the outside kill:\n{launch.text()[-3000:]}"
        launch.kill()
        assert launch.wait() == -signal.SIGKILL
        assert_complete_checkpoints_match(output_dir, reference_dir)
    launch = Launch(tmp, processes, output_dir, "--save_total_limit", "2", config=config)
    wait_for_steps(launch, 1)
    signalled = time.monotonic()
    if processes == 1:
        launch.kill(signal.SIGTERM)  # to the process group, as SLURM and `kill -TERM -PGID` do
    else:
        launch.process.send_signal(signal.SIGTERM)  # to the launcher alone: torchrun forwards it to the ranks
    launch.wait()
    grace = time.monotonic() - signalled
    text = launch.text()
    assert "SIGTERM: stopped after step" in text and f"exiting with code {PREEMPTED_EXIT_CODE}" in text, text[-3000:]
    stopped = int(text.split("SIGTERM: stopped after step ", 1)[1].split()[0])
    assert stopped < MAX_STEPS and checkpoint_problem(output_dir / f"checkpoint-{stopped}") is None
    assert losses(output_dir / f"checkpoint-{stopped}") == losses(reference_dir)[:stopped], "the loss curve differs"
    print(f"\n[preemption] {name} SIGTERM after step {stopped}: all processes gone {grace:.2f} s "
          f"after the signal; {text.split('SIGTERM: ', 1)[1].split('Relaunch')[0].strip()}")
    assert grace < 30, "torchrun's default grace before SIGKILL is 30 s"
    final = Launch(tmp, processes, output_dir, "--save_total_limit", "2", config=config)
    assert final.wait() == 0, final.text()[-3000:]
    assert f"resuming from {output_dir / f'checkpoint-{stopped}'}" in final.text(), final.text()[-3000:]
    assert_same_checkpoint(output_dir, reference_dir)
    assert_same_checkpoint(output_dir / f"checkpoint-{MAX_STEPS}", reference_dir / f"checkpoint-{MAX_STEPS}")
    assert len(list(output_dir.glob("checkpoint-*"))) <= 2, "save_total_limit: 2 still holds after the kills"


def assert_complete_checkpoints_match(output_dir: Path, reference_dir: Path) -> None:
    """Every complete checkpoint a kill left behind is the uninterrupted run's checkpoint of that step."""
    for at_step, folder in complete_checkpoints(output_dir).items():
        if (reference_dir / f"checkpoint-{at_step}").exists():  # a SIGTERM save may be at a step it did not save
            assert_same_checkpoint(folder, reference_dir / f"checkpoint-{at_step}")


def copy_run(source: Path, destination: Path) -> Path:
    subprocess.run(["cp", "-a", str(source), str(destination)], check=True)
    for name in ("adapter_model.safetensors", "trainer_state.json", "training_args.bin", "adapter_config.json"):
        (destination / name).unlink()  # only the checkpoints: the final files are what the relaunch must rewrite
    return destination

def tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0

def error_line(text: str) -> str:
    lines = re.findall(r"error: [^\r\n]*", text)  # may follow a tqdm bar on the same line
    assert len(lines) == 1, text[-3000:]
    return lines[0]
