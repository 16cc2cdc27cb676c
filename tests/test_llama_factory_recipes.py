"""Recipes users bring from LLaMA-Factory (real files in tests/data/external/recipes/llama-factory, README there): its
keys that mean a setting here reach the run, and the planner, under that name, LLaMA-Factory's defaults standing where
TRL's differ, so that a LoRA recipe never trains every weight; what cannot be read is refused in one sentence, and the
recipe changed as each part of that sentence says runs as the file meant. No test here loads a model."""

import math
import re

import pytest
import yaml

from finetune.config.llama_factory import read_llama_factory_recipe
from finetune.data import load as data
from finetune.errors import UserError
from finetune.planner.setup import recipe_with_flags, setup_from_recipe
from finetune.run import arguments
from tests.helpers import ROOT, write
from tests.test_bad_inputs import check_bad_input
from tests.test_external_recipes import EXTERNAL, SAMPLE, name

EXAMPLES = EXTERNAL / "llama-factory" / "examples" / "train_lora"
LORA_SFT = EXAMPLES / "llama3_lora_sft.yaml"  # the rank, alpha and dropout left to LLaMA-Factory's defaults
GPT_OSS_LORA_SFT = EXAMPLES / "gpt_lora_sft.yaml"  # `lora_rank: 8`, `template: gpt`
DPO = EXAMPLES / "llama3_lora_dpo.yaml"
SAMPLE_ROWS = ROOT / "data" / "sample" / "train.jsonl"


def refusal(recipe_file) -> str:
    with pytest.raises(UserError) as refused:
        arguments.parse_args(["--config", str(recipe_file), "--output_dir", "unused"])
    return str(refused.value)


def hints(sentence: str) -> dict[str, str]:
    """Each refused key of the sentence and what it says to do."""
    return dict(re.findall(r"`(\w+)` \(([^()]*)\)", sentence))


def follow(recipe: dict, sentence: str, tmp_path, finetuning_type: str = "lora") -> dict:
    """The recipe changed as each part of the refusal says, and as nothing else: every hint of the sentence must be
    one of those below, each done as it is worded."""
    recipe, held_out = dict(recipe), None
    for key, hint in hints(sentence).items():
        value = recipe.pop(key)
        if hint.endswith("set `dataset_name` to a hub id or a local file instead"):
            recipe["dataset_name"] = str(SAMPLE_ROWS)
        elif hint.endswith("save the rows to train on to a file and give it as `dataset_name`"):
            rows = SAMPLE_ROWS.read_text().splitlines()[:value]
            recipe["dataset_name"] = str(write(tmp_path / "first_rows.jsonl", "\n".join(rows) + "\n"))
        elif hint.endswith("write `finetuning_type: lora` or `finetuning_type: full`"):
            recipe["finetuning_type"] = finetuning_type
        elif hint.endswith("give it as `test_split_size` of a `dataset_mixture` of the data"):
            held_out = value
        else:
            raise AssertionError(f"a hint this test cannot follow: `{key}` ({hint})")
    if held_out is not None:  # once the data is named
        recipe["dataset_mixture"] = {"datasets": [{"path": recipe.pop("dataset_name")}], "test_split_size": held_out}
    return recipe


def parsed(tmp_path, recipe: dict):
    return arguments.parse_args(["--config", str(write(tmp_path / "fixed.yaml", yaml.safe_dump(recipe))),
                                 "--output_dir", str(tmp_path / "out")])


@pytest.mark.parametrize("recipe_file", [LORA_SFT, GPT_OSS_LORA_SFT], ids=name)
def test_a_llama_factory_lora_recipe_changed_as_its_refusal_says_trains_lora_as_the_file_meant(recipe_file, tmp_path,
                                                                                             capsys):
    written = yaml.safe_load(recipe_file.read_text())
    sentence = refusal(recipe_file)
    assert set(hints(sentence)) == {"dataset", "max_samples", "val_size"} & set(written)
    run = parsed(tmp_path, follow(written, sentence, tmp_path))
    model, training = run.model, run.training
    assert (model.use_peft, model.lora_r, model.lora_alpha, model.lora_dropout) == (True, 8, 16, 0.0)
    assert model.lora_target_modules in ("all-linear", ["all-linear"])
    assert (training.max_length, training.assistant_only_loss) == (written["cutoff_len"], True)
    assert (training.learning_rate, training.num_train_epochs) == (1e-4, 3.0)
    said = capsys.readouterr().out
    assert "read LLaMA-Factory's `finetuning_type: lora` as `use_peft: true`" in said
    assert f"`template: {written['template']}` (the rows are rendered with the model's own chat template" in said
    train, test = data.load_datasets(run.script, run.training, sources=run.finetune)
    if "val_size" in written:  # that share of the rows set aside for evaluation, as LLaMA-Factory's val_size
        assert len(test) == math.ceil(written["val_size"] * (len(train) + len(test)))


def test_the_planner_reads_a_llama_factory_recipe_as_lora_as_the_run_does(tmp_path):
    recipe = follow(yaml.safe_load(GPT_OSS_LORA_SFT.read_text()), refusal(GPT_OSS_LORA_SFT), tmp_path)
    path = str(write(tmp_path / "fixed.yaml", yaml.safe_dump(recipe)))
    setup = setup_from_recipe(recipe_with_flags(path, []), path)
    assert (setup.method, setup.lora_r, setup.max_length) == ("lora", 8, 2048)
    assert recipe_with_flags(path, ["--lora_r", "4"])["lora_r"] == 4  # the command line wins, as in the run


