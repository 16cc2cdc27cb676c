"""Reading the files a user writes or picks: recipes, accelerate config files and DeepSpeed JSON.

One reader for each, used by the training run, the planner and `finetune launch` alike. Every problem is a
`UserError` naming the file and the fix. Only yaml and json are imported here, so the planner and the launcher
answer without loading trl or torch.
"""

import difflib
import os
import sys
from pathlib import Path

import yaml

from finetune.config import llama_factory
from finetune.errors import UserError, say

# The files the project ships beside the library (recipes/, accelerate_configs/, ds_configs/, data/sample), reached
# through links inside the package so that a wheel (`pip install .` without -e) carries them too.
SHIPPED_DIR = Path(__file__).parent.parent / "shipped"


def shipped(relative: str) -> Path:
    """A shipped file by its path in the repository (`recipes/llama-3.2-1b/full.yaml`, `data/sample`)."""
    return (SHIPPED_DIR / relative).resolve()


def local_or_shipped(path: str) -> str:
    """The path as given when it exists from here, else the shipped file of that name (`recipes/...`,
    `accelerate_configs/...`): a wheel install runs the shipped recipes and config files from any folder."""
    if Path(path).is_absolute() or Path(path).exists():
        return path
    candidate = shipped(path)
    return str(candidate) if candidate.exists() else path


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys without a word; a recipe setting a key twice is refused instead."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in lines:
                raise _DuplicateKey(f"`{key}` is set twice (lines {lines[key]} and {key_node.start_mark.line + 1})")
            lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def read_yaml_mapping(file: str, kind: str, where_to_find: str) -> dict:
    """A flat YAML file (a recipe, an accelerate config), or a UserError naming the file and what to fix."""
    path = Path(file)
    if not path.is_file():
        raise UserError(f"{file}: {kind} file not found; {where_to_find}.")
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as error:
        raise UserError(f"{file}: not UTF-8 text (byte {error.start}); save the file as UTF-8.") from None
    except _DuplicateKey as error:
        raise UserError(f"{file}: {error}; keep one of them.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{file}: not valid YAML{where}; fix the syntax there.") from None
    if not isinstance(values, dict):
        raise UserError(f"{file}: this {kind} file must be a YAML mapping of `key: value` lines; rewrite it as one.")
    return values


def read_recipe(recipe_path: str | Path, overrides: dict | None = None) -> dict:
    """A recipe's keys (TRL's flags plus finetune's own, and an optional `env:` mapping), with `overrides` (from
    `parse_overrides`) on top, each old name of RENAMED_KEYS read as its current one (and said so)."""
    recipe = read_yaml_mapping(local_or_shipped(str(recipe_path)), "recipe", "pass --config with the path of a file under recipes/")
    if not isinstance(recipe.get("env") or {}, dict):
        raise UserError(f"{recipe_path}: `env` must be a mapping of VARIABLE: value lines; rewrite it as one.")
    recipe, renamed = with_current_names(recipe, str(recipe_path))
    overrides, renamed_flags = with_current_names(overrides or {}, "command line")
    if (renamed or renamed_flags) and os.environ.get("RANK", "0") == "0":
        # on stderr: `finetune plan --json` prints its plan on stdout
        say(f"{recipe_path}: read {', '.join(renamed + renamed_flags)} (TRL 1.x's and transformers 5's "
              f"names for the same settings)", stream=sys.stderr)
    return {**recipe, **overrides}


# Keys that alignment-handbook recipes and older TRL or transformers configs spell differently, for the same setting:
# refused as unknown, one deleted as told would train with the default instead (1024 tokens for `max_seq_length: 2048`).
RENAMED_KEYS = {
    "torch_dtype": "dtype",  # TRL 0.23 (ModelConfig), transformers 5
    "max_seq_length": "max_length",  # TRL 0.16, the old name gone in 0.20
    "use_liger": "use_liger_kernel",  # TRL 0.18
    "evaluation_strategy": "eval_strategy",  # transformers 4.46
    "warmup_ratio": "warmup_steps",  # transformers 5.2: a warmup_steps below 1 is that share of the steps
    "no_cuda": "use_cpu",  # transformers 5
    "per_gpu_train_batch_size": "per_device_train_batch_size",  # transformers 5
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",  # transformers 5
    "preprocessing_num_workers": "dataset_num_proc",  # alignment-handbook's recipes before its 2025 rewrite
}


# Values renamed for the same behaviour: TRL's "ffd" packing was best-fit decreasing all along (TRL 0.20, #3696)
RENAMED_VALUES = {"packing_strategy": {"ffd": "bfd"}}


