"""Reading the files a user writes or picks: recipes, accelerate config files and DeepSpeed JSON.

One reader for each, used by the training run, the planner and `finetune launch` alike. Every problem is a
`UserError` naming the file and the fix. Only yaml and json are imported here, so the planner and the launcher
answer without loading trl or torch.
"""

import difflib
import json
import os
import sys
from pathlib import Path

import yaml

from finetune.errors import UserError, say

# The files the project ships beside the library (recipes/, accelerate_configs/, ds_configs/, data/sample), reached
# through links inside the package so that a wheel (`pip install .` without -e) carries them too.
SHIPPED_DIR = Path(__file__).parent / "shipped"


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


# The arguments `finetune launch` gave `accelerate launch`, passed on to the training processes as a JSON list
LAUNCH_ARGUMENTS = "FINETUNE_LAUNCH_ARGUMENTS"


def arguments_after_accelerate_launch(command: list[str]) -> list[str] | None:
    """What `command` gives `accelerate launch` (its flags, the script and the script's flags), or None when it is not
    an `accelerate launch` command."""
    for index, arg in enumerate(command):
        after_accelerate = index > 0 and Path(command[index - 1]).name.startswith("accelerate")
        if arg == "accelerate.commands.launch" or arg == "launch" and after_accelerate:
            return command[index + 1:]
    return None


def accelerate_launch_arguments() -> list[str] | None:
    """What the `accelerate launch` that started this training process was given, or None when none did. `finetune
    launch` passes it in the environment. A plain `accelerate launch` exports what its config file and flags set, but
    not the file's name nor fields it has no variable for (a one-process launch exports no `parallelism_config`), so
    there it is read from that launcher's command line, the one record of it."""
    passed = os.environ.get(LAUNCH_ARGUMENTS)
    if passed is not None:
        return json.loads(passed)
    try:
        launcher = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None
    return arguments_after_accelerate_launch(launcher)


def accelerate_config_file() -> str:
    """The --config_file `accelerate launch` was given, for error messages."""
    arguments = accelerate_launch_arguments()
    if arguments is None:
        return "the accelerate config file"
    for index, arg in enumerate(arguments[:-1]):
        if arg == "--config_file":
            return arguments[index + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return "the default accelerate config (`accelerate config`)"


# accelerate refuses these fields of an accelerate config file beside a deepspeed_config_file, which holds them
# (DeepSpeedPlugin._deepspeed_config_checks, accelerate 1.15-1.16), once the training arguments are built.
FIELDS_NOT_BESIDE_DEEPSPEED_FILE = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model",
    "mixed_precision")


def fields_beside_deepspeed_file_refusal(config_file: str, deepspeed_file: str, fields: list[str]) -> UserError:
    listed = " and ".join(f"`{field}`" for field in fields)
    return UserError(
        f"{config_file}: {listed} cannot be set beside `deepspeed_config_file: {deepspeed_file}` (accelerate refuses "
        f"{'them' if len(fields) > 1 else 'it'} there: the JSON holds those settings); remove "
        f"{'them' if len(fields) > 1 else 'it'} from that file, the JSON's \"auto\" values follow the recipe.")


def read_deepspeed_config(config_file: str, accelerate_file: str | None = None) -> dict:
    """The DeepSpeed JSON accelerate hands to DeepSpeed (named in `accelerate_file`, by default the launcher's), or a
    UserError. In a DeepSpeed training process also the accelerate config fields the launcher exported beside it
    (ACCELERATE_CONFIG_DS_FIELDS): accelerate refuses them with a message of its own when the training arguments are
    built, which is after this is called."""
    path = Path(local_or_shipped(config_file))
    if not path.is_file():
        raise UserError(
            f"{accelerate_file or accelerate_config_file()}: deepspeed_config_file {config_file} not found; paths are "
            f"relative to where you launch, so launch from the folder it is relative to (the project root for "
            f"accelerate_configs/*.yaml) or make it absolute."
        )
    exported = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    beside = [field for field in FIELDS_NOT_BESIDE_DEEPSPEED_FILE if field in exported]
    if beside:
        raise fields_beside_deepspeed_file_refusal(accelerate_config_file(), config_file, beside)
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{config_file}: not valid JSON at line {error.lineno}; fix the syntax there.") from None
    except UnicodeDecodeError:
        raise UserError(f"{config_file}: not UTF-8 text; save it as UTF-8.") from None
    if not isinstance(values, dict):
        raise UserError(f"{config_file}: a DeepSpeed config is a JSON object of settings, not a "
                        f"{type(values).__name__}; write it as one, e.g. {{\"zero_optimization\": {{\"stage\": 2}}, "
                        f"...}} as ds_configs/*.json are.")
    if not isinstance(values.get("zero_optimization"), dict):
        raise UserError(f"{config_file}: no `zero_optimization` object, which accelerate requires; add "
                        f"\"zero_optimization\": {{\"stage\": 2}} (or the stage you want), as ds_configs/*.json have.")
    return values


FSDP_V1_REFUSAL = (  # under both launchers
    "an FSDP version 1 file (no `fsdp_version: 2` under `fsdp_config`), which accelerate runs with FSDP1's wrappers "
    "and state dicts; this toolkit trains with FSDP2: use accelerate_configs/fsdp.yaml or add `fsdp_version: 2` with "
    "FSDP2's fields as that file has them.")


# What `accelerate launch` asked for is read from the variables it exports to the training processes, as accelerate's
# own state reads them (AcceleratorState), in these three functions only.
def fsdp_asked_for() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def deepspeed_asked_for() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def asked_deepspeed_file() -> str | None:
    """The DeepSpeed JSON the launch passes on, when it asks for DeepSpeed with one."""
    return (os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None) if deepspeed_asked_for() else None


def requested_strategy() -> str:
    """What the accelerate config file asked for: fsdp, zero1-3, ddp or single."""
    if fsdp_asked_for():
        return "fsdp"
    if deepspeed_asked_for():
        config_file = asked_deepspeed_file()
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if config_file:
            stage = str(read_deepspeed_config(config_file).get("zero_optimization", {}).get("stage", stage))
        return f"zero{stage}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "ddp"
    return "single"


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
}


def read_foreign_keys(recipe: dict, recipe_path: str, stream=None) -> dict:
    """alignment-handbook's and TRL's recipe keys that mean a setting of finetune's under another shape, in that
    shape; and those that transformers 5 and TRL 1.x no longer read, left out where that changes nothing. One line
    says what was read how. The other keys of those recipes are TRL's own (RENAMED_KEYS: read_recipe). An axolotl
    recipe is read in finetune's names first (finetune/axolotl_recipes.py)."""
    from finetune.axolotl_recipes import read_axolotl_recipe

    recipe, notes = read_axolotl_recipe(recipe, recipe_path)
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
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    return f" (did you mean `{close[0]}`?)" if close else ""


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
