"""Recipes users bring from axolotl (real files in tests/data/external/recipes/axolotl*, README there): each key that
means a setting here reaches the run, and the planner, under that name with its value, axolotl's defaults standing
where TRL's differ; what cannot be honoured is refused before loading in one sentence that lists every such key with
what to write instead; `--tiny` trains one on the bundled sample."""

import json
import math
from pathlib import Path

import pytest
import yaml

from finetune.config.axolotl import read_axolotl_recipe
from finetune.config.files import read_recipe
from finetune.data import load as data
from finetune.models import cpu
from finetune.planner.setup import recipe_with_flags, setup_from_recipe
from finetune.run import arguments
from tests.helpers import write
from tests.test_bad_inputs import check_bad_input, with_keys
from tests.test_external_recipes import EXTERNAL, SAMPLE, name, run_value

AXOLOTL = EXTERNAL / "axolotl" / "examples"
LORA_1B = AXOLOTL / "llama-3" / "lora-1b.yml"
LIGER_FSDP = AXOLOTL / "llama-3" / "fft-8b-liger-fsdp.yaml"
GPT_OSS_LORA = AXOLOTL / "gpt-oss" / "gpt-oss-20b-sft-lora-singlegpu.yaml"
LORA_8B = AXOLOTL / "llama-3" / "lora-8b.yml"
FFT_1B_FSDP = EXTERNAL / "axolotl-1947fix" / "examples" / "llama-3" / "fft-1b-fsdp.yml"
RUNNABLE = [LORA_1B, AXOLOTL / "llama-3" / "qlora-1b.yml", AXOLOTL / "llama-3" / "fft-8b.yaml", GPT_OSS_LORA, LORA_8B,
            EXTERNAL / "axolotl-2025" / "examples" / "llama-3" / "lora-1b.yml"]


def expected_settings(written: dict) -> dict:
    """What an axolotl recipe sets, in finetune's names, by axolotl's own rules (src/axolotl/utils/config/)."""
    epochs = written.get("num_epochs", 1)
    lora = written.get("adapter") in ("lora", "qlora")
    expected = {
        "model_name_or_path": written["base_model"], "max_length": written["sequence_len"],
        "packing": written["sample_packing"], "per_device_train_batch_size": written["micro_batch_size"],
        "gradient_accumulation_steps": written["gradient_accumulation_steps"], "num_train_epochs": epochs,
        "optim": written["optimizer"], "lr_scheduler_type": written["lr_scheduler"],
        "learning_rate": float(written["learning_rate"]), "warmup_steps": written["warmup_ratio"],
        "use_peft": lora, "load_in_4bit": written.get("adapter") == "qlora", "assistant_only_loss": True,
        "save_total_limit": 4, "output_dir": written["output_dir"],
        "dataset_mixture": {
            "datasets": [{"path": written["datasets"][0]["path"], "split": "train", "test_split": None}],
            **({"test_split_size": written["val_set_size"]} if written["val_set_size"] else {})},
    }
    if lora:
        expected |= {key: written[key] for key in ("lora_r", "lora_alpha", "lora_dropout")}
        expected["lora_target_modules"] = "all-linear" if written.get("lora_target_linear") \
            else written["lora_target_modules"]
    save_share = 1 / (written["saves_per_epoch"] * epochs)
    expected |= {"save_strategy": "steps", "save_steps": save_share} if save_share < 1 else {"save_strategy": "epoch"}
    if written["val_set_size"]:
        expected |= {"eval_strategy": "steps", "eval_steps": 1 / (written["evals_per_epoch"] * epochs)}
    else:
        expected["eval_strategy"] = "no"
    return expected


@pytest.mark.parametrize("recipe_file", RUNNABLE, ids=name)
def test_every_axolotl_key_with_a_meaning_here_reaches_the_run_under_that_name(recipe_file, capsys):
    written = yaml.safe_load(recipe_file.read_text())
    run = arguments.parse_args(["--config", str(recipe_file)])
    printed = capsys.readouterr().out
    expected = expected_settings(written)
    for key in cpu.cpu_overrides(expected):  # float32 and portable kernels on this CPU
        expected.pop(key, None)
    for key, value in expected.items():
        assert run_value(run, key) == value, key
    assert (f"read axolotl's `base_model` as `model_name_or_path: {written['base_model']}`, `sequence_len` as "
            f"`max_length: {written['sequence_len']}`") in printed
    assert f"{sum(value is None for value in written.values())} empty keys (nothing trained changes" in printed


