"""The model families (finetune/families.py): every entry has its files, a model is of the family its hub id, its
stored architecture or its config.json's model_type says, and a model of none is refused in one sentence that lists
the families, before anything loads."""

import json
import re
import shutil

import pytest

from finetune import families
from finetune.checks import model_folder
from finetune.checks import recipe as recipe_checks
from finetune.errors import UserError
from finetune.models import tiny
from finetune.planner import architecture as planner_architecture
from finetune.run import model
from finetune.run.arguments import parse_args
from tests.helpers import ROOT, write
from tests.test_bad_inputs import FULL, LORA, check_bad_input

LISTED = "of no model family finetune knows (llama (model_type llama, mistral), gpt-oss (model_type gpt_oss))"
QWEN2 = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def config_folder(folder, values: dict) -> str:
    write(folder / "config.json", json.dumps(values))
    return str(folder)


def test_every_family_has_its_files():
    for family in families.FAMILIES.values():
        for architecture in {*family.hub_ids.values(), family.tiny.architecture}:
            stored = json.loads((families.MODEL_CONFIGS_DIR / f"{architecture}.json").read_text())
            assert stored["model_type"] in family.model_types, architecture
        assert (tiny.TINY_TOKENIZERS_DIR / family.name / "tokenizer.json").is_file()
        assert families.trl_chat_template(family)
        if family.training_chat_template:
            assert (families.CHAT_TEMPLATES_DIR / family.training_chat_template).is_file()
        assert family.tiny.scaled_down["hidden_size"] == families.TINY_WIDTH


def test_a_model_is_of_the_family_its_hub_id_stored_architecture_or_config_json_names(tmp_path):
    of = families.family_of
    assert of("meta-llama/Llama-3.2-3B-Instruct").name == of("llama-3.2-1b").name == "llama"
    assert of("openai/gpt-oss-120b").name == of("gpt-oss-20b").name == "gpt-oss"
    assert of(config_folder(tmp_path / "a", {"model_type": "llama"})).name == "llama"
    gpt_oss = config_folder(tmp_path / "b", {"model_type": "gpt_oss"})
    assert of(gpt_oss).name == "gpt-oss" and of(gpt_oss).experts
    adapter = write(tmp_path / "c" / "adapter_config.json", json.dumps({"base_model_name_or_path": gpt_oss})).parent
    assert of(str(adapter)).name == "gpt-oss"  # a LoRA adapter is of its base model's family
    # offline (tests/conftest.py), a hub id not in the cache is of the family its name says
    assert of("unsloth/gpt-oss-20b-BF16").name == "gpt-oss" and of("mistralai/Mistral-7B-v0.1").name == "llama"


def test_a_model_of_no_family_is_refused_in_one_sentence_that_lists_the_families(tmp_path):
    qwen = config_folder(tmp_path / "qwen", QWEN2)
    with pytest.raises(UserError, match="finetune/families.py") as refused:
        families.family_of(qwen)
    assert str(refused.value).startswith(f"{qwen}: `model_type: qwen2` (its config.json) is {LISTED}; ")
    with pytest.raises(UserError) as refused:  # offline (tests/conftest.py) and not in the hub cache
        families.family_of("Qwen/Qwen2.5-0.5B")
    assert str(refused.value).startswith("Qwen/Qwen2.5-0.5B: neither a config.json (in its folder, on the hub or in "
                                         "the hub cache) nor its name tells its model type")
    assert LISTED in str(refused.value)
    with pytest.raises(UserError, match="model_type: qwen2"):  # the planner too: it knows no qwen2 layer layout
        planner_architecture.architecture_of(qwen)
    # SmolLM3 builds on Llama's layers but leaves out rotary embeddings in every fourth, on Qwen2's model: no Llama
    smollm3 = config_folder(tmp_path / "smollm3", {"model_type": "smollm3"})
    with pytest.raises(UserError, match=f"`model_type: smollm3` \\(its config.json\\) is {re.escape(LISTED)}"):
        families.family_of(smollm3)


