"""`finetune launch`: it hands the run to the real `accelerate launch` with the config file it was given, or with the
one the planner chooses for the GPUs it sees. (Its refusals of broken accelerate config files are cases of the table
in tests/test_bad_inputs.py.)"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from finetune.commands import launch as launcher
from finetune.config.files import parse_overrides, read_recipe
from finetune.errors import UserError
from finetune.planner import choice, memory
from tests.helpers import ROOT, free_port, printed_setup

FINETUNE = str(Path(sys.executable).with_name("finetune"))
H200_BYTES = 141 * 10**9


@pytest.mark.launches
def test_launch_runs_the_given_config_file_with_its_processes(tmp_path):
    result = subprocess.run(
        [FINETUNE, "launch", "--config_file", "accelerate_configs/ddp.yaml", "--num_processes", "2",
         "--main_process_port", str(free_port()), "--config", "recipes/llama-3.2-1b/full.yaml", "--tiny",
         "--max_steps", "2", "--eval_strategy", "no", "--report_to", "none", "--output_dir", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    setup = printed_setup(result.stdout)
    assert setup["world_size"] == 2 and setup["strategy"] == "ddp", setup
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.fixture
def gpus(monkeypatch, tmp_path):
    """Pretend this machine has `count` H200s and a node's host memory (1 TiB, what the planner checks), and that
    accelerate has no default config file."""
    def pretend(count: int):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=H200_BYTES))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(launcher, "default_config_file", lambda: str(tmp_path / "no-default-config.yaml"))
    monkeypatch.setattr(choice, "this_host_memory_gib", lambda: 1024.0)
    return pretend


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


@pytest.mark.parametrize("recipe, flags, count, technique", [
    ("recipes/gpt-oss-120b/lora.yaml", ["--dequantize_mxfp4", "true"], 8, "fsdp2"),  # 218 GiB of bf16: sharded over 8
    ("recipes/gpt-oss-120b/lora.yaml", [], 1, "ddp"),  # experts resident in MXFP4: one process on one GPU
    ("recipes/llama-3.2-3b/lora.yaml", [], 8, "ddp"),  # fits one GPU: plain data parallel
])
def test_launch_without_a_config_file_uses_the_planners_choice_for_the_gpus_it_sees(gpus, recipe, flags, count,
                                                                                       technique):
    gpus(count)
    command = launcher.accelerate_command(["--config", recipe, *flags, "--max_steps", "5"])
    chosen = choice.plan(read_recipe(ROOT / recipe, parse_overrides([*flags, "--max_steps", "5"])), gpus=count,
                         gpu_memory_gib=H200_BYTES / 2**30)
    assert chosen.technique == technique
    assert flag(command, "--config_file") == str(ROOT / memory.CONFIG_FILES[technique])
    assert flag(command, "--num_processes") == str(count)
    assert command[-5 - len(flags):] == [str(launcher.SFT_SCRIPT), "--config", recipe, *flags, "--max_steps", "5"]


def test_launch_without_gpus_runs_one_process_on_the_cpu_passing_what_accelerate_would_warn_about(gpus, monkeypatch):
    import psutil

    gpus(0)
    monkeypatch.setattr(launcher, "default_config_file", lambda: "/nonexistent/default_config.yaml")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # tests/conftest.py sets it; a user's shell usually does not
    command = launcher.accelerate_command(["--config", "recipes/llama-3.2-1b/full.yaml", "--tiny"])
    assert "--config_file" not in command and flag(command, "--num_processes") == "1"
    assert [flag(command, name) for name in ("--num_machines", "--mixed_precision", "--dynamo_backend")] == ["1", "no", "no"]
    # accelerate itself would give a process launched without --cpu one thread
    assert flag(command, "--num_cpu_threads_per_process") == str(psutil.cpu_count(logical=False) or 1)
    assert command[-4:] == [str(launcher.SFT_SCRIPT), "--config", "recipes/llama-3.2-1b/full.yaml", "--tiny"]


def test_launch_checks_accelerates_default_config_when_given_no_file(monkeypatch, tmp_path):
    default = tmp_path / "default_config.yaml"
    default.write_text("distributed_type: MULTI_GPX\n")
    monkeypatch.setattr(launcher, "default_config_file", lambda: str(default))
    with pytest.raises(launcher.UserError, match="default_config.yaml: `distributed_type: MULTI_GPX`"):
        launcher.accelerate_command(["--config", "recipes/llama-3.2-1b/full.yaml"])


@pytest.mark.launches
def test_a_broken_accelerate_file_is_refused_without_importing_trl_or_torch(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [MULTI_GPU\n")
    probe = ("import sys; from finetune import cli; code = cli.main(['launch', '--config_file', sys.argv[1]]); "
             "print(code, sorted({'trl', 'torch'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe, str(broken)], capture_output=True, text=True, timeout=60)
    assert result.stdout.split("\n")[0] == "2 []", result.stdout + result.stderr
    assert "broken.yaml: not valid YAML" in result.stderr


@pytest.mark.launches
def test_the_launcher_reads_how_the_run_ended_from_its_outcome_not_from_its_output(capfd):
    """finetune/outcome.py: the training processes write status, output folder and error sentence; printed text that
    looks like either is only shown."""
    import sys

    from finetune.commands import launch as launcher

    def child(code: str) -> list[str]:
        return [sys.executable, "-c", f"import sys; from finetune import outcome; {code}"]

    saved = child("outcome.record(outcome.SAVED, 'out/run'); print('[finetune] saved to elsewhere')")
    refused = child("outcome.record(outcome.USER_ERROR, error='recipe.yaml: `lr: x` is no number; fix it.'); "
                    "print('error: recipe.yaml: `lr: x` is no number; fix it.', file=sys.stderr); sys.exit(2)")
    crashed = child("print('error: looks like a sentence', file=sys.stderr); sys.exit(1)")
    assert launcher.run_and_report(saved) == (0, None, "out/run")
    assert launcher.run_and_report(refused) == (2, "recipe.yaml: `lr: x` is no number; fix it.", None)
    assert launcher.run_and_report(crashed) == (1, None, None)
    assert "error: looks like a sentence" in capfd.readouterr().err


@pytest.mark.launches
def test_the_training_processes_get_the_launch_arguments_from_the_launcher_not_from_a_parent_command_line(tmp_path):
    """The fake `accelerate` starts its training process through `sh`, whose command line says nothing of the launch:
    what the process knows of it (the config file it names, the request it checks) came from `finetune launch`."""
    training = ("import json; from finetune.config import launch_request; "
                "print(json.dumps([launch_request.accelerate_launch_arguments(), launch_request.accelerate_config_file()]))")
    accelerate = tmp_path / "accelerate"
    accelerate.write_text(f"#!/bin/sh\nsh -c '{sys.executable} -c \"{training}\"'\n")
    accelerate.chmod(0o755)
    command = [str(accelerate), "launch", "--config_file", "mine.yaml", "--num_processes", "2", "sft.py", "--tiny"]
    printed = subprocess.run([sys.executable, "-c", f"from finetune.commands import launch; launch.run_and_report({command!r})"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    arguments, config_file = json.loads(printed.stdout.strip().splitlines()[-1])
    assert arguments == ["--config_file", "mine.yaml", "--num_processes", "2", "sft.py", "--tiny"], printed.stderr
    assert config_file == "mine.yaml"


@pytest.mark.parametrize("flag, value, bounds", [("num_processes", "0", "of at least 1"),
                                                  ("machine_rank", "-1", "of at least 0"),
                                                  ("main_process_port", "abc", "from 1 to 65535"),
                                                  ("main_process_port", "70000", "from 1 to 65535")])
def test_a_launcher_flag_out_of_its_range_is_refused_before_accelerate_sees_it(flag, value, bounds):
    with pytest.raises(UserError) as refused:
        launcher.accelerate_command([f"--{flag}", value, "--config", "recipes/llama-3.2-1b/full.yaml", "--tiny"])
    assert str(refused.value) == f"command line: `--{flag} {value}` must be a whole number {bounds}; fix that flag."