@pytest.mark.parametrize("recipe_file", RUNNABLE, ids=name)
def test_the_planner_reads_an_axolotl_recipe_as_the_run_does_with_the_command_line_winning(recipe_file):
    written = yaml.safe_load(recipe_file.read_text())
    values = recipe_with_flags(str(recipe_file), [])
    setup = setup_from_recipe(values, str(recipe_file))
    method = {"lora": "lora", "qlora": "qlora"}.get(written.get("adapter"), "full")
    assert (setup.model, setup.method, setup.max_length) == (written["base_model"], method, written["sequence_len"])
    assert (setup.dtype, setup.bf16) == ("bfloat16", True)  # axolotl loads the weights in the precision it trains in
    assert recipe_with_flags(str(recipe_file), ["--max_length", "128"])["max_length"] == 128


def test_recipes_of_other_projects_are_not_read_as_axolotl_recipes():
    for recipe_file in [*EXTERNAL.glob("alignment-handbook*/**/*.yaml"), *EXTERNAL.glob("trl/**/*.yaml")]:
        recipe = read_recipe(recipe_file)
        assert read_axolotl_recipe(recipe, str(recipe_file)) == (recipe, []), recipe_file


def test_axolotl_conversation_and_alpaca_rows_load_as_messages_with_its_validation_share(tmp_path, capsys):
    """`chat_template` rows under another column with ShareGPT's turn keys, and alpaca rows, mixed; `val_set_size`
    takes its share of each for evaluation, as axolotl's split of the merged rows does."""
    dialogs = [{"dialog": [{"from": "human", "value": f"hi {n}"}, {"from": "gpt", "value": f"hello {n}"}]}
               for n in range(8)]
    alpaca = [{"instruction": f"Count to {n}", "input": "", "output": " ".join(map(str, range(1, n + 1)))}
              for n in range(1, 9)]
    for file, rows in (("dialogs.jsonl", dialogs), ("alpaca.jsonl", alpaca)):
        write(tmp_path / file, "".join(json.dumps(row) + "\n" for row in rows))
    sharegpt_turns = {"role": "from", "content": "value"}
    recipe = {"base_model": "meta-llama/Llama-3.2-1B-Instruct", "val_set_size": 0.25, "evals_per_epoch": 2,
              "datasets": [{"path": str(tmp_path / "dialogs.jsonl"), "type": "chat_template",
                            "field_messages": "dialog", "message_property_mappings": sharegpt_turns},
                           {"path": str(tmp_path / "alpaca.jsonl"), "type": "alpaca"}]}
    run = arguments.parse_args(["--config", str(write(tmp_path / "axolotl.yaml", yaml.safe_dump(recipe))),
                             "--output_dir", str(tmp_path / "out")])
    assert run.finetune.dataset_mixture["datasets"][0]["columns"] == {"dialog": "conversations"}
    assert (run.training.max_length, run.training.per_device_train_batch_size) == (512, 1)  # axolotl's defaults
    train, test = data.load_datasets(run.script, run.training, sources=run.finetune)
    assert (len(train), len(test)) == (2 * (8 - math.ceil(0.25 * 8)), 2 * math.ceil(0.25 * 8))
    assert {tuple(turn["role"] for turn in row["messages"]) for row in train} == {("user", "assistant")}
    defaults = capsys.readouterr().out.split("axolotl's defaults for what it leaves out: ")[1].split(";")[0]
    assert "`max_length: 512`" in defaults and "`per_device_train_batch_size: 1`" in defaults


