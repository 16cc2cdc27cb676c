"""The toolkit as a user gets it from `pip install .` (a wheel, not an editable install), used from a folder outside
the repository: the shipped recipes, config files, sample data and training script come with the package."""

import json
import os
import subprocess
import sys
import sysconfig
import venv

import pytest

from finetune.run.evaluation import SCORES_FILE
from tests.helpers import ROOT, printed_losses

# one worker: its wheel and venv are a module fixture, and two workers building the wheel from one checkout at once
# collide in its build/ folder
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_install")]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtual environment holding the project's wheel, whose dependencies come from this environment."""
    folder = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(folder / "wheels")], check=True, capture_output=True, cwd=folder)
    environment = folder / "venv"
    venv.EnvBuilder(with_pip=True).create(environment)
    python = environment / "bin" / "python"
    site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    (environment / site_packages / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = (folder / "wheels").glob("finetune-*.whl")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, capture_output=True)
    outside = folder / "elsewhere"
    outside.mkdir()
    return environment / "bin", outside


def run_installed(installed, *args: str) -> subprocess.CompletedProcess:
    bin_folder, outside = installed
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environment["PATH"] = f"{bin_folder}{os.pathsep}{environment['PATH']}"
    return subprocess.run([str(bin_folder / "finetune"), *args], cwd=outside, env=environment, capture_output=True,
                          text=True, timeout=900)


def test_the_installed_package_is_not_the_repository(installed):
    bin_folder, outside = installed
    where = subprocess.run([str(bin_folder / "python"), "-c", "import finetune; print(finetune.__file__)"], cwd=outside,
                           capture_output=True, text=True, check=True).stdout
    assert "site-packages" in where and str(ROOT) not in where


def test_plan_outside_the_repository_reads_the_shipped_recipe(installed):
    result = run_installed(installed, "plan", "--config", "recipes/llama-3.2-1b/full.yaml", "--gpus", "1", "--gpu", "H200")
    assert result.returncode == 0, result.stderr
    assert "accelerate launch --config_file accelerate_configs/" in result.stdout, result.stdout


def test_no_arguments_trains_the_tiny_llama_until_it_answers_most_held_out_prompts_and_warns_of_nothing(installed):
    result = run_installed(installed, "launch")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (result.stdout + result.stderr).replace("\r", "\n").splitlines()
    warnings = [line for line in lines if "warn" in line.lower() or "error" in line.lower()]
    assert not warnings, warnings
    losses = printed_losses(result.stdout)
    assert losses[-1] < 0.5 * losses[0], losses
    assert "before training:" in result.stdout and "after training:" in result.stdout
    (output_dir,) = (installed[1] / "outputs").glob("default-*")
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "loss.png").is_file()
    scores = json.loads((output_dir / SCORES_FILE).read_text())
    assert scores["before"]["rows"] == scores["after"]["rows"] == 42  # the whole test split of data/sample
    assert scores["before"]["exact_match"] <= 0.1, scores["before"]
    assert scores["after"]["exact_match"] >= 0.6, scores["after"]