@pytest.mark.parametrize("finetuning_type", ["lora", "full"])
def test_freeze_tuning_is_refused_and_the_method_written_as_told_is_the_one_trained(finetuning_type, tmp_path):
    written = {**yaml.safe_load(GPT_OSS_LORA_SFT.read_text()), "finetuning_type": "freeze",
               "dataset": str(SAMPLE_ROWS)}
    del written["max_samples"]
    frozen = write(tmp_path / "freeze.yaml", yaml.safe_dump(written))
    sentence = refusal(frozen)
    assert set(hints(sentence)) == {"finetuning_type"}
    run = parsed(tmp_path, follow(written, sentence, tmp_path, finetuning_type))
    lora = finetuning_type == "lora"
    assert run.model.use_peft is lora
    assert (run.model.lora_r == 8) is lora and ("lora_target_modules" in run.explicit_keys) is lora


@pytest.mark.parametrize("lora_target, modules", [("all", "all-linear"), ("q_proj,v_proj", ["q_proj", "v_proj"]),
                                                  ("q_proj, o_proj", ["q_proj", "o_proj"])])
def test_lora_target_is_read_as_the_modules_it_names(lora_target, modules):
    values, _ = read_llama_factory_recipe({"finetuning_type": "lora", "lora_target": lora_target})
    assert values["lora_target_modules"] == modules


def test_a_lora_alpha_the_recipe_sets_stands_where_llama_factory_would_take_twice_the_rank(tmp_path):
    recipe = write(tmp_path / "alpha.yaml", f"finetuning_type: lora\nlora_rank: 4\nlora_alpha: 32\n"
                                            f"dataset_name: {SAMPLE_ROWS}\n")
    run = arguments.parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert (run.model.use_peft, run.model.lora_r, run.model.lora_alpha) == (True, 4, 32)


def test_a_llama_factory_recipe_naming_a_local_file_trains_it_and_its_own_defaults_stand(tmp_path, capsys):
    recipe = write(tmp_path / "local.yaml", f"model_name_or_path: meta-llama/Llama-3.2-1B-Instruct\nstage: sft\n"
                                            f"dataset: {SAMPLE_ROWS}\ntemplate: llama3\n")
    run = arguments.parse_args(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert run.script.dataset_name == str(SAMPLE_ROWS)
    assert (run.model.use_peft, run.model.lora_r, run.model.lora_alpha, run.training.max_length) == (True, 8, 16, 2048)
    said = capsys.readouterr().out
    assert "LLaMA-Factory's defaults for what it leaves out: `use_peft: true` (`finetuning_type: lora`)" in said


def test_recipes_of_other_projects_are_not_read_as_llama_factory_recipes():
    others = [path for path in EXTERNAL.rglob("*.y*ml") if "llama-factory" not in path.parts]
    assert others
    for recipe_file in others:
        recipe = yaml.safe_load(recipe_file.read_text())
        assert read_llama_factory_recipe(recipe) == (recipe, []), recipe_file


REFUSALS = [
    ("a LLaMA-Factory recipe as published: its dataset_info.json names, max_samples and val_size",
     lambda t: ["--config", str(LORA_SFT), "--tiny"],
     [("llama3_lora_sft.yaml: unknown keys `dataset` (LLaMA-Factory's name for datasets listed in its "
       "dataset_info.json: set `dataset_name` to a hub id or a local file instead)"), "`max_samples` (",
      "`val_size` ("]),
    ("a LLaMA-Factory DPO recipe",
     lambda t: ["--config", str(DPO), "--tiny"],
     ["llama3_lora_dpo.yaml", "`stage` (finetune trains SFT only"]),
    ("freeze tuning",
     lambda t: ["--config", str(write(t / "freeze.yaml", f"finetuning_type: freeze\ndataset: {SAMPLE}\n")),
                "--tiny"],
     [("`finetuning_type` (LLaMA-Factory's freeze and OFT tuning have no equivalent here: write "
       "`finetuning_type: lora` or `finetuning_type: full`)")]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_what_a_llama_factory_recipe_sets_and_cannot_be_read_is_refused_in_one_sentence(case, tmp_path, capfd,
                                                                                      monkeypatch):
    check_bad_input(case, tmp_path, capfd, monkeypatch)



@pytest.mark.parametrize("written, read", [
    ({"train_on_prompt": "false"}, {"assistant_only_loss": True}),  # once: the prompts trained, the opposite
    ({"train_on_prompt": "True"}, {"assistant_only_loss": False}),
    ({"lora_target": ["q_proj", "v_proj"]}, {"lora_target_modules": ["q_proj", "v_proj"]}),  # once: "['q_proj'"
    ({"lora_target": "q_proj, v_proj"}, {"lora_target_modules": ["q_proj", "v_proj"]}),
    ({"lora_rank": "16"}, {"lora_r": 16, "lora_alpha": 32}),  # once: alpha left to TRL's 16
])
def test_quoted_booleans_numbers_and_yaml_lists_are_read_as_llama_factory_s_parser_reads_them(written, read):
    values, _ = read_llama_factory_recipe({"finetuning_type": "lora", **written})
    assert {key: values[key] for key in read} == read