def test_an_axolotl_recipe_changed_as_its_refusal_says_is_read(tmp_path):
    fixed = LIGER_FSDP.read_text().replace("chat_template: llama3", "chat_template: tokenizer_default").replace(
        "split: train[:20%]", "split: train")
    fixed = fixed[:fixed.index("fsdp:")] + fixed[fixed.index("special_tokens:"):]
    run = arguments.parse_args(["--config", str(write(tmp_path / "fixed.yaml", fixed)), "--output_dir", str(tmp_path)])
    source = run.finetune.dataset_mixture["datasets"][0]
    assert (source["path"], source["split"], source.get("columns")) == ("mlabonne/FineTome-100k", "train", None)
    assert run.training.eos_token == "<|eot_id|>" and run.training.eval_steps == 0.5
    assert run.model.dtype == "float32" and not run.training.use_liger_kernel  # the LigerPlugin's, replaced on CPU
    assert recipe_with_flags(str(tmp_path / "fixed.yaml"), [])["use_liger_kernel"] is True


def changed(base, extra: str, replaced: dict[str, str] | None = None):
    def build(tmp_path):
        text = base.read_text()
        for old, new in (replaced or {}).items():
            text = text.replace(old, new)
        return ["--config", str(write(tmp_path / base.name, with_keys(write(tmp_path / "base.yml", text), extra))),
                "--tiny"]
    return build