def with_current_names(values: dict, source: str) -> tuple[dict, list[str]]:
    """`values` with each old name of RENAMED_KEYS (and old value of RENAMED_VALUES) replaced by its current one, in
    place, and what was read as what."""
    current, renamed = {}, []
    for key, value in values.items():
        new = RENAMED_KEYS.get(key)
        if new is None:
            current[key] = value
            continue
        if new in values and values[new] != value:
            raise UserError(f"{source}: `{key}: {value}` and `{new}: {values[new]}` are both set, and `{key}` is the "
                            f"old name of `{new}`; keep one of them.")
        if key == "warmup_ratio" and isinstance(value, (int, float)) and value >= 1:
            raise UserError(f"{source}: `warmup_ratio: {value}` warms up for the whole run, and `warmup_steps` (its "
                            f"name in transformers 5) reads a value of 1 or more as steps; give `warmup_steps` the "
                            f"number of steps instead.")
        current[new] = value
        renamed.append(f"`{key}` as `{new}`")
    for key, values_renamed in RENAMED_VALUES.items():
        value = current.get(key)
        if isinstance(value, str) and value in values_renamed:
            current[key] = values_renamed[value]
            renamed.append(f"`{key}: {value}` as `{current[key]}`")
    return current, renamed


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_overrides(argv: list[str]) -> dict:
    """`--max_length 4096 --gradient_checkpointing false --lora_target_modules q_proj v_proj` -> a dict, for the
    planner, which reads flags without TRL's parser."""
    out, key = {}, None
    for token in argv:
        if token.startswith("--"):
            key, _, inline = token[2:].partition("=")
            key = key.replace("-", "_")
            out[key] = _parse_value(inline) if inline else True
            if inline:
                key = None
        elif key is not None:
            previous = out[key]
            value = _parse_value(token)
            out[key] = value if previous is True else (list(previous) if isinstance(previous, list) else [previous]) + [value]
    return out


def blocked_folder(folder: Path) -> tuple[Path, str] | None:
    """Why `folder` cannot be created and written where it is, as (the nearest existing path, "file" or
    "unwritable"), or None when it can."""
    existing = next(path for path in (folder.absolute(), *folder.absolute().parents) if path.exists())
    if not existing.is_dir():
        return existing, "file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return existing, "unwritable"
    return None


# Keys of alignment-handbook and TRL recipes that transformers 5 and TRL 1.x no longer read, and why leaving them out
# changes nothing
DROPPED_KEYS = {
    "overwrite_output_dir": "gone from transformers 5: finetune resumes its own run in output_dir and refuses "
                            "another's",
    "dataset_batch_size": "gone from TRL 0.18, which said it can be removed",
}


# alignment-handbook's `dataset_kwargs`, which ask for what TRL 1.x does with conversations anyway: no special tokens
# added to a rendered chat, nothing added between packed rows
HANDBOOK_DATASET_KWARGS = ("add_special_tokens", "append_concat_token")  # both `false` there


# Keys of other tools' recipes with no setting of that name here, and what to write instead
FOREIGN_KEY_HINTS = {
    "use_flash_attention_2": "use `attn_implementation: flash_attention_2`",
    "dataset_mixer": "alignment-handbook's old mixer: write `dataset_mixture: {datasets: [{id: ..., split: ..., "
                     "weight: ...}]}`",
    "dataset_splits": "give each `dataset_mixture` entry its `split`",
    "num_of_sequences": "gone from TRL 0.18: `max_length` sets the packed length",
    "chars_per_token": "gone from TRL 0.18: `max_length` sets the packed length",
    "num_processes": "a launcher setting: pass `--num_processes N` to `finetune launch` or `accelerate launch`",
    "num_machines": "a launcher setting: pass `--num_machines N` to `finetune launch` or `accelerate launch`",
    "accelerate_config": "pass that file as `--config_file` to `finetune launch` or `accelerate launch`",
    "logging_dir": "transformers 5 reads TENSORBOARD_LOGGING_DIR: set it under `env:`",
    "datasets": "TRL's mixture list: move it under `dataset_mixture:`",
    "streaming": "finetune loads datasets whole: remove it",
    **llama_factory.HINTS,
}


