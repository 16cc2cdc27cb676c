"""`finetune check`: every check a run makes before loading a model, all problems printed at once, without training."""

import json

import pytest

from finetune import cli
from tests.helpers import ROOT, run_sft_in_process, write
from tests.test_bad_inputs import with_keys
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


# One problem each, of every stage a run meets before loading: the parse (unknown key, wrong type, unknown flag, a number
# the training arguments refuse), the recipe checks, the output folder, the model's layers. (name, recipe lines, flags)
BROKEN = [
    ("unknown key", "lerning_rate: 0.1", []),
    ("wrong type", "lora_r: sixteen", []),
    ("unknown choice", "lr_scheduler_type: wiggly", []),
    ("unknown flag", "", ["--learning_rat", "1"]),
    ("number the arguments refuse", "", ["--save_steps", "inf"]),
    ("number out of range", "weight_decay: -1", []),
    ("second number out of range", "lora_dropout: 1.5", []),
    ("save_total_limit 0", "save_total_limit: 0", []),
    ("expert LoRA without experts", "lora_target_parameters: [mlp.experts.down_proj]", []),
    ("unknown report_to", "report_to: wandbx", []),
    ("optimizer not installed", "", ["--optim", "lomo"]),  # the same check as report_to's: both found
    ("missing mixture file", "dataset_mixture: {datasets: [{path: gone/rows.jsonl}]}", []),
    ("resume from nothing", "", ["--resume_from_checkpoint", "nowhere/checkpoint-9"]),
    ("LoRA target of no layer", "lora_target_modules: [q_proj, v_prj]", []),
]


def broken_arguments(tmp_path, cases) -> list[str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(with_keys(RECIPE, "\n".join(lines for _, lines, _ in cases if lines)))
    return ["--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out"),
            *[flag for _, _, flags in cases for flag in flags]]


def check_finds(capfd, arguments) -> list[str]:
    capfd.readouterr()
    code = cli.main(["check", *arguments])
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == (2 if errors else 0)
    return errors


def launch_refuses(arguments, capfd, monkeypatch) -> str:
    """What `scripts/sft.py` prints refusing these arguments, run in this process (loading a model fails the test)."""
    result = run_sft_in_process(arguments, capfd, monkeypatch)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("case", BROKEN, ids=[case[0] for case in BROKEN])
def test_check_and_the_launch_give_the_same_verdict_on_each_broken_recipe(case, tmp_path, capfd, monkeypatch):
    arguments = broken_arguments(tmp_path, [case])
    assert check_finds(capfd, arguments) == [launch_refuses(arguments, capfd, monkeypatch)]


def test_check_lists_every_problem_of_a_recipe_at_once_and_the_launch_refuses_the_first(tmp_path, capfd, monkeypatch):
    """Each problem alone is what check finds in the recipe holding them all (an unknown key once hid every other
    problem, and each check stopped at its first), in the order a run meets them."""
    alone = []
    for case in BROKEN:
        alone += check_finds(capfd, broken_arguments(tmp_path, [case]))
    arguments = broken_arguments(tmp_path, BROKEN)
    together = check_finds(capfd, arguments)
    assert sorted(together) == sorted(alone) and len(together) == len(BROKEN), together
    assert launch_refuses(arguments, capfd, monkeypatch) == together[0]


def test_one_lora_target_name_is_a_module_name_not_a_pattern_over_the_whole_name(tmp_path, capfd):
    """TRL makes a one-name list that name alone, which peft matched as a pattern against `model.layers.0.self_attn.
    q_proj`, failing after loading: the name is read as the list it was, and passes the check of the layers."""
    from finetune.run.arguments import parse_args

    arguments = ["--config", str(RECIPE), "--tiny", "--output_dir", str(tmp_path / "out"), "--lora_target_modules",
                 "q_proj"]
    assert parse_args(arguments).model.lora_target_modules == ["q_proj"]
    assert check_finds(capfd, arguments) == []