REFUSALS = [
    ("a template axolotl ships", lambda t: ["--config", str(AXOLOTL / "llama-3" / "instruct-lora-8b.yml"), "--tiny"],
     ["instruct-lora-8b.yml: this axolotl recipe sets what finetune cannot honour: `chat_template: llama3` (",
      "write `chat_template: tokenizer_default` to train with the model's own", "as `chat_template_jinja`)"]),
    ("a DeepSpeed JSON of axolotl's",
     lambda t: ["--config", str(AXOLOTL / "gpt-oss" / "gpt-oss-20b-fft-deepspeed-zero3.yaml"), "--tiny"],
     ["gpt-oss-20b-fft-deepspeed-zero3.yaml: this axolotl recipe", "`deepspeed` (name that JSON as",
      "`deepspeed_config_file` in an accelerate config file such as accelerate_configs/zero3.yaml"]),
    ("FSDP1 settings, a template and a sliced split, all at once", lambda t: ["--config", str(LIGER_FSDP), "--tiny"],
     ["fft-8b-liger-fsdp.yaml: this axolotl recipe", "`chat_template: llama3` (a template axolotl ships",
      "datasets entry 1 `split: train[:20%]` (finetune loads whole splits", "`fsdp`, `fsdp_config` (write FSDP2's",
      "accelerate config file such as accelerate_configs/fsdp.yaml"]),
    ("FSDP1 settings and a key of axolotl's alone", lambda t: ["--config", str(FFT_1B_FSDP), "--tiny"],
     ["fft-1b-fsdp.yml: this axolotl recipe", "`fsdp`, `fsdp_config` (write FSDP2's", "accelerate_configs/fsdp.yaml",
      "`save_safetensors` (no such setting here: remove it)"]),
    ("every kind of refusal with an unknown key, all at once",
     changed(LORA_1B, "xformers_attention: true\nunfrozen_parameters: ['^lm_head.*']\nlerning_rate: 0.1\n"
                      "gradient_checkpointing: offload", {"adapter: lora": "adapter: llama-adapter",
                                                          "type: alpaca": "type: oasst"}),
     ["`adapter: llama-adapter` (finetune trains LoRA", "`gradient_checkpointing: offload` (write",
      "`activation_offloading: true`)", "`xformers_attention: true` (write `attn_implementation: sdpa`",
      "datasets entry 1 `type: oasst` (finetune reads alpaca, chat_template, sharegpt and completion rows",
      "`unfrozen_parameters` (finetune trains every weight or LoRA adapters",
      "`lerning_rate` (no such setting here: remove it)"]),
    ("turns whose keys no reader here takes, or training other roles",
     changed(LORA_1B, "", {"type: alpaca": "type: chat_template\n    roles_to_train: [user, assistant]\n"
                                           "    message_property_mappings: {role: speaker, content: text}"}),
     ["datasets entry 1 `message_property_mappings` (finetune reads turns of role/content or from/value",
      "datasets entry 1 `roles_to_train` (finetune trains each assistant turn and its end-of-turn token"]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_what_an_axolotl_recipe_sets_and_cannot_be_honoured_is_refused_in_one_sentence(case, tmp_path, capfd,
                                                                                     monkeypatch):
    check_bad_input(case, tmp_path, capfd, monkeypatch)


def test_an_axolotl_recipe_trains_on_tiny_with_its_settings(tmp_path):
    """The one real launch: axolotl's Llama-3.2-1B LoRA recipe as published, its data swapped for the sample."""
    import finetune

    output_dir = tmp_path / "out"
    finetune.train(config=LORA_1B, tiny=True, output_dir=str(output_dir), max_steps=2, eval_strategy="no",
                   save_strategy="no", eval_samples_before_after=0)
    written = yaml.safe_load(LORA_1B.read_text())
    expected = expected_settings(written)
    settings = json.loads((output_dir / "finetune_run.json").read_text())["settings"]  # what the trainer was given
    for key in ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "packing", "per_device_train_batch_size",
                "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
                "assistant_only_loss", "num_train_epochs"):
        assert settings[key] == expected[key], key
    adapter = json.loads((output_dir / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_alpha"]) == (written["lora_r"], written["lora_alpha"])
    assert sorted(adapter["target_modules"]) == sorted(written["lora_target_modules"])
    trained_on = json.loads((output_dir / "finetune_data.json").read_text())["train"]
    assert list(trained_on) == [f"{SAMPLE} [train]"]


def test_an_8bit_recipe_training_whole_modules_scores_before_and_after_training_and_keeps_the_trained_weights(
        tmp_path):
    """axolotl's `lora-8b.yml`: `load_in_8bit` with `lora_modules_to_save: [embed_tokens, lm_head]`. TRL keeps those
    trained copies in bf16 on a float32 model (on CPU); the held-out scoring before and after training runs them in the
    model's dtype and leaves the trained bf16 weights as they were."""
    import finetune
    from safetensors.torch import load_file
    import torch

    output_dir = tmp_path / "out"
    finetune.train(config=LORA_8B, tiny=True, output_dir=str(output_dir), max_steps=1, eval_steps=10,
                   save_strategy="no", eval_samples_before_after=2)  # scored, with no evaluation between
    scores = json.loads((output_dir / "finetune_scores.json").read_text())
    assert (scores["before"]["rows"], scores["after"]["rows"]) == (2, 2)
    saved = load_file(output_dir / "adapter_model.safetensors")
    head = [tensor for key, tensor in saved.items() if "lm_head" in key]
    assert head and {tensor.dtype for tensor in head} == {torch.bfloat16}


def as_its_refusal_says(recipe_file: Path, tmp_path: Path) -> Path:
    """The recipe without the keys its refusal names: `fsdp`, `fsdp_config` (FSDP2 comes from the accelerate config
    file) and `save_safetensors`."""
    values = yaml.safe_load(recipe_file.read_text())
    for key in ("fsdp", "fsdp_config", "save_safetensors"):
        values.pop(key)
    return write(tmp_path / recipe_file.name, yaml.safe_dump(values))


@pytest.mark.parametrize("recipe, launch_file", [
    (lambda tmp_path: LORA_1B, "ddp.yaml"),
    (lambda tmp_path: as_its_refusal_says(FFT_1B_FSDP, tmp_path), "fsdp.yaml")], ids=["lora-1b.yml", "fft-1b-fsdp.yml"])
def test_bf16_auto_is_one_value_for_the_recipe_and_the_launch_files_precision(recipe, launch_file, tmp_path,
                                                                               monkeypatch):
    """axolotl's `bf16: auto` is read as true; the launch file's `mixed_precision: bf16` (ddp.yaml's and fsdp.yaml's)
    agrees with it on a machine without a GPU too, where the check reads the recipe as the run read it, not the YAML's
    text again. `fft-1b-fsdp.yml`, its FSDP1 keys removed as their refusal says, was told `bf16: false` contradicts
    fsdp.yaml one line after being told its `bf16: auto` was read as true."""
    from finetune.checks import launch as accelerate_checks
    from tests.test_external_configs import launched_by_accelerate
    from tests.helpers import ROOT

    launched_by_accelerate(monkeypatch, ROOT / "accelerate_configs" / launch_file)
    run = arguments.parse_args(["--config", str(recipe(tmp_path)), "--tiny", "--output_dir", str(tmp_path / "out")])
    assert accelerate_checks.asked_precision(run) == "bf16"
    accelerate_checks.check_run(run)
