"""The run's configuration: a recipe YAML plus command-line overrides, parsed by TRL and checked before anything loads.

Every user mistake found here ends as a `UserError` whose message is one sentence naming the file, the field and the
fix; `scripts/sft.py` prints it and exits non-zero without a traceback.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from torch._functorch import config as functorch_config
from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

from finetune import checkpoints, compilation, cpu, fp8, tracking
from finetune.architectures import model_family
from finetune.config_files import (
    FSDP_V1_REFUSAL,
    accelerate_config_file,
    read_deepspeed_config,
    read_recipe,
    requested_strategy,
    shipped,
)
from finetune.errors import RunFinished, UserError
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
        metadata={"help": "Swap the recipe's model for a tiny random model of the same family (tests, CPU smoke runs)."},
    )
    tiny_width: int = field(
        default=TINY_WIDTH,
        metadata={"help": "Hidden size of the --tiny model (its MLP and heads scale with it): 64 keeps the tests fast; "
                          "the default run uses 128, wide enough to learn the sample data's word games from any start."},
    )
    experts_implementation: str | None = field(
        default=None,
        metadata={"help": "Mixture-of-experts kernel passed to from_pretrained: 'eager', 'batched_mm' or 'grouped_mm'."},
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
                          "{question: prompt, answer: completion}; JSON on the command line."},
    )
    dataset_mixture: dict | str | None = field(
        default=None,
        metadata={"help": "Several sources mixed into one training set: {datasets: [{path, split, test_split, "
                          "columns, fraction}, ...], seed, test_split_size}; replaces dataset_name."},
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
        metadata={"help": "MXFP4 checkpoints (openai/gpt-oss-*): dequantize the experts to the training dtype on load. "
                          "Training needs it (4-bit experts carry no gradients)."},
    )

    def __post_init__(self):
        if isinstance(self.chat_template_kwargs, str):
            try:
                self.chat_template_kwargs = json.loads(self.chat_template_kwargs)
            except json.JSONDecodeError as error:
                raise ValueError(f"`chat_template_kwargs` is not valid JSON ({error.msg}); give a JSON object") from None
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


def _flag_error(message: str):
    raise UserError(f"command line: {message}; fix that flag (see `scripts/sft.py --help`).")


class _Parser(TrlParser):
    """TRL's parser, with argparse's own message raised as the one sentence instead of printed with usage text."""

    def error(self, message: str):
        _flag_error(message)


def _parser() -> TrlParser:
    return _Parser((ScriptArguments, SFTConfig, ModelConfig, FinetuneArguments))






def _coerce_recipe_values(parser: TrlParser, recipe: dict, recipe_path: str) -> dict:
    """Give each recipe value the type argparse would have given it on the command line.

    TrlParser puts YAML values in as defaults untouched, so `learning_rate: 2e-5` (a string in YAML 1.1) or
    `lora_r: sixteen` would otherwise reach the trainer as strings and fail deep inside it, or not fail at all.
    """
    actions = {action.dest: action for action in parser._actions}
    coerced = {}
    for key, value in recipe.items():
        if key == "env":
            coerced[key] = value
            continue
        action = actions.get(key)
        if action is None:
            raise UserError(
                f"{recipe_path}: unknown key `{key}`; remove it or fix its spelling "
                f"(the keys are the flags of SFTConfig, ModelConfig, ScriptArguments and finetune's own)."
            )
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
        recipe = _coerce_recipe_values(parser, recipe, recipe_path)
        env = {key: str(value) for key, value in (recipe.pop("env", None) or {}).items()}
        parser.set_defaults(**recipe)
    if cpu.on_cpu():
        given = _flags_given(argv)  # a flag on the command line still wins over the CPU's value
        parser.set_defaults(**cpu.cpu_overrides({key: value for key, value in recipe.items() if key not in given}))

    unknown = [arg for arg in argv if arg.startswith("--") and arg[2:].split("=", 1)[0] not in _known_dests(parser)]
    if unknown:
        raise UserError(f"command line: unknown flag {unknown[0]}; check its spelling with `scripts/sft.py --help`.")
    if requested_strategy() == "fsdp" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError(f"{accelerate_config_file()}: {FSDP_V1_REFUSAL}")  # before the CPU shim builds FSDP1's plugin
    deepspeed_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and deepspeed_file:
        read_deepspeed_config(deepspeed_file)  # before TrainingArguments reads it and fails with a message of its own
    try:
        with cpu.cpu_environment() if cpu.on_cpu() else contextlib.nullcontext():
            script, training, model, finetune = parser.parse_args_into_dataclasses(args=argv)
    except SystemExit:
        raise UserError("command line: a flag has a missing or invalid value; see the message above for which.") from None
    except ValueError as error:
        source = recipe_path or "command line"
        raise UserError(f"{source}: {_one_sentence(error)}") from None
    if model.lora_target_parameters == ["none"]:  # a list flag cannot be emptied on the command line
        model.lora_target_parameters = None
    if finetune.tiny:
        _scale_down_for_tiny(script, training, _flags_given(argv), finetune.dataset_mixture)
    return RunConfig(script, training, model, finetune, recipe_path, set(recipe) | _flags_given(argv), env)


def apply_to_process(run: RunConfig) -> None:
    """The one step that changes the process for a run: the recipe's `env:` block, regional compilation and inductor's
    activation budget, the MLflow run to continue, the CPU process group (FSDP over gloo), and the access token moved
    out of the arguments the Trainer saves."""
    os.environ.update(run.env)
    checkpoints.die_with_launcher()
    compilation.prepare_process(run.training)
    if run.training.torch_compile and not run.training.gradient_checkpointing:
        functorch_config.activation_memory_budget = run.finetune.activation_memory_budget
    tracking.prepare(run.training)
    if cpu.on_cpu():
        cpu.prepare_cpu_process_group()
    _keep_token_out_of_saved_arguments(run.training)


def _scale_down_for_tiny(script: ScriptArguments, training: SFTConfig, flags_given: set[str], mixture=None) -> None:
    """A tiny model trains on the bundled sample data, in rows of at most TINY_MAX_LENGTH tokens (packed recipes
    would otherwise put 16k tokens in every CPU step), unless the command line says otherwise."""
    if "dataset_name" not in flags_given and not Path(script.dataset_name or "").exists() and not mixture:
        print(f"[finetune] --tiny: training on the bundled {SAMPLE_DATA} instead of {script.dataset_name}", flush=True)
        script.dataset_name = str(SAMPLE_DATA)
    if "max_length" not in flags_given and (training.max_length or TINY_MAX_LENGTH) > TINY_MAX_LENGTH:
        training.max_length = TINY_MAX_LENGTH


def _keep_token_out_of_saved_arguments(training: SFTConfig) -> None:
    """The Trainer pickles its arguments into every checkpoint's training_args.bin, so a `--hub_token` would be saved
    in clear next to the weights; huggingface_hub reads the same token from HF_TOKEN, which is never saved."""
    if training.hub_token:
        os.environ["HF_TOKEN"] = training.hub_token
        training.hub_token = None


def _known_dests(parser: TrlParser) -> set[str]:
    return {option[2:] for action in parser._actions for option in action.option_strings if option.startswith("--")}


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
        raise UserError(f"{source}: `load_in_4bit: true` (QLoRA) trains 4-bit weights only through LoRA; add `use_peft: true`.")
    lora_keys = sorted(key for key in run.explicit_keys if key.startswith("lora_") or key in ("use_rslora", "use_dora"))
    if lora_keys and not model.use_peft:
        raise UserError(
            f"{source}: `{lora_keys[0]}` is set but `use_peft` is false, so it would be ignored; "
            f"add `use_peft: true` or drop the LoRA settings."
        )
    if not 0 < run.finetune.activation_memory_budget <= 1:
        raise UserError(f"{source}: `activation_memory_budget: {run.finetune.activation_memory_budget}` is the fraction "
                        f"of a compiled layer's activations it may keep; give a value above 0 and at most 1.")
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
    if model.lora_target_parameters and model_family(model.model_name_or_path) != "gpt-oss":
        raise UserError(
            f"{source}: `lora_target_parameters` adapts mixture-of-experts weights, which "
            f"{model.model_name_or_path} does not have; remove it or use lora_target_modules."
        )
    check_numbers(run, source)
    tracking.check_installed(run.training, source)
    fp8.check(run, source)
    check_deepspeed_agrees(run)
    check_resume_checkpoint(run)
    check_output_dir(run)


def check_numbers(run: RunConfig, source: str) -> None:
    """Numbers outside the range where they mean something: refused here, not as a traceback after loading or as a
    run that silently trains nothing."""
    training, model = run.training, run.model

    def refuse(key: str, value, meaning: str) -> None:
        raise UserError(f"{source}: `{key}: {value}` {meaning}; fix `{key}` (a recipe key or --{key}).")

    for key in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(training, key) < 1:
            refuse(key, getattr(training, key), "must be a whole number of at least 1")
    if not math.isfinite(training.learning_rate) or training.learning_rate <= 0:
        refuse("learning_rate", training.learning_rate, "must be a finite number above 0")
    if training.max_length is not None and training.max_length < 1:
        refuse("max_length", training.max_length, "is the tokens per row and must be at least 1 (or unset)")
    if training.max_steps <= 0 and not training.num_train_epochs > 0:
        refuse("num_train_epochs", training.num_train_epochs, "trains nothing without a positive max_steps; give a "
               "number of epochs above 0 or set max_steps")
    if training.save_strategy == "steps" and training.save_steps <= 0:
        refuse("save_steps", training.save_steps, "must be above 0 with save_strategy steps (a fraction below 1 is "
               "a share of the run)")
    if model.use_peft:
        if model.lora_r < 1:
            refuse("lora_r", model.lora_r, "is the adapters' rank and must be at least 1")
        if not math.isfinite(model.lora_alpha) or model.lora_alpha <= 0:
            refuse("lora_alpha", model.lora_alpha, "scales the adapters and must be above 0")
        if not 0 <= model.lora_dropout < 1:
            refuse("lora_dropout", model.lora_dropout, "is a probability and must be at least 0 and below 1")


def check_mxfp4(run: RunConfig, source: str) -> None:
    """An MXFP4 checkpoint (the recipe's, which --tiny stands in for) trains only dequantized to the training dtype."""
    from finetune import mxfp4

    name = run.model.model_name_or_path
    if not mxfp4.is_mxfp4_checkpoint(name):
        return
    if not run.finetune.dequantize_mxfp4:
        raise UserError(
            f"{source}: `dequantize_mxfp4: false` keeps {name}'s experts in 4-bit MXFP4, which carry no gradients "
            f"(nothing would train through them); remove it so they load dequantized to the training dtype."
        )
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


def check_deepspeed_agrees(run: RunConfig) -> None:
    """A DeepSpeed JSON that hard-codes a batch size, accumulation or clipping the recipe contradicts."""
    config_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or not config_file:
        return
    deepspeed = read_deepspeed_config(config_file)
    for ds_key, recipe_key in DEEPSPEED_RECIPE_KEYS.items():
        value, wanted = deepspeed.get(ds_key, "auto"), getattr(run.training, recipe_key)
        if value != "auto" and float(value) != float(wanted):
            raise UserError(
                f"{config_file}: `{ds_key}: {value}` contradicts the recipe's `{recipe_key}: {wanted}`; "
                f"set it to \"auto\" so the recipe decides."
            )


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
        raise UserError(f"{output_dir}: output_dir is a file, not a folder; pick a new or empty folder for --output_dir.")
    existing = next(folder for folder in (output_dir.absolute(), *output_dir.absolute().parents) if folder.exists())
    if not existing.is_dir():
        raise UserError(f"{output_dir}: output_dir cannot be created because {existing} is a file; pick another "
                        f"--output_dir.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{output_dir}: output_dir cannot be written ({existing} is read-only or not yours); pick "
                        f"a folder you can write to for --output_dir.")
    if not output_dir.exists() or not any(output_dir.iterdir()):
        return
    record_file = output_dir / RUN_RECORD
    if not record_file.is_file():
        raise UserError(
            f"{output_dir}: output_dir already holds files that no finetune run wrote; "
            f"pick an empty --output_dir so nothing there is overwritten."
        )
    try:
        recorded = json.loads(record_file.read_text())
    except (OSError, ValueError):  # cut short by a crash before it was written atomically
        print(f"[finetune] {record_file} is unreadable; taking {output_dir} as this run's folder and writing it "
              f"again.", flush=True)
        recorded = run_identity(run)
    if recorded != run_identity(run):
        differing = next(key for key, value in run_identity(run).items() if recorded.get(key) != value)
        raise UserError(
            f"{output_dir}: output_dir holds another run ({differing} was {recorded.get(differing)!r}, "
            f"now {run_identity(run)[differing]!r}); pick a new --output_dir, or relaunch that run to resume it."
        )
    step = checkpoints.finished_step(output_dir, training_length(run.training))
    if step is not None:
        raise RunFinished(str(output_dir), step)


def training_length(training) -> dict:
    """What decides how long a run trains: a relaunch with the same is the same finished run."""
    return {"max_steps": training.max_steps, "num_train_epochs": training.num_train_epochs}


