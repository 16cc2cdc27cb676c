"""Recipes users bring from alignment-handbook and TRL (real files in tests/data/external/recipes, README there): each
runs with every value it sets, under the names TRL 1.x and transformers 5 give them, or is refused before loading in
one sentence that lists every key to fix; `--tiny` swaps in the bundled sample for the data they name and says what
it replaced."""

import json
import re

import pytest
import yaml

from finetune.checks import recipe as recipe_checks
from finetune.config.files import refuse_unknown_keys
from finetune.config.schema import run_fields
from finetune.errors import UserError
from finetune.models import cpu
from finetune.run import arguments as run_arguments
from tests.helpers import ROOT, write
from tests.test_bad_inputs import FULL, TINY, check_bad_input, recipe, with_keys

EXTERNAL = ROOT / "tests" / "data" / "external" / "recipes"
HANDBOOK = EXTERNAL / "alignment-handbook"
TRL = EXTERNAL / "trl"
ZEPHYR = HANDBOOK / "zephyr-7b-beta" / "sft" / "config_full.yaml"
SAMPLE = str(run_arguments.SAMPLE_DATA)

RUNNABLE = [*sorted(HANDBOOK.rglob("*.yaml")), TRL / "examples" / "cli_configs" / "example_config.yaml",
            TRL / "docs" / "source" / "clis" / "sft_config_datasets.yaml"]
# The keys these recipes spell as older TRL and transformers did, and their names now
OLD_NAMES = {"torch_dtype": "dtype", "max_seq_length": "max_length", "warmup_ratio": "warmup_steps"}


def name(value) -> str:
    if callable(value):
        return value.__name__
    return str(value.relative_to(EXTERNAL)) if hasattr(value, "relative_to") else str(value)


@pytest.fixture
def installed_integrations(monkeypatch):
    """Which of transformers' reporting integrations count as installed, whatever this machine has."""
    import transformers.integrations

    def installed(names):
        monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: list(names))
    return installed


def run_value(run, key: str):
    for arguments in (run.finetune, run.training, run.model, run.script):
        if hasattr(arguments, key):
            value = getattr(arguments, key)
            return getattr(value, "value", value)  # an enum (eval_strategy, lr_scheduler_type...) as written
    raise AssertionError(f"`{key}` reached none of the run's arguments")


@pytest.mark.parametrize("recipe_file", RUNNABLE, ids=name)
def test_every_value_of_an_external_recipe_reaches_the_run_under_its_current_name(recipe_file, tmp_path, capsys):
    written = yaml.safe_load(recipe_file.read_text())
    run = run_arguments.parse_args(["--config", str(recipe_file), "--output_dir", str(tmp_path / "out")])
    printed = capsys.readouterr()
    expected = {OLD_NAMES.get(key, key): value for key, value in written.items() if key != "output_dir"}
    if expected.pop("overwrite_output_dir", None) is not None:
        assert "left out `overwrite_output_dir` (gone from transformers 5" in printed.out
    if expected.get("packing_strategy") == "ffd":  # TRL's name for the same best-fit-decreasing packing until 0.20
        expected["packing_strategy"] = "bfd"
    if expected.get("dataset_kwargs") == {"add_special_tokens": False, "append_concat_token": False}:
        expected["dataset_kwargs"] = None  # what TRL 1.x does with conversations anyway
        assert "left out `dataset_kwargs` add_special_tokens: false, append_concat_token: false" in printed.out
    if "datasets" in expected:
        expected["dataset_mixture"] = {"datasets": expected.pop("datasets")}
        assert "read TRL's `datasets` as `dataset_mixture`" in printed.out
    for key in cpu.cpu_overrides(expected):  # float32 and portable kernels on this CPU
        expected.pop(key, None)
    for key, value in expected.items():
        if key == "report_to":
            value = [] if value == "none" else [value] if isinstance(value, str) else value
        assert run_value(run, key) == value, key
    renamed = [f"`{old}` as `{new}`" for old, new in OLD_NAMES.items() if old in written]
    if renamed:
        assert f"read {', '.join(renamed)}" in printed.err


