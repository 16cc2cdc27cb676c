"""`finetune check`: every check a run makes before loading a model, all problems printed at once, without training."""

import pytest

from finetune import cli
from tests.helpers import ROOT
from tests.test_families import LISTED, qwen_weights_folder

RECIPE = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"


def checked(capsys, *arguments):
    code = cli.main(["check", *arguments])
    printed = capsys.readouterr()
    return code, [line for line in printed.err.splitlines() if line.startswith("error: ")], printed.out


def test_a_recipe_with_three_problems_gets_all_three_in_one_check(tmp_path, capsys):
    recipe = tmp_path / "three.yaml"
    recipe.write_text(RECIPE.read_text() + "lora_target_parameters: [mlp.experts.down_proj]\nweight_decay: -1\n")
    code, errors, _ = checked(capsys, "--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out"),
                              "--report_to", "wandbx")
    assert code == 2
    assert len(errors) == 3, errors
    assert "`lora_target_parameters` adapts mixture-of-experts weights" in errors[0]
    assert "`weight_decay: -1" in errors[1]
    assert "`report_to: wandbx`" in errors[2]
    assert not (tmp_path / "out").exists()


def test_a_run_stops_at_the_first_of_the_same_problems(tmp_path):
    from finetune.errors import UserError
    from finetune.sft import configure

    recipe = tmp_path / "three.yaml"
    recipe.write_text(RECIPE.read_text() + "lora_target_parameters: [mlp.experts.down_proj]\nweight_decay: -1\n")
    with pytest.raises(UserError, match="`lora_target_parameters` adapts mixture-of-experts weights"):
        configure(["--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("recipe", ["full.yaml", "lora.yaml"])
def test_a_local_model_of_no_family_is_a_problem_the_check_finds(recipe, tmp_path, capsys):
    folder = qwen_weights_folder(tmp_path)
    code, errors, _ = checked(capsys, "--config", str(RECIPE.with_name(recipe)), "--model_name_or_path", folder,
                              "--dataset_name", str(ROOT / "data" / "sample"), "--output_dir", str(tmp_path / "out"))
    assert code == 2
    assert errors == [(f"error: {folder}: `model_type: qwen2` (its config.json) is {LISTED}; pass a model of one of "
                       f"them as model_name_or_path, or add its family to finetune/families.py.")]


def test_tiny_of_a_hub_model_whose_type_cannot_be_read_passes(tmp_path, capsys):
    code, errors, out = checked(capsys, "--config", str(RECIPE), "--tiny", "--model_name_or_path", "Qwen/Qwen2-0.5B",
                                "--output_dir", str(tmp_path / "out"))
    assert (code, errors) == (0, [])
    assert "the tiny llama model stands in for it" in out


def test_a_recipe_without_problems_passes_and_says_what_is_left_to_the_run(tmp_path, capsys):
    code, errors, out = checked(capsys, "--config", str(RECIPE), "--tiny", "--output_dir", str(tmp_path / "out"))
    assert (code, errors) == (0, [])
    assert "no problem found" in out


def test_the_launch_file_is_checked_as_the_training_process_would_see_it(tmp_path, capsys):
    """QLoRA with the FSDP file: refused by the recipe check that reads the strategy accelerate exports."""
    recipe = ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml"
    code, errors, _ = checked(capsys, "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"),
                              "--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out"))
    assert code == 2
    assert any("cannot be sharded by FSDP" in error and "fsdp.yaml" in error for error in errors), errors


def test_a_broken_launch_file_is_one_problem(tmp_path, capsys):
    broken = tmp_path / "broken.yaml"
    broken.write_text("distributed_type: [MULTI_GPU\n")
    code, errors, _ = checked(capsys, "--config_file", str(broken), "--config", str(RECIPE), "--tiny")
    assert code == 2
    assert errors == [error for error in errors if "broken.yaml: not valid YAML" in error] and errors
