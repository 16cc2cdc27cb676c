"""Reading the files a user writes or picks: recipes, accelerate config files and DeepSpeed JSON.

One reader for each, used by the training run, the planner and `finetune launch` alike. Every problem is a
`UserError` naming the file and the fix. Only yaml and json are imported here, so the planner and the launcher
answer without loading trl or torch.
"""

import json
import os
from pathlib import Path

import yaml

from finetune.errors import UserError

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
    """A recipe's keys as written (TRL's flags plus finetune's own, and an optional `env:` mapping), with `overrides`
    (from `parse_overrides`) on top."""
    recipe = read_yaml_mapping(local_or_shipped(str(recipe_path)), "recipe", "pass --config with the path of a file under recipes/")
    if not isinstance(recipe.get("env") or {}, dict):
        raise UserError(f"{recipe_path}: `env` must be a mapping of VARIABLE: value lines; rewrite it as one.")
    return {**recipe, **(overrides or {})}


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


def accelerate_config_file() -> str:
    """The --config_file `accelerate launch` was given, read from the launcher's command line, for error messages."""
    try:
        launcher_args = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return "the accelerate config file"
    for index, arg in enumerate(launcher_args[:-1]):
        if arg == "--config_file":
            return launcher_args[index + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return "the default accelerate config (`accelerate config`)"


def read_deepspeed_config(config_file: str) -> dict:
    path = Path(local_or_shipped(config_file))
    if not path.is_file():
        raise UserError(
            f"{accelerate_config_file()}: deepspeed_config_file {config_file} "
            f"not found; paths are relative to where you launch, so launch from the project root."
        )
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UserError(f"{config_file}: not valid JSON at line {error.lineno}; fix the syntax there.") from None


FSDP_V1_REFUSAL = (  # under both launchers
    "an FSDP version 1 file (no `fsdp_version: 2` under `fsdp_config`), which accelerate runs with FSDP1's wrappers "
    "and state dicts; this toolkit trains with FSDP2: use accelerate_configs/fsdp.yaml or add `fsdp_version: 2` with "
    "FSDP2's fields as that file has them.")


def requested_strategy() -> str:
    """What the accelerate config file asked for, from the environment `accelerate launch` sets."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "fsdp"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        if config_file:
            stage = str(read_deepspeed_config(config_file).get("zero_optimization", {}).get("stage", stage))
        return f"zero{stage}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return "ddp"
    return "single"
