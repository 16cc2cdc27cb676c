"""Recipes written for LLaMA-Factory (github.com/hiyouga/LLaMA-Factory), read in TRL's and finetune's names.

A LLaMA-Factory recipe holds transformers' TrainingArguments beside keys of its own. Those that set what a key of TRL
or finetune sets are read under that name, with LLaMA-Factory's defaults where TRL's differ: its method is LoRA unless
the recipe says otherwise, of rank 8, alpha twice the rank, no dropout, on every linear layer; rows are cut at 2048
tokens and only the answers are trained. Keys that change nothing trained are left out. The others stay in the recipe,
to be refused with what to write instead (HINTS), all in one sentence. The meanings and defaults are those of
src/llamafactory/hparams/finetuning_args.py and data_args.py there. Plain dicts only: the planner reads recipes through
here too.
"""

from pathlib import Path

import yaml

# Keys no other recipe writes: one of them makes the recipe LLaMA-Factory's, so that its defaults stand. Its `dataset`
# and `template` are read in such a recipe only: in any other they may be anyone's slip, and are refused.
OWN_KEYS = {"stage", "finetuning_type", "lora_rank", "lora_target", "cutoff_len", "train_on_prompt", "max_samples",
            "val_size", "overwrite_cache", "plot_loss", "quantization_bit"}


# LLaMA-Factory reads these for LoRA only, and leaves them unread when it trains every weight
LORA_KEYS = ("lora_rank", "lora_target", "lora_alpha", "lora_dropout")


# Left out, as nothing trained changes: its cache of tokenized rows and its plot of the loss (finetune draws loss.png)
LEFT_OUT = ("overwrite_cache", "plot_loss")


# Its keys with no setting here, and what to write instead. `finetuning_type`, `stage` and `dataset` stay in a recipe
# to be refused only with a value that cannot be read (freeze tuning, DPO, a dataset_info.json name).
HINTS = {
    "finetuning_type": "LLaMA-Factory's freeze and OFT tuning have no equivalent here: write `finetuning_type: lora` "
                       "or `finetuning_type: full`",
    "stage": "finetune trains SFT only, LLaMA-Factory's `stage: sft`: train the other stages with LLaMA-Factory",
    "dataset": "LLaMA-Factory's name for datasets listed in its dataset_info.json: set `dataset_name` to a hub id or "
               "a local file instead",
    "max_samples": "LLaMA-Factory's cap on the rows of each dataset: save the rows to train on to a file and give it "
                   "as `dataset_name`",
    "val_size": "LLaMA-Factory's share of rows held out for evaluation: give it as `test_split_size` of a "
                "`dataset_mixture` of the data",
    "quantization_bit": "write `load_in_4bit: true` for 4 bits, `load_in_8bit: true` for 8",
}


# TRL cuts a row's end, where LLaMA-Factory shortens prompt and answer in proportion
CUTOFF_CAVEAT = "longer rows lose their end, where LLaMA-Factory shortens prompt and answer in proportion"


def is_llama_factory_recipe(recipe: dict) -> bool:
    return bool(OWN_KEYS & set(recipe))


def read_llama_factory_recipe(recipe: dict) -> tuple[dict, list[str]]:
    """A LLaMA-Factory recipe in TRL's and finetune's names, and what was read how (for read_foreign_keys' one line);
    any other recipe as it is. A key the recipe (or, in the planner, the command line) sets under finetune's name wins
    over LLaMA-Factory's, as a flag wins in the run."""
    if not is_llama_factory_recipe(recipe):
        return recipe, []
    values = dict(recipe)
    read, defaulted, left_out = [], [], []

    def give(key: str, value, source: str, caveat: str = "") -> None:
        """finetune's `key` for LLaMA-Factory's `source`, said as read when the recipe sets it, else as its default."""
        if key in values:
            return
        values[key] = value
        setting = f"`{key}: {_written(value)}`"
        if source.split(":")[0] in recipe:
            read.append(f"`{source}` as {setting}" + (f" ({caveat})" if caveat else ""))
        else:
            why = [f"`{source}`"] * (source != key) + [caveat] * bool(caveat)
            defaulted.append(setting + (f" ({'; '.join(why)})" if why else ""))

    method = values.get("finetuning_type", "lora")
    if method in ("lora", "full"):  # freeze and OFT stay, to be refused with their hint
        values.pop("finetuning_type", None)
        give("use_peft", method == "lora", f"finetuning_type: {method}")
    if values.get("use_peft") is True:
        give("lora_r", _as_int(values.pop("lora_rank", 8)), "lora_rank")
        if isinstance(values["lora_r"], int):  # a value of another type is refused as `lora_r`'s
            give("lora_alpha", 2 * values["lora_r"], "lora_alpha", "twice the rank")
        give("lora_dropout", 0.0, "lora_dropout")
        target = values.pop("lora_target", "all")
        give("lora_target_modules", _lora_targets(target), f"lora_target: {target}")
    else:
        left_out += [f"`{key}` (read for LoRA only)" for key in LORA_KEYS if values.pop(key, None) is not None]
    give("max_length", values.pop("cutoff_len", 2048), "cutoff_len", CUTOFF_CAVEAT)
    train_on_prompt = _as_bool(values.pop("train_on_prompt", False))
    give("assistant_only_loss", not train_on_prompt if isinstance(train_on_prompt, bool) else train_on_prompt,
         f"train_on_prompt: {_written(train_on_prompt)}")
    if values.get("stage") == "sft":
        left_out.append(f"`stage: {values.pop('stage')}`")
    if "template" in values:
        left_out.append(f"`template: {values.pop('template')}` (the rows are rendered with the model's own chat "
                        f"template, which is saved with the trained model)")
    dataset = values.get("dataset")
    if isinstance(dataset, str) and Path(dataset).expanduser().exists():
        give("dataset_name", values.pop("dataset"), "dataset")
    left_out += [f"`{key}`" for key in LEFT_OUT if values.pop(key, None) is not None]
    notes = [f"read LLaMA-Factory's {', '.join(read)}"] if read else []
    if defaulted:
        notes.append(f"LLaMA-Factory's defaults for what it leaves out: {', '.join(defaulted)}")
    if left_out:
        notes.append(f"left out LLaMA-Factory's {', '.join(left_out)}")
    return values, notes


def _lora_targets(target) -> str | list[str]:
    """LLaMA-Factory's module names, comma-separated or a YAML list (its `split_arg` leaves a list as it is), or
    `all`: every linear layer but the output layer, as PEFT's `all-linear`."""
    names = [str(name).strip() for name in target] if isinstance(target, list) else \
        [name.strip() for name in str(target).split(",")]
    return "all-linear" if names == ["all"] else names


# LLaMA-Factory reads its YAML values into its dataclasses, and a quoted one from its command line through transformers'
# HfArgumentParser, whose `string_to_bool` reads these words (any other is refused there, and here as the key it is
# read as)
TRUE_WORDS, FALSE_WORDS = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")


def _as_bool(value):
    """A boolean written as a word (`"false"`) read as the word says, as HfArgumentParser reads it; else as it is."""
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    return value


def _as_int(value):
    """A whole number written as text (`"16"`) read as the number, so that the rank its alpha doubles is a number."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _written(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True).splitlines()[0]