def read_foreign_keys(recipe: dict, recipe_path: str, stream=None) -> dict:
    """alignment-handbook's and TRL's recipe keys that mean a setting of finetune's under another shape, in that
    shape; and those that transformers 5 and TRL 1.x no longer read, left out where that changes nothing. One line
    says what was read how. The other keys of those recipes are TRL's own (RENAMED_KEYS: read_recipe). An axolotl or
    LLaMA-Factory recipe is read in finetune's names first (finetune/config/axolotl.py, llama_factory.py)."""
    from finetune.config.axolotl import read_axolotl_recipe

    recipe, notes = read_axolotl_recipe(recipe, recipe_path)
    recipe, llama_factory_notes = llama_factory.read_llama_factory_recipe(recipe)
    notes += llama_factory_notes
    for key, why in DROPPED_KEYS.items():
        if key in recipe:
            del recipe[key]
            notes.append(f"left out `{key}` ({why})")
    kwargs = recipe["dataset_kwargs"] if isinstance(recipe.get("dataset_kwargs"), dict) else {}
    handbook_kwargs = [key for key in HANDBOOK_DATASET_KWARGS if kwargs.get(key) is False]
    if handbook_kwargs:
        recipe["dataset_kwargs"] = {key: value for key, value in kwargs.items() if key not in handbook_kwargs} or None
        notes.append(f"left out `dataset_kwargs` {', '.join(f'{key}: false' for key in handbook_kwargs)} (what "
                     f"TRL 1.x does with conversations anyway)")
    if isinstance(recipe.get("datasets"), list) and "dataset_mixture" not in recipe:
        # TRL's CLI mixes a top-level `datasets:` list (trl.scripts.utils.DatasetMixtureConfig)
        moved = ["datasets", "test_split_size"] if "test_split_size" in recipe else ["datasets"]
        recipe["dataset_mixture"] = {key: recipe.pop(key) for key in moved}
        if recipe.get("streaming") is False:  # TRL's default
            del recipe["streaming"]
        notes.append(f"read TRL's {' and '.join(f'`{key}`' for key in moved)} as `dataset_mixture`")
    if notes:
        say(f"{recipe_path}: {'; '.join(notes)}", stream=stream)
    return recipe


def _hint(key: str, known: set[str]) -> str:
    if key in FOREIGN_KEY_HINTS:
        return f" ({FOREIGN_KEY_HINTS[key]})"
    spellings = [name for name in known if _spelled_alike(key, name)]
    close = difflib.get_close_matches(key, spellings, n=1, cutoff=0)
    return f" (did you mean `{close[0]}`?)" if close else ""


# A name is offered for an unknown key only as another spelling of the same words: a slip changes a letter, a key of
# another meaning changes a word. Nearness of letters alone offered `local_rank` for LLaMA-Factory's `lora_rank`,
# `data_seed` for its `dataset`, `chat_template` (Jinja text) for its `template` (a name), and took dozens of the run's
# own keys for another of a different meaning (`fp16` and `bf16`, `eval_strategy` and `save_strategy`, `load_in_4bit`
# and `load_in_8bit`): any of them, written as told, runs with a setting the recipe never asked for.
def _spelled_alike(typed: str, name: str) -> bool:
    """The same letters with other separators or case (`max-length`, `batchsize`), or the same words in the same order,
    each at most one slip apart."""
    typed_words, words = _words(typed), _words(name)
    if "".join(typed_words) == "".join(words):
        return True
    return len(typed_words) == len(words) and all(map(_one_slip_apart, typed_words, words))


def _words(name: str) -> list[str]:
    return name.lower().replace("-", "_").split("_")


def _one_slip_apart(typed: str, word: str) -> bool:
    """`typed` is `word`, or `word` with one letter left out, added, changed or swapped with the next; never in the
    first letter nor in a number, where one character makes another word (`lora` and `dora`, `4bit` and `8bit`)."""
    if typed == word:
        return True
    if not typed or not word or typed[0] != word[0] or abs(len(typed) - len(word)) > 1:
        return False
    if _digits(typed) != _digits(word):
        return False
    at = next((i for i, (a, b) in enumerate(zip(typed, word)) if a != b), min(len(typed), len(word)))
    if len(typed) != len(word):
        return typed[at + 1:] == word[at:] or typed[at:] == word[at + 1:]
    swapped = typed[at:at + 2] == word[at:at + 2][::-1] and typed[at + 2:] == word[at + 2:]
    return typed[at + 1:] == word[at + 1:] or swapped


def _digits(word: str) -> str:
    return "".join(character for character in word if character.isdigit())


def refuse_unknown_keys(recipe: dict, known: set[str], recipe_path: str) -> None:
    """Every key not in `known` (the run's parser's keys, and `env`), in one sentence, each with the key it likely
    means: a recipe brought from another project costs one launch to fix, not one per key."""
    known = known | {"env"}
    unknown = [f"`{key}`{_hint(key, known)}" for key in recipe if key not in known]
    kwargs = recipe.get("dataset_kwargs")
    if isinstance(kwargs, dict):  # TRL leaves other keys unread without a word
        unknown += [f"`dataset_kwargs.{key}` (TRL 1.x reads only `skip_prepare_dataset` there)" for key in kwargs
                    if key != "skip_prepare_dataset"]
    if len(unknown) == 1:
        raise UserError(f"{recipe_path}: unknown key {unknown[0]}; remove it or fix its spelling (the keys are the "
                        f"flags of SFTConfig, ModelConfig, ScriptArguments and finetune's own).")
    if unknown:
        raise UserError(f"{recipe_path}: unknown keys {', '.join(unknown)}; remove them or fix their spelling (the "
                        f"keys are the flags of SFTConfig, ModelConfig, ScriptArguments and finetune's own).")
