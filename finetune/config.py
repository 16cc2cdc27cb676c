"""The run's configuration: a recipe YAML plus command-line overrides, parsed by TRL and checked before anything loads.

Every user mistake found here ends as a `UserError` whose message is one sentence naming the file, the field and the
fix; `scripts/sft.py` prints it and exits non-zero without a traceback.
"""

import argparse
import contextlib
import difflib
import hashlib
import itertools
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

from finetune import accelerate_checks, checkpoints, compilation, cpu, families, fp8, numbers, patches, resume, tracking
from finetune.config_files import (
    FSDP_V1_REFUSAL,
    RENAMED_KEYS,
    accelerate_config_file,
    asked_deepspeed_file,
    blocked_folder,
    read_deepspeed_config,
    read_foreign_keys,
    read_recipe,
    refuse_unknown_keys,
    requested_strategy,
    shipped,
)
from finetune.errors import RunFinished, UserError, say
from finetune.tiny import TINY_WIDTH

RUN_RECORD = "finetune_run.json"
SAMPLE_DATA = shipped("data/sample")
TINY_MAX_LENGTH = 256

# What `accelerate launch scripts/sft.py` runs with no arguments: the tiny Llama on the bundled sample data, learning
# its three word games (scripts/build_tiny_assets.py) well enough to answer most held-out prompts, in under a minute.
DEFAULT_ARGS = [
    "--config", str(shipped("recipes/llama-3.2-1b/full.yaml")),
    "--tiny",
    # at the tests' width of 64 the word games were learned from some random starts and not others (held-out exact
    # match 0.14-0.9 over six seeds); at 128 from all nine tried (0.93-1.0), in about a minute
    "--tiny_width", "128",
    "--output_dir", time.strftime("outputs/default-%Y%m%d-%H%M%S"),
    "--num_train_epochs", "12",
    # TRL's packing fills a step with rows of about one length, here nearly always rows of one game (73 of 78 packed
    # rows); steps of rows drawn at random learn the three games together, and reliably
    "--packing", "false",
    "--per_device_train_batch_size", "6",
    "--gradient_accumulation_steps", "1",
    "--learning_rate", "1e-3",
    # no decay: the games are learned late in the run, when a cosine schedule has already slowed it down
    "--lr_scheduler_type", "constant_with_warmup",
    "--logging_steps", "80",
    "--eval_strategy", "epoch",
    "--save_strategy", "no",
    "--sample_prompt", "Reverse: dog tree hat",  # a held-out prompt: no training row reverses these three words
    "--eval_samples_before_after", "42",  # the whole test split
]


