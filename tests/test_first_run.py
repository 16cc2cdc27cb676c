"""What a newcomer reads: no deprecation warning from our recipes, and a failed `finetune launch` is our one sentence."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from finetune.run import arguments
from tests.helpers import ROOT

pytestmark = pytest.mark.launches  # its tests start training processes

RECIPE = str(ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml")  # sets gradient_checkpointing: true


@pytest.mark.parametrize("extra, expected", [
    ([], True),
    (["--gradient_checkpointing", "false"], False),
    (["--activation_checkpointing", "false"], False),
])
def test_either_checkpointing_name_works_and_nothing_warns(tmp_path, extra, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        run = arguments.parse_args(["--config", RECIPE, "--output_dir", str(tmp_path), *extra])
    assert run.training.gradient_checkpointing is expected


def test_a_recipe_with_the_new_checkpointing_name_parses(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(Path(RECIPE).read_text().replace("gradient_checkpointing:", "activation_checkpointing:"))
    assert arguments.parse_args(["--config", str(recipe), "--output_dir", str(tmp_path)]).training.gradient_checkpointing


def test_a_failed_finetune_launch_prints_only_our_sentence(tmp_path):
    finetune = str(Path(sys.executable).with_name("finetune"))
    result = subprocess.run(
        [finetune, "launch", "--config", str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"), "--tiny",
         "--output_dir", str(tmp_path / "out"), "--dataset_mixture", '{"seed": 1}'],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: recipe: `dataset_mixture` needs `datasets:`, a list of {path: ..., fraction: ...}; add it."]
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr
    assert result.stderr.rstrip().endswith(errors[0])
    assert "were not passed to `accelerate launch`" not in result.stderr