def test_a_model_folder_missing_a_weight_is_listed_with_the_recipes_other_problems(tmp_path, capsys):
    """The weights checked against config.json from the safetensors headers (a weight no shard holds would be filled
    with random values and trained without a word); the layers are read from config.json alone, so a LoRA target of
    no layer is found beside it."""
    import shutil

    from finetune.models import tiny
    from tests.test_bad_model_folders import Q_PROJ, with_tensors

    folder = shutil.copytree(tiny.tiny_model_folder("llama"), tmp_path / "model")
    with_tensors(lambda tensors: tensors.pop(Q_PROJ))(folder)
    code, errors, _ = checked(capsys, "--config", str(RECIPE), "--model_name_or_path", str(folder), "--dataset_name",
                              str(ROOT / "data" / "sample"), "--output_dir", str(tmp_path / "out"), "--weight_decay",
                              "-1", "--lora_target_modules", "q_proj", "v_prj")
    assert code == 2 and len(errors) == 3, errors
    assert "`weight_decay: -1" in errors[0]
    assert errors[1] == (f"error: {folder}/model.safetensors: holds no {Q_PROJ}, which transformers would fill with "
                         f"random values (a model trained from it would train on them without a word); re-download the "
                         f"model or re-save it with save_pretrained.")
    assert "`lora_target_modules` ['v_prj'] match no layer" in errors[2]


def test_check_reads_the_weights_values_and_names_each_file_holding_nan_in_the_run_s_words(tmp_path, capsys):
    """NaN or infinite values, which the headers do not tell and a run refuses only once loaded (check_finite): one
    line per weights file naming its first such tensor, with the run's words and fix, after every other problem; here
    an adapter's and two shards of its base's, and the base's again after a LoRA target of no layer."""
    from transformers import AutoModelForCausalLM

    from finetune.errors import UserError
    from finetune.models import tiny
    from finetune.run.model import check_finite
    from tests.test_bad_model_folders import LORA_A, Q_PROJ, save_adapter, with_adapter_tensors, with_tensors

    base = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(tiny.tiny_model_folder("llama")).save_pretrained(base, max_shard_size="100KB")
    shard_of = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    norm = "model.norm.weight"
    assert shard_of[Q_PROJ] != shard_of[norm]
    adapter = save_adapter(tiny.tiny_model_folder("llama"), tmp_path / "adapter")
    with_adapter_tensors(lambda tensors: tensors[LORA_A].fill_(float("nan")))(adapter)
    write(adapter / "adapter_config.json", json.dumps({**json.loads((adapter / "adapter_config.json").read_text()),
                                                       "base_model_name_or_path": str(base)}))
    with_tensors(lambda tensors: tensors[Q_PROJ].view(-1)[3].fill_(float("inf")), shard_of[Q_PROJ])(base)
    with_tensors(lambda tensors: tensors[norm].fill_(float("nan")), shard_of[norm])(base)
    with pytest.raises(UserError) as refused:
        check_finite(AutoModelForCausalLM.from_pretrained(base), str(base))
    run_s_words = str(refused.value).removeprefix(f"{base}: {Q_PROJ} ")
    base_lines = sorted(f"error: {base / shard_of[tensor]}: {tensor} {run_s_words}" for tensor in (Q_PROJ, norm))
    arguments = ["--config", str(RECIPE), "--dataset_name", str(ROOT / "data" / "sample"), "--output_dir",
                 str(tmp_path / "out"), "--weight_decay", "-1"]
    code, errors, _ = checked(capsys, *arguments, "--model_name_or_path", str(adapter))
    assert code == 2 and len(errors) == 4 and "`weight_decay: -1" in errors[0], errors
    assert errors[1:] == [f"error: {adapter / 'adapter_model.safetensors'}: {LORA_A} holds NaN or infinite values, so "
                          f"every output it touches would be NaN (a run trained on it logs its loss as 0); re-save the "
                          f"adapter with save_pretrained, or pass one of its run's complete checkpoint-N folders.",
                          *base_lines]
    code, errors, _ = checked(capsys, *arguments, "--model_name_or_path", str(base), "--lora_target_modules", "q_proj",
                              "v_prj")
    assert code == 2 and len(errors) == 4 and "`lora_target_modules` ['v_prj'] match no layer" in errors[1], errors
    assert errors[2:] == base_lines