@dataclass
class FinetuneArguments:
    tiny: bool = field(
        default=False,
        metadata={"help": "Swap the recipe's model for a tiny random model of the same family (tests, CPU smoke "
                          "runs)."},
    )
    tiny_width: int = field(
        default=TINY_WIDTH,
        metadata={"help": "Hidden size of the --tiny model (its MLP and heads scale with it): 64 keeps the tests fast; "
                          "the default run uses 128, wide enough to learn the sample data's word games from any "
                          "start."},
    )
    experts_implementation: str | None = field(
        default=None,
        metadata={"help": "Mixture-of-experts kernel passed to from_pretrained: 'eager', 'batched_mm' or "
                          "'grouped_mm'."},
    )
    expert_lora_kernel: Literal["grouped", "peft"] = field(
        default="grouped",
        metadata={"help": "How lora_target_parameters adapts GPT-OSS's experts: 'grouped' (grouped GEMMs, never forms "
                          "W + B·A) or 'peft' (peft's ParamWrapper, which does; for comparison)."},
    )
    sample_prompt: str | None = field(
        default=None,
        metadata={"help": "A user message answered greedily before and after training, to see what was learned."},
    )
    columns: dict | str | None = field(
        default=None,
        metadata={"help": "Your column names mapped onto a format finetune reads, e.g. {dialog: messages} or "
                          "{question: prompt, answer: completion}, or a list of the columns to keep; JSON on the "
                          "command line."},
    )
    dataset_mixture: dict | str | None = field(
        default=None,
        metadata={"help": "Several sources mixed into one training set: {datasets: [{path, split, test_split, "
                          "columns, fraction}, ...], seed, test_split_size}, or alignment-handbook's entries {id, "
                          "config, split, columns, weight}; replaces dataset_name."},
    )
    eval_samples_before_after: int = field(
        default=16,
        metadata={"help": "Held-out rows scored (assistant-token loss, exact match and token F1 of the generated "
                          "answer) before and after training, printed and written to finetune_scores.json; 0 turns "
                          "it off. Single-process runs only: generation under ZeRO-3/FSDP needs every rank."},
    )
    truncation: bool = field(
        default=True,
        metadata={"help": "false: a sample longer than max_length stops the run before the model loads, instead of "
                          "being cut by TRL (which can cut away the whole answer)."},
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Values the chat template reads, in training rows and sample answers alike, e.g. "
                          "'{\"reasoning_effort\": \"high\"}' for GPT-OSS; a row's own `chat_template_kwargs` win."},
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "A Jinja chat template written out in the recipe (alignment-handbook's key), for the "
                          "tokenizer to render and save; TRL applies it as it applies a `chat_template_path` file."},
    )
    fp8: bool = field(
        default=False,
        metadata={"help": "Train the linear layers in float8 (torchao, tensorwise scaling; with LoRA the frozen "
                          "base layers, the adapters staying bf16; LM head, embeddings and norms stay bf16) on GPUs "
                          "with float8 tensor cores (L4, H100, H200); needs torch_compile and "
                          "`pip install -e \".[fp8]\"`. The saved model is plain bf16."},
    )
    activation_memory_budget: float = field(
        default=1.0,
        metadata={"help": "Compiled layers without gradient checkpointing: the most each saves for backward, as a "
                          "fraction of what inductor saves by default; it recomputes the cheapest of the rest "
                          "(torch._functorch.config.activation_memory_budget). Llama-3.2-3B LoRA on an H200 at 0.8: "
                          "34.7 GiB instead of 49.0 at the same speed. Checkpointed layers keep only their inputs: "
                          "there it is not applied."},
    )
    dequantize_mxfp4: bool = field(
        default=True,
        metadata={"help": "MXFP4 checkpoints (openai/gpt-oss-*): true dequantizes the experts to the training dtype "
                          "on load; false keeps them resident in MXFP4 on the GPU (a quarter of the memory) and "
                          "dequantizes each layer's just before its GEMMs, with bit-equal results "
                          "(finetune/mxfp4_experts.py; one process, expert_lora_kernel: grouped)."},
    )
    resume_with_new_schedule: bool = field(
        default=False,
        metadata={"help": "Resuming with another learning_rate, lr_scheduler_type or warmup: apply them from the "
                          "resumed step (otherwise such a relaunch is refused: the checkpoint's rate would win)."},
    )

    def __post_init__(self):
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(f"`chat_template_kwargs` is not valid JSON ({error.msg}); give a JSON "
                                 f"object") from None
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ValueError("`chat_template_kwargs` must be a mapping such as {reasoning_effort: high}")


@dataclass
class RunConfig:
    script: ScriptArguments
    training: SFTConfig
    model: ModelConfig
    finetune: FinetuneArguments
    recipe_path: str | None
    explicit_keys: set[str]
    env: dict[str, str] = field(default_factory=dict)
    data_sources: dict = field(default_factory=dict)  # rows taken from each dataset, filled when the data loads
    data_fingerprint: str | None = None  # the training rows' count and hash (finetune/resume.py), once they load
    # On a relaunch, found by check_output_dir: the settings the output folder's run record keeps, and the checkpoint
    # this launch resumes from
    recorded_settings: dict = field(default_factory=dict)
    resumes_from: Path | None = None


def _flag_error(message: str):
    raise UserError(f"command line: {message}; fix that flag (see `scripts/sft.py --help`).")


class _Parser(TrlParser):
    """TRL's parser, with argparse's own message raised as the one sentence instead of printed with usage text."""

    def error(self, message: str):
        _flag_error(message)


def _parser() -> TrlParser:
    return _Parser((ScriptArguments, SFTConfig, ModelConfig, FinetuneArguments))


def _refuse_unknown_keys(parser: TrlParser, recipe: dict, recipe_path: str) -> None:
    refuse_unknown_keys(recipe, {action.dest for action in patches.parser_actions(parser)}, recipe_path)