def test_the_planner_reads_a_renamed_key_with_its_value():
    from finetune.config.files import read_recipe

    values = read_recipe(ZEPHYR, {"max_seq_length": 512})
    assert values["max_length"] == 512 and values["dtype"] == "bfloat16" and values["warmup_steps"] == 0.1
    assert not {"max_seq_length", "torch_dtype", "warmup_ratio"} & set(values)


def no_dataset(tmp):
    return write(tmp / "recipe.yaml", "model_name_or_path: Qwen/Qwen2.5-0.5B\n")


TINY_SWAPS = [
    (HANDBOOK / "smollm2" / "sft" / "config.yaml", "dataset_name HuggingFaceTB/smoltalk (config all)"),
    (ZEPHYR, "dataset_mixture (HuggingFaceH4/ultrachat_200k)"),
    (HANDBOOK / "smollm3" / "sft" / "sft.yaml", "dataset_mixture (HuggingFaceTB/smoltalk2)"),
    (TRL / "docs" / "source" / "clis" / "sft_config_datasets.yaml",
     "dataset_mixture (stanfordnlp/imdb, roneneldan/TinyStories)"),
    (no_dataset, "no dataset_name"),
]


@pytest.mark.parametrize("recipe_file, replaced", TINY_SWAPS, ids=lambda value: name(value)[:40])
def test_tiny_trains_the_bundled_sample_instead_of_a_recipes_hub_data_and_says_what_it_replaced(
        recipe_file, replaced, tmp_path, capsys, installed_integrations):
    installed_integrations(recipe_checks.REPORTING_PACKAGES)
    recipe_file = recipe_file(tmp_path) if callable(recipe_file) else recipe_file
    written = yaml.safe_load(recipe_file.read_text())
    run = run_arguments.parse_args(["--config", str(recipe_file), "--tiny", "--output_dir", str(tmp_path / "out")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[finetune] --tiny replaced ")]
    assert len(lines) == 1, lines
    assert f"{replaced} with the bundled {SAMPLE}" in lines[0]
    script = run.script
    assert (script.dataset_name, script.dataset_config, run.finetune.dataset_mixture) == (SAMPLE, None, None)
    assert (script.dataset_train_split, script.dataset_test_split) == ("train", "test")
    assert not run.training.push_to_hub and run.training.eos_token is None and run.training.dataset_num_proc is None
    if written.get("push_to_hub"):  # a tiny random model never goes to the recipe's hub repository
        assert "push_to_hub true with false" in lines[0]
    if written.get("eos_token"):  # a token of the real model's vocabulary, which the tiny tokenizer lacks
        assert f"eos_token {written['eos_token']} with the tiny tokenizer's" in lines[0]
    recipe_checks.check(run)  # HF_HUB_OFFLINE=1: nothing left needs the network


def test_tiny_keeps_local_data_and_the_data_the_command_line_names(tmp_path, capsys):
    rows = ROOT / "data" / "sample" / "train.jsonl"
    local = write(tmp_path / "local.yaml", f"model_name_or_path: Qwen/Qwen2.5-0.5B\ndataset_name: {rows}\n")
    run = run_arguments.parse_args(["--config", str(local), "--tiny", "--output_dir", str(tmp_path / "a")])
    assert run.script.dataset_name == str(rows)
    mixture = {"datasets": [{"path": str(rows)}, {"path": str(ROOT / "data" / "sample" / "test.jsonl")}]}
    mixed = write(tmp_path / "mixed.yaml", yaml.safe_dump({"model_name_or_path": "x/y", "dataset_mixture": mixture}))
    run = run_arguments.parse_args(["--config", str(mixed), "--tiny", "--output_dir", str(tmp_path / "b")])
    assert run.finetune.dataset_mixture == mixture
    run = run_arguments.parse_args(["--config", str(ZEPHYR), "--tiny", "--dataset_name", str(rows), "--output_dir",
                             str(tmp_path / "c")])
    assert (run.script.dataset_name, run.finetune.dataset_mixture) == (str(rows), None)
    smoltalk = HANDBOOK / "smollm2" / "sft" / "config.yaml"  # `dataset_config: all`, a config of its hub dataset
    run = run_arguments.parse_args(["--config", str(smoltalk), "--dataset_name", SAMPLE, "--output_dir", str(tmp_path / "d")])
    assert (run.script.dataset_name, run.script.dataset_config) == (SAMPLE, None)
    assert "with the bundled" not in capsys.readouterr().out


REFUSALS = [
    ("alignment-handbook recipe of 2024: its old mixer keys",
     lambda t: ["--config", str(EXTERNAL / "alignment-handbook-2024" / "zephyr-7b-beta" / "sft" / "config_full.yaml"),
                "--tiny"],
     ["config_full.yaml", "unknown keys `dataset_mixer` (alignment-handbook's old mixer: write `dataset_mixture:",
      "`dataset_splits` (give each `dataset_mixture` entry its `split`)"]),
    ("TRL CLI recipe with num_processes",
     lambda t: ["--config", str(TRL / "docs" / "source" / "clis" / "sft_config_num_processes.yaml"), "--tiny"],
     ["sft_config_num_processes.yaml", "unknown key `num_processes`", "`--num_processes N` to `finetune launch`"]),
    ("TRL CLI recipe with accelerate_config",
     lambda t: ["--config", str(TRL / "docs" / "source" / "clis" / "sft_config_accelerate_config.yaml"), "--tiny"],
     ["sft_config_accelerate_config.yaml", "unknown key `accelerate_config`", "as `--config_file`"]),
    ("alignment-handbook recipe reporting to wandb, not installed", lambda t: ["--config", str(ZEPHYR), "--tiny"],
     ["config_full.yaml", "`report_to` names wandb, whose package is not installed", "`pip install wandb`",
      "`report_to: none`"]),
    ("alignment-handbook recipe reporting to tensorboard and wandb, neither installed",
     lambda t: ["--config", str(HANDBOOK / "smollm2" / "sft" / "config.yaml"), "--tiny"],
     ["`report_to` names tensorboard and wandb", "`pip install tensorboard wandb`", "remove them"]),
    ("alignment-handbook recipe pushing to the hub offline",
     lambda t: ["--config", str(HANDBOOK / "zephyr-7b-beta" / "sft" / "config_qlora.yaml"), "--report_to", "none"],
     ["config_qlora.yaml", "`push_to_hub: true`", "HF_HUB_OFFLINE is set", "`push_to_hub: false`"]),
    ("report_to an integration transformers does not know", lambda t: [*TINY, "--report_to", "wandbb"],
     ["`report_to: wandbb`", "did you mean `wandb`?"]),
    ("unknown keys of three kinds at once",
     lambda t: ["--tiny", *recipe(t, with_keys(FULL, "use_flash_attention_2: true\nlerning_rate: 0.1\n"
                                                     "num_of_sequences: 1024"))],
     ["recipe.yaml: unknown keys `use_flash_attention_2` (use `attn_implementation: flash_attention_2`)",
      "`lerning_rate` (did you mean `learning_rate`?)", "`num_of_sequences` (gone from TRL 0.18"]),
    ("old and current name of one key", lambda t: ["--tiny", *recipe(t, with_keys(FULL, "max_seq_length: 512"))],
     ["`max_seq_length: 512` and `max_length: 2048` are both set", "old name of `max_length`", "keep one"]),
    ("warmup_ratio of the whole run",
     lambda t: ["--tiny", *recipe(t, FULL.read_text().replace("warmup_steps: 0.03", "warmup_ratio: 1.0"))],
     ["`warmup_ratio: 1.0` warms up for the whole run", "give `warmup_steps` the number of steps"]),
    ("dataset_kwargs TRL does not read",
     lambda t: ["--tiny", *recipe(t, with_keys(FULL, "dataset_kwargs:\n  add_special_tokens: true"))],
     ["unknown key `dataset_kwargs.add_special_tokens`", "only `skip_prepare_dataset`"]),
    ("chat_template and chat_template_path",
     lambda t: ["--tiny", *recipe(t, with_keys(FULL, "chat_template: '{{ messages }}'\nchat_template_path: t.jinja"))],
     ["`chat_template` and `chat_template_path` both set", "keep one"]),
    ("chat_template without generation markers, assistant_only_loss on",
     lambda t: ["--tiny", *recipe(t, with_keys(FULL, "chat_template: '{% for m in messages %}{{ m.content }}"
                                                     "{% endfor %}'"))],
     ["`assistant_only_loss: true` needs {% generation %} markers", "`chat_template`", "assistant_only_loss: false"]),
    ("old name on the command line", lambda t: [*TINY, "--max_seq_length", "512"],
     ["unknown flag --max_seq_length (now --max_length)"]),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[case[0] for case in REFUSALS])
def test_an_external_recipe_that_cannot_run_is_refused_in_one_sentence(case, tmp_path, capfd, monkeypatch,
                                                                       installed_integrations):
    installed_integrations([])
    check_bad_input(case, tmp_path, capfd, monkeypatch)


def offered(key: str, known: set[str]) -> str | None:
    """The key the refusal of `key` offers in its place, if any."""
    with pytest.raises(UserError) as refused:
        refuse_unknown_keys({key: 1}, known, "recipe.yaml")
    found = re.search(r"did you mean `(\w+)`\?", str(refused.value))
    return found and found.group(1)


def slipped(key: str) -> str:
    """`key` with one letter of its longest word left out, neither its first letter nor a digit: a typing slip."""
    words = key.split("_")
    longest = max(range(len(words)), key=lambda index: len(words[index]))
    word = words[longest]
    at = max(index for index, character in enumerate(word) if character.isalpha() and index > 0)
    words[longest] = word[:at] + word[at + 1:]
    return "_".join(words)


@pytest.mark.parametrize("typed, meant", [
    ("lerning_rate", "learning_rate"), ("lora_rr", "lora_r"), ("max_lenght", "max_length"),
    ("num_train_epoch", "num_train_epochs"), ("max-length", "max_length"), ("Learning_Rate", "learning_rate"),
    ("per_device_train_batchsize", "per_device_train_batch_size"),
    # names of other tools and other settings, each once offered a key of a different meaning by nearness of letters
    ("lora_rank", None),  # LLaMA-Factory's rank: not `local_rank`, the process's rank
    ("template", None),  # LLaMA-Factory's template name: not `chat_template`, Jinja text
    ("use_lora", None),  # not `use_rslora`
    ("load_in_2bit", None),  # not `load_in_8bit`
    ("lora_a", None),  # not `lora_r`
])
def test_a_close_name_is_offered_only_as_another_spelling_of_the_same_words(typed, meant):
    assert offered(typed, run_fields()) == meant


def test_no_key_of_the_run_is_offered_for_another_and_each_is_offered_for_a_slip_of_its_own():
    """Over every key a recipe may set: were one of them unknown (a recipe written for another version), no other key
    is offered in its place, as `bf16` once was for `fp16` and `save_strategy` for `eval_strategy`; and one letter
    dropped from any of them still offers it."""
    known = run_fields()
    assert {key: offered(key, known - {key}) for key in known if offered(key, known - {key})} == {}
    assert {key: offered(slipped(key), known) for key in known if offered(slipped(key), known) != key} == {}


def test_push_to_hub_without_a_token_is_refused_before_loading(tmp_path, capfd, monkeypatch, installed_integrations):
    import huggingface_hub

    installed_integrations([])
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    check_bad_input(("push without a token", lambda t: [*TINY, "--push_to_hub", "true"],
                     ["`push_to_hub: true` needs a Hugging Face token", "`hf auth login`", "`push_to_hub: false`"]),
                    tmp_path, capfd, monkeypatch)


def test_an_alignment_handbook_recipe_trains_on_tiny_with_its_own_chat_template(tmp_path):
    """The one real launch: the zephyr recipe as published, its mixture swapped for the sample, its inline chat
    template rendering the rows and saved with the tokenizer."""
    from transformers import AutoTokenizer

    import finetune

    output_dir = tmp_path / "out"
    finetune.train(config=ZEPHYR, tiny=True, output_dir=str(output_dir), report_to="none", max_steps=2,
                   eval_strategy="no", save_strategy="no", eval_samples_before_after=0)
    template = yaml.safe_load(ZEPHYR.read_text())["chat_template"]
    assert AutoTokenizer.from_pretrained(output_dir).chat_template == template
    trained_on = json.loads((output_dir / "finetune_data.json").read_text())["train"]
    assert list(trained_on) == [f"{SAMPLE} [train]"]
