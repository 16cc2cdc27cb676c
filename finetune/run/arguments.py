"""The run's configuration: a recipe YAML plus command-line overrides, parsed by TRL into its dataclasses and
finetune's own arguments (`parse_args` reads and changes nothing), and `apply_to_process`, the one step that changes
the process. The checks that follow the parse are in finetune/checks/.

Every user mistake found here ends as a `UserError` whose message is one sentence naming the file, the field and the
fix; `scripts/sft.py` prints it and exits non-zero without a traceback.
"""

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

from finetune import patches
from finetune.checks import launch as accelerate_checks
from finetune.config import numbers
from finetune.config.files import RENAMED_KEYS, read_foreign_keys, read_recipe, refuse_unknown_keys, shipped
from finetune.config.launch_request import (
    FSDP_V1_REFUSAL,
    ExportedLaunch,
    deepspeed_config_to_train,
    deepspeed_json_read,
    read_exported_launch,
    with_deepspeed_argument,
)
from finetune.config.schema import CHECKPOINTING_NAMES
from finetune.data.load import looks_local
from finetune.errors import UserError, one_sentence, say
from finetune.json_files import write_atomically
from finetune.models import compilation, cpu
from finetune.models.tiny import TINY_WIDTH
from finetune.run import saving, tracking

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
    compile_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Where torch keeps what it compiles (Inductor's graphs, AOTAutograd's, Triton's kernels), so "
                          "that the next launch on this machine loads them instead of compiling: FINETUNE_COMPILE_CACHE "
                          "or ~/.cache/finetune/compile unless set (finetune/compile_cache.py)."},
    )
    dequantize_mxfp4: bool = field(
        default=True,
        metadata={"help": "MXFP4 checkpoints (openai/gpt-oss-*): true dequantizes the experts to the training dtype "
                          "on load; false keeps them resident in MXFP4 on the GPU (a quarter of the memory) and "
                          "dequantizes each layer's just before its GEMMs (bit-equal weights), or, where the experts "
                          "get few rows each, decodes them inside the GEMM (equal up to the order of the sums) "
                          "(finetune/models/mxfp4_experts.py; one process, expert_lora_kernel: grouped)."},
    )
    resume_with_new_schedule: bool = field(
        default=False,
        metadata={"help": "Resuming with another learning_rate, lr_scheduler_type or warmup: apply them from the "
                          "resumed step (otherwise such a relaunch is refused: the checkpoint's rate would win)."},
    )
    replace_finished_model: bool = field(
        default=False,
        metadata={"help": "Relaunching a finished run to train longer when it saved no checkpoint (save_strategy "
                          "no): train again from step 0 and replace its final model (otherwise refused)."},
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
    flags: set[str]  # the keys set on the command line (a flag wins over the recipe): where a setting came from
    env: dict[str, str] = field(default_factory=dict)
    data_sources: dict = field(default_factory=dict)  # rows taken from each dataset, filled when the data loads
    data_fingerprint: str | None = None  # the training rows' count and hash (finetune/checks/resume.py), once they load
    # On a relaunch, found by check_output_dir: the settings the output folder's run record keeps, and the checkpoint
    # this launch resumes from
    recorded_settings: dict = field(default_factory=dict)
    resumes_from: Path | None = None
    launch: ExportedLaunch = field(default_factory=read_exported_launch)  # what the launcher asked for, read once
    recipe: dict = field(default_factory=dict)  # the recipe's keys as read (in finetune's names), before CPU overrides

    def source_of(self, key: str) -> str:
        """Where a setting came from, for a message: its command-line flag when one was given, else the recipe."""
        return f"command line (--{key})" if key in self.flags else self.recipe_path or "command line"


def _flag_error(message: str):
    raise UserError(f"command line: {message}; fix that flag (see `scripts/sft.py --help`).")


class _Parser(TrlParser):
    """TRL's parser, with argparse's own message raised as the one sentence instead of printed with usage text."""

    def error(self, message: str):
        _flag_error(message)


def _parser() -> TrlParser:
    return _Parser((ScriptArguments, SFTConfig, ModelConfig, FinetuneArguments))


def _refuse_unknown_keys(parser: TrlParser, recipe: dict, recipe_path: str) -> None:
    refuse_unknown_keys(recipe, _recipe_keys(parser), recipe_path)


def _coerce_recipe_values(parser: TrlParser, recipe: dict, recipe_path: str, refuse) -> dict:
    """Give each recipe value the type argparse would have given it on the command line; a value that cannot have it
    is refused (`refuse`) and left out.

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
                typed = [action.type(str(item)) for item in values]
            else:
                typed = action.type(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            type_name = getattr(action.type, "__name__", str(action.type))
            refuse(UserError(f"{recipe_path}: `{key}: {value}` is not a valid {type_name}; give it a value of that "
                             f"type."))
            continue
        if action.choices is not None and typed not in action.choices:
            refuse(UserError(f"{recipe_path}: `{key}: {value}` is not one of {sorted(map(str, action.choices))}; pick "
                             f"one of them."))
            continue
        coerced[key] = typed
    return coerced


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


def parse_args(argv: list[str] | None = None, found: list[UserError] | None = None) -> RunConfig:
    """Parse the recipe and the command line into TRL's dataclasses and finetune's own arguments. Reads files and the
    environment, writes nothing: `apply_to_process` is the step that changes the process.

    A run stops at the first problem. Given `found` (`finetune check`), each problem that leaves the rest readable (an
    unknown key or flag, a value of the wrong type or out of range) is added there instead, the setting left out, and
    the parse goes on; one that does not is raised."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = list(DEFAULT_ARGS)
    parser = _parser()

    def refuse(problem: UserError) -> None:
        if found is None:
            raise problem
        found.append(problem)

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
        try:
            _refuse_unknown_keys(parser, recipe, recipe_path)
        except UserError as problem:
            refuse(problem)
            recipe = {key: value for key, value in recipe.items() if key in _recipe_keys(parser)}
        recipe = _coerce_recipe_values(parser, recipe, recipe_path, refuse)
        env = {key: str(value) for key, value in (recipe.pop("env", None) or {}).items()}
        parser.set_defaults(**recipe)
    if cpu.on_cpu():
        given = _flags_given(argv)  # a flag on the command line still wins over the CPU's value
        parser.set_defaults(**cpu.cpu_overrides({key: value for key, value in recipe.items() if key not in given}))

    for flag in [arg for arg in argv if arg.startswith("--") and arg[2:].split("=", 1)[0] not in _known_dests(parser)]:
        old_name = flag[2:].split("=", 1)[0]
        renamed = f" (now --{RENAMED_KEYS[old_name]})" if old_name in RENAMED_KEYS else ""
        refuse(UserError(f"command line: unknown flag {flag}{renamed}; check its spelling with `scripts/sft.py "
                         f"--help`."))
        argv = _without_flag(argv, flag)
    # read once here, before TrainingArguments reads a DeepSpeed JSON and fails in its own words, and carried
    launch = read_exported_launch()
    accelerate_checks.check_transformers_strategy_arguments(_flags_given(argv), set(recipe), recipe_path)
    if launch.strategy == "fsdp" and os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError(f"{launch.config_file}: {FSDP_V1_REFUSAL}")  # before the CPU shim builds FSDP1's plugin
    values, _ = parser.parse_known_args(args=argv)  # as given, before the dataclasses' __post_init__ reads them
    deepspeed_source = "command line" if "deepspeed" in _flags_given(argv) else recipe_path
    launch = with_deepspeed_argument(launch, _deepspeed_asked(values.deepspeed, deepspeed_source), deepspeed_source)
    to_train = deepspeed_config_to_train(launch)
    if to_train is not None:  # carried: the training arguments never read the JSON again
        parser.set_defaults(deepspeed=to_train)
        argv = _without_flag(argv, "--deepspeed")
    while_parsing = {**(cpu.CPU_ENVIRONMENT if cpu.on_cpu() else {}),
                     **patches.nvme_paths_accelerate_does_not_export(launch.request)}
    script, training, model, finetune = _into_dataclasses(parser, argv, recipe, recipe_path, found, while_parsing)
    if model.lora_target_parameters == ["none"]:  # a list flag cannot be emptied on the command line
        model.lora_target_parameters = None
    if isinstance(model.lora_target_modules, str) and re.fullmatch(r"[\w.]+", model.lora_target_modules) and \
            model.lora_target_modules != "all-linear":
        # TRL's ModelConfig makes a list of one name that name alone, which peft reads as a pattern for the whole
        # module name (`q_proj` then matches no `model.layers.0.self_attn.q_proj`): the name is read as the list it was
        model.lora_target_modules = [model.lora_target_modules]
    if finetune.chat_template and training.chat_template_path:
        refuse(UserError(f"{recipe_path or 'command line'}: `chat_template` and `chat_template_path` both set the chat "
                         f"template; keep one of them."))
    _data_of_the_command_line(script, finetune, _flags_given(argv))
    if finetune.tiny:
        _scale_down_for_tiny(script, training, finetune, _flags_given(argv))
    return RunConfig(script, training, model, finetune, recipe_path, set(recipe) | _flags_given(argv),
                     _flags_given(argv), env, launch=launch, recipe=recipe)


def _into_dataclasses(parser: TrlParser, argv: list[str], recipe: dict, recipe_path: str | None,
                      found: list[UserError] | None, environment: dict[str, str]) -> tuple:
    """The parse into TRL's dataclasses and finetune's own, with `environment` set while the training arguments are
    built (they build accelerate's state and DeepSpeed plugin from it). Their __post_init__ fails on some numbers out
    of range in its own words (`save_steps: inf`: an OverflowError); the ranges say which number and what to give
    instead (the other numbers are checked on the built values: checks/recipe.py). Given `found`, those numbers are
    added there and left out, and the parse is tried again, so that the checks after the parse run too."""
    source = recipe_path or "command line"
    while True:
        values, _ = parser.parse_known_args(args=argv)  # as given, before the dataclasses' __post_init__ reads them
        try:
            with _environment_set(environment):
                return parser.parse_args_into_dataclasses(args=argv)
        except SystemExit:
            raise UserError("command line: a flag has a missing or invalid value; see the message above for "
                            "which.") from None
        except json.JSONDecodeError as error:  # a mapping field's JSON, read by the training arguments
            raise UserError(f"{source}: {_field_with_bad_json(argv, recipe)} is not valid JSON ({error.msg}); write "
                            f"it as a JSON object, e.g. '{{\"key\": 1}}'.") from None
        except (ValueError, OverflowError) as error:
            given = _flags_given(argv)
            out_of_range = numbers.range_problems(lambda key: getattr(values, key, None),
                                                  lambda key: f"command line (--{key})" if key in given else source)
            if found is None or not out_of_range:
                raise next(iter(out_of_range.values()), UserError(f"{source}: {one_sentence(error)}")) from None
            found.extend(out_of_range.values())
            defaults = _parser()
            parser.set_defaults(**{key: defaults.get_default(key) for key in out_of_range})
            for key in out_of_range:
                argv = _without_flag(argv, f"--{key}")


@contextlib.contextmanager
def _environment_set(values: dict[str, str]):
    """`values` in the environment for the time of the block, as it was afterwards: parsing changes nothing."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """The command line without `flag` (`--name` or `--name=value`) and the values that follow it."""
    name = flag.split("=", 1)[0]
    kept, skipping = [], False
    for arg in argv:
        if arg == flag or arg == name or arg.startswith(name + "="):
            skipping = arg == name
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        kept.append(arg)
    return kept


def _recipe_keys(parser: TrlParser) -> set[str]:
    return {action.dest for action in patches.parser_actions(parser)} | {"env"}


def _deepspeed_asked(value, source: str | None):
    """transformers' `deepspeed` as given: a path, a mapping, or a JSON object written in place (on the command line
    or as the recipe key's text), read as DeepSpeed reads its JSON (config/launch_request.deepspeed_json_read)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        named = "command line (--deepspeed)" if source == "command line" else f"{source} (`deepspeed`)"
        return deepspeed_json_read(value, named)
    return value


def apply_to_process(run: RunConfig) -> None:
    """The one step that changes the process for a run: the recipe's `env:` block, DeepSpeed, bitsandbytes,
    scikit-learn and scipy kept out where unused, regional compilation and inductor's activation budget, the MLflow
    run to continue, the CPU process group (FSDP over gloo), and the access token moved out of the arguments the
    Trainer saves."""
    os.environ.update(run.env)
    patches.skip_unused_deepspeed(run.training)
    patches.skip_unused_libraries(run.model, run.training)
    saving.die_with_launcher()
    compilation.prepare_process(run.training, run.finetune.compile_cache_dir)
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
    write_atomically(path, template)  # no process of the launch reads a half-written file
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
    """Data that names a local file or folder, there or not (a missing one is refused: checks/recipe.py
    check_data_found), rather than only hub datasets."""
    if finetune.dataset_mixture:
        paths = _mixture_paths(finetune.dataset_mixture)
        return paths is None or any(looks_local(path) for path in paths)
    return bool(script.dataset_name) and looks_local(script.dataset_name)


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