def _coerce_recipe_values(parser: TrlParser, recipe: dict, recipe_path: str) -> dict:
    """Give each recipe value the type argparse would have given it on the command line.

    TrlParser puts YAML values in as defaults untouched, so `learning_rate: 2e-5` (a string in YAML 1.1) or
    `lora_r: sixteen` would otherwise reach the trainer as strings and fail deep inside it, or not fail at all.
    """
    actions = {action.dest: action for action in patches.parser_actions(parser)}
    coerced = {}
    for key, value in recipe.items():
        if key == "env":
            coerced[key] = value
            continue
        action = actions[key]  # unknown keys are refused before (_refuse_unknown_keys)
        if value is None or action.type is None or isinstance(value, (dict, list)) and action.nargs is None:
            coerced[key] = value
            continue
        try:
            if action.nargs in ("+", "*"):
                values = value if isinstance(value, list) else [value]
                coerced[key] = [action.type(str(item)) for item in values]
            else:
                coerced[key] = action.type(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            type_name = getattr(action.type, "__name__", str(action.type))
            raise UserError(
                f"{recipe_path}: `{key}: {value}` is not a valid {type_name}; give it a value of that type."
            ) from None
        if action.choices is not None and coerced[key] not in action.choices:
            raise UserError(
                f"{recipe_path}: `{key}: {value}` is not one of {sorted(map(str, action.choices))}; pick one of them."
            )
    return coerced


CHECKPOINTING_NAMES = ("gradient_checkpointing", "activation_checkpointing")


def _checkpointing_name_as_installed(recipe: dict, argv: list[str], source: str) -> tuple[dict, list[str], str]:
    """Either name of activation checkpointing, in the recipe or on the command line, as the installed transformers
    spells it: from 5.2x `activation_checkpointing`, with the old name a FutureWarning (raised by every run, since
    TRL's config sets the old name by default); before, only `gradient_checkpointing`. Returns the name used."""
    known = {item.name for item in fields(SFTConfig)}
    new, old = ("activation_checkpointing", "gradient_checkpointing") if CHECKPOINTING_NAMES[1] in known \
        else CHECKPOINTING_NAMES
    if old in recipe and new in recipe:
        raise UserError(f"{source}: both `{old}` and `{new}` are set; keep `{new}`.")
    recipe = {(new if key == old else key): value for key, value in recipe.items()}
    argv = [f"--{new}{arg[len(old) + 2:]}" if arg == f"--{old}" or arg.startswith(f"--{old}=") else arg for arg in argv]
    return recipe, argv, new


def _flags_given(argv: list[str]) -> set[str]:
    return {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """Parse the recipe and the command line into TRL's dataclasses and finetune's own arguments. Reads files and the
    environment, writes nothing: `apply_to_process` is the step that changes the process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = list(DEFAULT_ARGS)
    parser = _parser()

    recipe_path, recipe, env = None, {}, {}
    if "--config" in argv:
        index = argv.index("--config")
        if index + 1 >= len(argv):
            raise UserError("command line: --config needs a recipe path; pass --config recipes/MODEL/METHOD.yaml.")
        recipe_path = argv[index + 1]
        argv = argv[:index] + argv[index + 2 :]
        recipe = read_recipe(recipe_path)
    recipe, argv, checkpointing = _checkpointing_name_as_installed(recipe, argv, recipe_path or "command line")
    if checkpointing == "activation_checkpointing":  # TRL's default on by the new name, so nothing warns
        parser.set_defaults(gradient_checkpointing=None, activation_checkpointing=SFTConfig.gradient_checkpointing)
    if recipe_path:
        recipe = read_foreign_keys(recipe, recipe_path)
        _refuse_unknown_keys(parser, recipe, recipe_path)
        recipe = _coerce_recipe_values(parser, recipe, recipe_path)
        env = {key: str(value) for key, value in (recipe.pop("env", None) or {}).items()}
        parser.set_defaults(**recipe)
    if cpu.on_cpu():
        given = _flags_given(argv)  # a flag on the command line still wins over the CPU's value
        parser.set_defaults(**cpu.cpu_overrides({key: value for key, value in recipe.items() if key not in given}))

    unknown = [arg for arg in argv if arg.startswith("--") and arg[2:].split("=", 1)[0] not in _known_dests(parser)]
    if unknown:
        old_name = unknown[0][2:].split("=", 1)[0]
        renamed = f" (now --{RENAMED_KEYS[old_name]})" if old_name in RENAMED_KEYS else ""
        raise UserError(f"command line: unknown flag {unknown[0]}{renamed}; check its spelling with "
                        f"`scripts/sft.py --help`.")
    if requested_strategy() == "fsdp" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError(f"{accelerate_config_file()}: {FSDP_V1_REFUSAL}")  # before the CPU shim builds FSDP1's plugin
    if asked_deepspeed_file():
        read_deepspeed_config(asked_deepspeed_file())  # before TrainingArguments reads it and fails in its own words
    try:
        with cpu.cpu_environment() if cpu.on_cpu() else contextlib.nullcontext():
            script, training, model, finetune = parser.parse_args_into_dataclasses(args=argv)
    except SystemExit:
        raise UserError("command line: a flag has a missing or invalid value; see the message above for "
                        "which.") from None
    except json.JSONDecodeError as error:  # a mapping field's JSON, read by the training arguments
        raise UserError(f"{recipe_path or 'command line'}: {_field_with_bad_json(argv, recipe)} is not valid JSON "
                        f"({error.msg}); write it as a JSON object, e.g. '{{\"key\": 1}}'.") from None
    except ValueError as error:
        source = recipe_path or "command line"
        raise UserError(f"{source}: {_one_sentence(error)}") from None
    if model.lora_target_parameters == ["none"]:  # a list flag cannot be emptied on the command line
        model.lora_target_parameters = None
    if finetune.chat_template and training.chat_template_path:
        raise UserError(f"{recipe_path or 'command line'}: `chat_template` and `chat_template_path` both set the chat "
                        f"template; keep one of them.")
    _data_of_the_command_line(script, finetune, _flags_given(argv))
    if finetune.tiny:
        _scale_down_for_tiny(script, training, finetune, _flags_given(argv))
    return RunConfig(script, training, model, finetune, recipe_path, set(recipe) | _flags_given(argv), env)


def apply_to_process(run: RunConfig) -> None:
    """The one step that changes the process for a run: the recipe's `env:` block, regional compilation and inductor's
    activation budget, the MLflow run to continue, the CPU process group (FSDP over gloo), and the access token moved
    out of the arguments the Trainer saves."""
    os.environ.update(run.env)
    checkpoints.die_with_launcher()
    compilation.prepare_process(run.training)
    if run.training.torch_compile and not run.training.gradient_checkpointing:
        patches.set_activation_memory_budget(run.finetune.activation_memory_budget)
    tracking.prepare(run.training)
    if cpu.on_cpu():
        cpu.prepare_cpu_process_group()
    _keep_token_out_of_saved_arguments(run.training)
    _chat_template_as_file(run)


def _chat_template_as_file(run: RunConfig) -> None:
    """TRL reads a chat template from a file (`chat_template_path`); alignment-handbook recipes write it out in
    `chat_template:`. Named after its content, so every process of a launch writes and reads the same file."""
    template = run.finetune.chat_template
    if not template:
        return
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"finetune-chat-template-{digest}.jinja"
    written = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # then renamed: no process reads a half-written file
    written.write_text(template, encoding="utf-8")
    os.replace(written, path)
    run.training.chat_template_path = str(path)


def _data_of_the_command_line(script: ScriptArguments, finetune: FinetuneArguments, flags_given: set[str]) -> None:
    """--dataset_name replaces the recipe's data: its `dataset_mixture` (which would otherwise win) and, for a local
    file or folder, its `dataset_config` (the name of one of the recipe's hub dataset's configs)."""
    if "dataset_name" not in flags_given or "dataset_mixture" in flags_given:
        return
    finetune.dataset_mixture = None
    if "dataset_config" not in flags_given and Path(script.dataset_name).expanduser().exists():
        script.dataset_config = None


def _scale_down_for_tiny(script: ScriptArguments, training: SFTConfig, finetune: FinetuneArguments,
                         flags_given: set[str]) -> None:
    """A tiny random model stands in for the recipe's, so what belongs to the recipe's model and data goes too, unless
    the command line sets it: data that are not local files give way to the bundled sample (with its splits, without
    the recipe's dataset config and column mapping); rows are cut to TINY_MAX_LENGTH tokens (packed recipes would
    otherwise put 16k tokens in every CPU step); the real vocabulary's special tokens, dataset worker processes
    sized for the real data and pushes to the recipe's hub repository are dropped. One line says what was replaced."""
    replaced = []
    if not {"dataset_name", "dataset_mixture"} & flags_given and not _local_data(script, finetune):
        replaced.append(f"{_data_named(script, finetune)} with the bundled {SAMPLE_DATA}")
        script.dataset_name, finetune.dataset_mixture = str(SAMPLE_DATA), None
        sample_values = [(script, "dataset_config", None), (script, "dataset_train_split", "train"),
                         (script, "dataset_test_split", "test"), (finetune, "columns", None)]
        for arguments, key, value in sample_values:
            if key not in flags_given:
                setattr(arguments, key, value)
    if "max_length" not in flags_given and (training.max_length or TINY_MAX_LENGTH) > TINY_MAX_LENGTH:
        replaced.append(f"max_length {training.max_length} with {TINY_MAX_LENGTH}")
        training.max_length = TINY_MAX_LENGTH
    for key, instead in (("eos_token", "the tiny tokenizer's"), ("pad_token", "the tiny tokenizer's"),
                         ("dataset_num_proc", "none"), ("push_to_hub", "false (a tiny random model is never pushed)")):
        if key not in flags_given and getattr(training, key):
            value = getattr(training, key)
            replaced.append(f"{key} {str(value).lower() if isinstance(value, bool) else value} with {instead}")
            setattr(training, key, False if key == "push_to_hub" else None)
    if replaced:
        say(f"--tiny replaced {', '.join(replaced)}")


def _mixture_paths(mixture) -> list[str] | None:
    """The datasets a recipe's `dataset_mixture` names (finetune's `path`, alignment-handbook's `id`), or None when
    it is not one that data_formats.check_mixture would accept the shape of: that check then names what is wrong."""
    entries = mixture.get("datasets") if isinstance(mixture, dict) else None
    paths = [entry.get("path") or entry.get("id") if isinstance(entry, dict) else None for entry in entries or []]
    return [str(path) for path in paths] if isinstance(entries, list) and paths and all(paths) else None


def _local_data(script: ScriptArguments, finetune: FinetuneArguments) -> bool:
    if finetune.dataset_mixture:
        paths = _mixture_paths(finetune.dataset_mixture)
        return paths is None or all(Path(path).expanduser().exists() for path in paths)
    return bool(script.dataset_name) and Path(script.dataset_name).expanduser().exists()


def _data_named(script: ScriptArguments, finetune: FinetuneArguments) -> str:
    if finetune.dataset_mixture:
        return f"dataset_mixture ({', '.join(dict.fromkeys(_mixture_paths(finetune.dataset_mixture)))})"
    if not script.dataset_name:
        return "no dataset_name"
    config = f" (config {script.dataset_config})" if script.dataset_config else ""
    return f"dataset_name {script.dataset_name}{config}"


def _keep_token_out_of_saved_arguments(training: SFTConfig) -> None:
    """The Trainer pickles its arguments into every checkpoint's training_args.bin, so a `--hub_token` would be saved
    in clear next to the weights; huggingface_hub reads the same token from HF_TOKEN, which is never saved."""
    if training.hub_token:
        os.environ["HF_TOKEN"] = training.hub_token
        training.hub_token = None


def _known_dests(parser: TrlParser) -> set[str]:
    actions = patches.parser_actions(parser)
    return {option[2:] for action in actions for option in action.option_strings if option.startswith("--")}


def _field_with_bad_json(argv: list[str], recipe: dict) -> str:
    """Which flag or recipe key holds the JSON the training arguments could not read."""
    flags = dict(itertools.pairwise(argv))
    flags |= dict(arg.split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)
    for name in numbers.MAPPING_FIELDS + ("accelerator_config", "fsdp_config", "deepspeed"):
        for written, value in ((f"--{name}", flags.get(f"--{name}")), (f"`{name}`", recipe.get(name))):
            if isinstance(value, str) and value.startswith("{"):
                try:
                    json.loads(value)
                except json.JSONDecodeError:
                    return f"{written} {value}"
    return "a mapping field"


def _one_sentence(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text if text.endswith(".") else text + "."


def check(run: RunConfig) -> None:
    """Refuse contradictory settings before any model or dataset is loaded."""
    source = run.recipe_path or "command line"
    model = run.model
    if not model.model_name_or_path:
        raise UserError(f"{source}: `model_name_or_path` is not set; give a hub id or a local folder.")
    name = model.model_name_or_path
    if not run.finetune.tiny and name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise UserError(f"{name}: model folder not found; fix --model_name_or_path (a hub id or a local folder).")
    if model.load_in_4bit and not model.use_peft:
        raise UserError(f"{source}: `load_in_4bit: true` (QLoRA) trains 4-bit weights only through LoRA; add "
                        f"`use_peft: true`.")
    lora_keys = sorted(key for key in run.explicit_keys if key.startswith("lora_") or key in ("use_rslora", "use_dora"))
    if lora_keys and not model.use_peft:
        raise UserError(
            f"{source}: `{lora_keys[0]}` is set but `use_peft` is false, so it would be ignored; "
            f"add `use_peft: true` or drop the LoRA settings."
        )
    if not 0 < run.finetune.activation_memory_budget <= 1:
        raise UserError(f"{source}: `activation_memory_budget: {run.finetune.activation_memory_budget}` is the "
                        f"fraction of a compiled layer's activations it may keep; give a value above 0 and at most 1.")
    if run.training.activation_offloading and cpu.on_cpu():  # a recipe's value is already off (cpu.cpu_overrides)
        raise UserError("command line: `--activation_offloading true` moves activations out of GPU memory and this "
                        "machine has no GPU; drop the flag here.")
    if model.load_in_4bit and model.load_in_8bit:
        raise UserError(f"{source}: `load_in_4bit` and `load_in_8bit` are both true; keep one of them.")
    strategy = requested_strategy()
    if model.load_in_4bit and strategy in ("fsdp", "zero3"):
        raise UserError(
            f"{accelerate_config_file()}: QLoRA's 4-bit weights cannot be "
            f"sharded by {strategy.upper()} here; launch with accelerate_configs/ddp.yaml or zero2.yaml instead."
        )
    check_mxfp4(run, source)
    if model.lora_target_parameters and not families.family_of(model.model_name_or_path, model.model_revision).experts:
        raise UserError(
            f"{source}: `lora_target_parameters` adapts mixture-of-experts weights, which "
            f"{model.model_name_or_path} does not have; remove it or use lora_target_modules."
        )
    numbers.check_numbers(lambda key: run_value(run, key), source)
    check_attention(model, source)
    check_optimizer_installed(run.training, source)
    tracking.check_installed(run.training, source)
    check_report_to(run.training, source)
    check_hub_push(run.training, source)
    check_chat_template(run, source)
    fp8.check(run, source)
    accelerate_checks.check_run(run)
    check_deepspeed_agrees(run)
    check_resume_checkpoint(run)
    check_output_dir(run)


# transformers' reporting integrations that need a package of their own, and its name on PyPI (mlflow: tracking.py)
REPORTING_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "comet_ml": "comet-ml", "neptune": "neptune",
                      "clearml": "clearml", "dvclive": "dvclive", "codecarbon": "codecarbon", "swanlab": "swanlab",
                      "trackio": "trackio"}


def check_report_to(training, source: str) -> None:
    """transformers builds the `report_to` callbacks with the Trainer, after the model has loaded, and fails there on
    an integration it does not know or whose package is missing."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [name for name in training.report_to or [] if name not in ("none", "all")]
    for name in names:
        if name not in INTEGRATION_TO_CALLBACK:
            close = difflib.get_close_matches(name, INTEGRATION_TO_CALLBACK, n=1)
            meant = f"did you mean `{close[0]}`? " if close else ""
            raise UserError(f"{source}: `report_to: {name}` is no integration transformers knows ({meant}it knows "
                            f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}); fix `report_to` or set `report_to: none`.")
    available = set(get_available_reporting_integrations())
    missing = [name for name in names if name in REPORTING_PACKAGES and name not in available]
    if missing:
        packages = " ".join(REPORTING_PACKAGES[name] for name in missing)
        whose, it = ("whose package is", "it") if len(missing) == 1 else ("whose packages are", "them")
        raise UserError(f"{source}: `report_to` names {' and '.join(missing)}, {whose} not installed; `pip install "
                        f"{packages}`, or remove {it} from report_to (`report_to: none` logs nowhere).")


def check_hub_push(training, source: str) -> None:
    """`push_to_hub: true` creates the hub repository when the Trainer is built, after the model has loaded: offline
    or without a token that fails there, so it is refused here. (--tiny turns pushing off: _scale_down_for_tiny.)"""
    if not training.push_to_hub:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):  # huggingface_hub's reading
        raise UserError(f"{source}: `push_to_hub: true` uploads to the hub, and HF_HUB_OFFLINE is set; set "
                        f"`push_to_hub: false` (upload output_dir later with `hf upload`) or unset HF_HUB_OFFLINE.")
    from huggingface_hub import get_token

    if get_token() is None:
        raise UserError(f"{source}: `push_to_hub: true` needs a Hugging Face token and none is set; run `hf auth "
                        f"login` or set HF_TOKEN, or set `push_to_hub: false`.")


def check_chat_template(run: RunConfig, source: str) -> None:
    """TRL masks the loss to the answers with the template's {% generation %} markers, and fails after loading the
    model when a template it cannot rewrite has none."""
    from trl.chat_template_utils import has_generation_markers

    template = run.finetune.chat_template
    if template and run.training.assistant_only_loss and not has_generation_markers(template):
        raise UserError(f"{source}: `assistant_only_loss: true` needs {{% generation %}} markers around the answers in "
                        f"the recipe's `chat_template`, which has none; add them or set `assistant_only_loss: false`.")


def run_value(run: RunConfig, key: str):
    """The parsed value of a recipe key, whichever of the run's argument classes holds it (None: none does)."""
    for arguments in (run.training, run.model, run.finetune, run.script):
        if hasattr(arguments, key):
            return getattr(arguments, key)
    return None


def check_optimizer_installed(training, source: str) -> None:
    """The package an optimizer needs (torchao's 8-bit AdamW, LOMO, GaLore, schedule-free...), which transformers
    imports only once the model is loaded."""
    from transformers import Trainer

    try:
        Trainer.get_optimizer_cls_and_kwargs(training)
    except (ImportError, ValueError) as error:
        if isinstance(error, ImportError) or "install" in str(error):
            why = _one_sentence(error).split(". ")[0].rstrip(".")
            optim = getattr(training.optim, "value", training.optim)
            raise UserError(f"{source}: `optim: {optim}` needs a package that is not installed ({why}); "
                            f"install it, or use `optim: adamw_torch`.") from None


def check_attention(model, source: str) -> None:
    """An attention implementation transformers knows (a kernel of its own, a `paged|` one, a hub kernel's id) or
    this toolkit's varlen kernel (attention.py)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from finetune.attention import VARLEN_ATTENTION

    known = ["eager", VARLEN_ATTENTION, *ALL_ATTENTION_FUNCTIONS.keys()]
    name = model.attn_implementation
    if name is None or "/" in name or name in known or name.removeprefix("paged|") in known:
        return
    raise UserError(f"{source}: `attn_implementation: {name}` is not an attention transformers knows; use one of "
                    f"{', '.join(dict.fromkeys(known))} or a hub kernel's id (org/name).")


def check_mxfp4(run: RunConfig, source: str) -> None:
    """An MXFP4 checkpoint (the recipe's, which --tiny stands in for) trains dequantized to the training dtype, or
    with its experts resident in MXFP4 in a single process through the grouped expert LoRA."""
    from finetune import mxfp4

    name = run.model.model_name_or_path
    if not mxfp4.is_mxfp4_checkpoint(name):
        return
    if not run.finetune.dequantize_mxfp4:
        strategy = requested_strategy()
        if strategy != "single":
            raise UserError(f"{source}: `dequantize_mxfp4: false` keeps the experts resident in MXFP4 in one process "
                            f"only, and this launch runs {strategy}; launch one process or set `dequantize_mxfp4: "
                            f"true`.")
        if run.finetune.expert_lora_kernel != "grouped" and run.model.lora_target_parameters:
            raise UserError(f"{source}: `expert_lora_kernel: {run.finetune.expert_lora_kernel}` adds B·A to the expert "
                            f"weights, which `dequantize_mxfp4: false` keeps packed in MXFP4; use `expert_lora_kernel: "
                            f"grouped` or `dequantize_mxfp4: true`.")
    if run.model.load_in_4bit or run.model.load_in_8bit:
        flag = "load_in_4bit" if run.model.load_in_4bit else "load_in_8bit"
        raise UserError(
            f"{source}: `{flag}: true` asks bitsandbytes to quantize {name}, whose experts are already MXFP4 and "
            f"load dequantized; remove {flag} (LoRA on the bf16 model is the GPT-OSS recipe)."
        )


# DeepSpeed JSON keys that must equal the recipe's value when they are not "auto".
DEEPSPEED_RECIPE_KEYS = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
}
# What accelerate puts in place of a key the JSON leaves out (DeepSpeedPlugin.__post_init__); the others follow the
# recipe
DEEPSPEED_UNSET = {"gradient_accumulation_steps": 1}
# A DeepSpeed JSON's own blocks, and the recipe key each would replace: transformers then builds DeepSpeed's optimizer
# or schedule instead of the recipe's, without a word.
DEEPSPEED_BLOCKS = {"optimizer": "optim", "scheduler": "lr_scheduler_type"}


def check_deepspeed_agrees(run: RunConfig) -> None:
    """A DeepSpeed JSON that hard-codes what the recipe decides (batch size, accumulation, clipping, bf16/fp16, which
    transformers compares only once the model is loaded), or brings an optimizer or a schedule of its own: every
    contradiction at once, in one sentence naming both values."""
    config_file = asked_deepspeed_file()
    if not config_file:
        return
    written = read_deepspeed_config(config_file)
    deepspeed = {**DEEPSPEED_UNSET, **written}
    training = run.training
    values = [f"`{key}: {deepspeed[key]}`{'' if key in written else ' (left out: accelerate sets it)'} contradicts "
              f"the recipe's `{recipe_key}: {getattr(training, recipe_key)}`"
              for key, recipe_key in DEEPSPEED_RECIPE_KEYS.items()
              if not _deepspeed_value_is(deepspeed.get(key, "auto"), getattr(training, recipe_key))]
    batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * int(
        os.environ.get("WORLD_SIZE", "1"))
    if not _deepspeed_value_is(deepspeed.get("train_batch_size", "auto"), batch):
        values.append(f"`train_batch_size: {deepspeed['train_batch_size']}` is not the recipe's per-device batch "
                      f"× accumulation × processes, {batch}")
    asked = accelerate_checks.asked_precision(run)
    for dtype in ("bf16", "fp16"):
        enabled = str((deepspeed.get(dtype) or {}).get("enabled", "auto")).lower()
        if enabled == "auto" or (enabled == "true") == bool(getattr(training, dtype)):
            continue
        if (enabled == "true") == (asked == dtype):  # the recipe's precision, which a machine without a GPU replaces
            values.append(f"`{dtype}.enabled: {enabled}` asks for {dtype}, which this machine without a GPU does "
                          f"not train in (float32)")
        else:
            values.append(f"`{dtype}.enabled: {enabled}` contradicts the recipe's "
                          f"{f'`{asked}: true`' if asked != 'no' else '`bf16: false`'}")
    blocks = [f"its `{block}` block ({(deepspeed[block] or {}).get('type')}) would replace the recipe's "
              f"`{key}: {getattr(getattr(training, key), 'value', getattr(training, key))}`"
              for block, key in DEEPSPEED_BLOCKS.items() if block in deepspeed]
    compiling = deepspeed.get("compile") or {}
    if compiling and not compiling.get("disable", False) and not training.torch_compile:  # DeepSpeed compiles only then
        blocks.append(f"its `compile` block ({compiling.get('backend', 'inductor')}) is ignored by a run that is not "
                      f"compiled (`torch_compile: false`)")
    if not values and not blocks:
        return
    fixes = ([f"set {'them' if len(values) > 1 else 'it'} to \"auto\""] if values else []) + (
        [f"delete {'those blocks' if len(blocks) > 1 else 'that block'}"] if blocks else [])
    raise UserError(f"{config_file}: {_listed(values + blocks)}; {' and '.join(fixes)} so that the recipe decides.")


def _deepspeed_value_is(value, wanted) -> bool:
    """A JSON value agrees with the recipe's when it is "auto" or the same number."""
    try:
        return value == "auto" or float(value) == float(wanted)
    except (TypeError, ValueError):
        return False


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def check_resume_checkpoint(run: RunConfig) -> None:
    """--resume_from_checkpoint must name a complete checkpoint (see finetune/checkpoints.py)."""
    from finetune import checkpoints

    requested = run.training.resume_from_checkpoint
    if requested and str(requested).lower() not in ("true", "1", "yes"):
        checkpoints.resume_point(requested, run.training.output_dir, announce=False)


def run_identity(run: RunConfig) -> dict:
    """What makes two launches the same run, so that a relaunch resumes and a different run is refused."""
    return {
        "model_name_or_path": run.model.model_name_or_path,
        "tiny": run.finetune.tiny,
        "tiny_width": run.finetune.tiny_width if run.finetune.tiny else None,
        "use_peft": run.model.use_peft,
        "dataset_name": run.script.dataset_name,
    }


def check_output_dir(run: RunConfig) -> None:
    """Never write over another run's files: an output folder is either empty, ours to resume, or refused."""
    output_dir = Path(run.training.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"{output_dir}: output_dir is a file, not a folder; pick a new or empty folder for "
                        f"--output_dir.")
    blocked = blocked_folder(output_dir)
    if blocked and blocked[1] == "file":
        raise UserError(f"{output_dir}: output_dir cannot be created because {blocked[0]} is a file; pick another "
                        f"--output_dir.")
    if blocked:
        raise UserError(f"{output_dir}: output_dir cannot be written ({blocked[0]} is read-only or not yours); pick "
                        f"a folder you can write to for --output_dir.")
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return
    record_file = output_dir / RUN_RECORD
    if not record_file.is_file():
        raise UserError(
            f"{output_dir}: output_dir already holds files that no finetune run wrote; "
            f"pick an empty --output_dir so nothing there is overwritten."
        )
    recorded = recorded_run(output_dir)
    if not recorded:  # cut short by a crash before it was written atomically
        say(f"{record_file} is unreadable; taking {output_dir} as this run's folder and writing it "
              f"again.")
        recorded = run_identity(run)
    differing = [(key, recorded.get(key), value) for key, value in run_identity(run).items()
                 if recorded.get(key) != value]
    if differing:
        changes = ", ".join(f"{key} was {old!r}, now {new!r}" for key, old, new in differing)
        raise UserError(
            f"{output_dir}: output_dir holds another run ({changes}); pick a new --output_dir, or relaunch that run "
            f"to resume it."
        )
    step = checkpoints.finished_step(output_dir, training_length(run.training))
    if step is not None:
        raise RunFinished(str(output_dir), step)
    run.resumes_from = resume_checkpoint(run)
    run.recorded_settings = recorded.get("settings") if isinstance(recorded.get("settings"), dict) else {}
    if run.resumes_from is not None and run.recorded_settings:
        resume.check_relaunch(run, run.recorded_settings, run.resumes_from, output_dir)


def resume_checkpoint(run: RunConfig) -> Path | None:
    """The checkpoint this launch would resume from (checked quietly; train.train_and_save announces it)."""
    requested = run.training.resume_from_checkpoint
    if requested and str(requested).lower() not in ("true", "1", "yes"):
        return Path(requested)
    return checkpoints.newest_complete(run.training.output_dir)


def check_data_unchanged(run: RunConfig, train_set) -> None:
    """Once the rows load (before the model): a checkpoint resumes into the rows it was trained on."""
    resume.check_data_unchanged(run, run.recorded_settings, run.resumes_from, Path(run.training.output_dir), train_set)


def recorded_run(output_dir: str | Path) -> dict:
    """The run record of an output folder ({} when there is none or it is unreadable)."""
    try:
        recorded = json.loads((Path(output_dir) / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def training_length(training) -> dict:
    """What decides how long a run trains: a relaunch with the same is the same finished run."""
    return {"max_steps": training.max_steps, "num_train_epochs": training.num_train_epochs}