@pytest.fixture
def nothing_loads(monkeypatch):
    """Building the tiny stand-in or loading the tokenizer fails the test (run_sft_in_process fails loading the
    model): the refusal must come before all of them."""
    def loaded(*_, **__):
        raise AssertionError("something loaded before the refusal")

    monkeypatch.setattr(tiny, "tiny_model_folder", loaded)
    monkeypatch.setattr(model, "load_tokenizer", loaded)


def qwen_weights_folder(tmp):
    """The tiny Llama's folder with its config.json saying qwen2, and the biases of qwen2's q, k and v projections
    added: a whole model check_model lets through."""
    import safetensors.torch
    import torch

    folder = tmp / "qwen-weights"
    shutil.copytree(tiny.tiny_model_folder("llama"), folder)
    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    for name in [name for name in tensors if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        tensors[name.replace(".weight", ".bias")] = torch.zeros(tensors[name].shape[0])
    safetensors.torch.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    values = json.loads((folder / "config.json").read_text())
    return config_folder(folder, {**values, "model_type": "qwen2"})


REFUSALS = [
    ("--tiny of a local folder of no family",
     lambda t: ["--config", str(FULL), "--tiny", "--model_name_or_path", config_folder(t / "qwen", QWEN2)],
     ["qwen: `model_type: qwen2` (its config.json) is", LISTED, "model_name_or_path", "finetune/families.py"]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_training_a_model_of_no_family_is_refused_before_anything_loads(case, tmp_path, capfd, monkeypatch,
                                                                         nothing_loads):
    check_bad_input(case, tmp_path, capfd, monkeypatch)


@pytest.mark.parametrize("recipe", [FULL, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("settings", [[], ["--experts_implementation", "eager"]], ids=["plain", "experts kernel"])
def test_training_a_local_model_of_no_family_is_refused_before_anything_loads(recipe, settings, tmp_path, capfd,
                                                                              monkeypatch):
    """Not only where the run needs the family (--tiny, experts_implementation): a whole model folder that every
    check of the folder lets through."""
    folder = qwen_weights_folder(tmp_path)  # built before loading is forbidden
    monkeypatch.setattr(model, "load_tokenizer", lambda *_, **__: pytest.fail("a tokenizer loaded before the refusal"))
    case = ("a local model of no family",
            lambda t: ["--config", str(recipe), "--model_name_or_path", folder, *settings,
                       "--dataset_name", str(ROOT / "data" / "sample")],
            ["qwen-weights: `model_type: qwen2` (its config.json) is", LISTED, "finetune/families.py"])
    check_bad_input(case, tmp_path, capfd, monkeypatch)


def test_a_model_whose_config_json_says_llama_is_a_llama_whatever_its_name(tmp_path):
    folder = tmp_path / "SmolLM2-135M"
    shutil.copytree(tiny.tiny_model_folder("llama"), folder)
    values = json.loads((folder / "config.json").read_text())
    config_folder(folder, {**values, "_name_or_path": "HuggingFaceTB/SmolLM2-135M"})
    run = parse_args(["--config", str(LORA), "--model_name_or_path", str(folder), "--dataset_name",
                      str(ROOT / "data" / "sample"), "--output_dir", str(tmp_path / "out")])
    recipe_checks.check(run)
    assert model_folder.resolve_model_path(run) == str(folder)
    assert model_folder.family_of_run(run).name == "llama"


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen2-0.5B", "HuggingFaceTB/SmolLM2-1.7B-Instruct"])
def test_tiny_stands_the_tiny_llama_in_for_a_hub_model_whose_type_cannot_be_read(hub_id, tmp_path, capsys):
    """Offline (tests/conftest.py) and not in the hub cache, the hub model's config.json cannot be read: --tiny, which
    replaces the model whole, trains the default run's tiny Llama instead of refusing, and says so."""
    run = parse_args(["--config", str(FULL), "--tiny", "--model_name_or_path", hub_id,
                      "--output_dir", str(tmp_path / "out")])
    recipe_checks.check(run)
    assert model_folder.resolve_model_path(run) == str(tiny.tiny_model_folder("llama"))
    assert f"nor the name of {hub_id} tells its model type, so the tiny llama model stands in" in capsys.readouterr().out
