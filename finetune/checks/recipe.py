"""The recipe's checks before anything loads: every number and setting against what the run can do, the launch
files against the recipe, the output folder against the run it would continue. `problems(run)` finds every problem,
each one sentence naming the file, the field and the fix; `check(run)` raises the first, which is what a run reports."""

import difflib
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

from finetune import compile_cache
from finetune.checks import launch as accelerate_checks
from finetune.checks import model_folder
from finetune.checks.relaunch import check_output_dir, check_resume_checkpoint
from finetune.config import numbers
from finetune.config.launch_request import blocks_giving_way
from finetune.errors import UserError, one_sentence, say
from finetune.models import cpu, fp8


def check(run) -> None:
    """Refuse contradictory settings before any model or dataset is loaded: the first problem, as one sentence."""
    for problem in problems(run):
        raise problem


def problems(run) -> Iterator[UserError]:
    """The problems the checks that need no model find, one sentence each, check by check and within a check every
    finding: a run stops at the first, `finetune check` prints them all. A check either raises its one problem or
    yields each of its findings (and may raise after them); a finding that depends on an earlier one's answer (the
    output folder on the resume checkpoint) stays behind it inside that check."""
    source = run.recipe_path or "command line"
    for one_check in RUN_CHECKS:
        try:
            yield from one_check(run, source) or ()
        except UserError as problem:
            yield problem


def each_refusal(*calls) -> Iterator[UserError]:
    """The refusal of each of these independent checks, `(function, *arguments)`, that has one."""
    for function, *arguments in calls:
        try:
            function(*arguments)
        except UserError as problem:
            yield problem


def check_model_named(run, source: str) -> None:
    name = run.model.model_name_or_path
    if not name:
        raise UserError(f"{source}: `model_name_or_path` is not set; give a hub id or a local folder.")
    if not run.finetune.tiny and name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise UserError(f"{name}: model folder not found; fix --model_name_or_path (a hub id or a local folder).")


def check_peft_settings(run, source: str) -> Iterator[UserError]:
    model = run.model
    if model.load_in_4bit and not model.use_peft:
        yield UserError(f"{source}: `load_in_4bit: true` (QLoRA) trains 4-bit weights only through LoRA; add "
                        f"`use_peft: true`.")
    lora_keys = sorted(key for key in run.explicit_keys if key.startswith("lora_") or key in ("use_rslora", "use_dora"))
    if lora_keys and not model.use_peft:
        yield UserError(
            f"{source}: `{lora_keys[0]}` is set but `use_peft` is false, so it would be ignored; "
            f"add `use_peft: true` or drop the LoRA settings."
        )


def check_quantization(run, source: str) -> Iterator[UserError]:
    model = run.model
    if model.load_in_4bit and model.load_in_8bit:
        yield UserError(f"{source}: `load_in_4bit` and `load_in_8bit` are both true; keep one of them.")
    strategy, strategy_source = strategy_asked(run)
    if model.load_in_4bit and strategy in ("fsdp", "zero3"):
        yield UserError(
            f"{strategy_source}: QLoRA's 4-bit weights cannot be "
            f"sharded by {strategy.upper()} here; launch with accelerate_configs/ddp.yaml or zero2.yaml instead."
        )
    yield from check_mxfp4(run, source)


def check_expert_targets(run, source: str) -> None:
    model = run.model
    if model.lora_target_parameters and not model_folder.family_of_run(run).experts:
        raise UserError(
            f"{source}: `lora_target_parameters` adapts mixture-of-experts weights, which "
            f"{model.model_name_or_path} does not have; remove it or use lora_target_modules."
        )


def check_memory_settings(run, source: str) -> None:
    if run.training.activation_offloading and cpu.on_cpu():  # a recipe's value is already off (cpu.cpu_overrides)
        raise UserError("command line: `--activation_offloading true` moves activations out of GPU memory and this "
                        "machine has no GPU; drop the flag here.")


def check_number_ranges(run, source: str) -> Iterator[UserError]:
    yield from numbers.number_problems(lambda key: run_value(run, key), run.source_of).values()


def check_attention_named(run, source: str) -> None:
    check_attention(run.model, run.source_of("attn_implementation"))


def check_packages(run, source: str) -> Iterator[UserError]:
    yield from each_refusal((check_optimizer_installed, run.training, source),
                            (check_mlflow_installed, run.training, source), (check_report_to, run.training, source),
                            (check_hub_push, run.training, source))


def check_launch(run, source: str) -> Iterator[UserError]:
    refused = False
    for refusal in each_refusal((accelerate_checks.check_run, run), (check_deepspeed_agrees, run)):
        refused = True
        yield refusal
    if not refused:  # DeepSpeed reads the zero_optimization block, which raises on one the checks refuse
        accelerate_checks.say_when_the_model_is_saved_partitioned(run)


def check_relaunch(run, source: str) -> None:
    check_resume_checkpoint(run)
    check_output_dir(run)


def check_data_found(run, source: str) -> Iterator[UserError]:
    """A data file or folder the recipe names that is not there, before anything loads: under --tiny the sample would
    otherwise stand in for it without a word, as for data from the hub. (A name that looks like a hub id is left to
    the load.)"""
    from finetune.data.load import looks_local

    mixture = run.finetune.dataset_mixture
    entries = mixture.get("datasets") if isinstance(mixture, dict) else None
    for entry in entries if isinstance(entries, list) else []:
        path = entry.get("path") or entry.get("id") if isinstance(entry, dict) else None
        if isinstance(path, str) and looks_local(path) and not Path(path).expanduser().exists():
            yield UserError(f"{path}: dataset file or folder not found (a `dataset_mixture` entry of "
                            f"{run.source_of('dataset_mixture')}); fix that entry's `{'path' if 'path' in entry else 'id'}` "
                            f"(a hub id, folder or file) or remove the entry.")
    name = run.script.dataset_name
    if not mixture and name and looks_local(name) and not Path(name).expanduser().exists():
        fix = "--dataset_name" if "dataset_name" in run.flags else f"`dataset_name` in {source}"
        yield UserError(f"{name}: dataset file or folder not found; fix {fix} (a hub id, folder or file).")


def check_trains_something(run, rows: int) -> None:
    """Once the training rows are counted (before the model): a run whose rows make one optimizer step under a warmup
    trains that step at learning rate 0, and would save an untrained model as if it had trained. (Packing only merges rows: a run
    that is one step unpacked is one step packed.)"""
    training = run.training
    if training.max_steps > 0:  # a step count asked for (a smoke run's `--max_steps 1`): the warmup notice says it
        return
    batches = math.ceil(rows / (training.per_device_train_batch_size * run.launch.world_size))
    steps = math.ceil(training.num_train_epochs * max(math.ceil(batches / training.gradient_accumulation_steps), 1))
    if steps == 1 and training.get_warmup_steps(steps) >= 1:
        raise UserError(f"{run.source_of('warmup_steps')}: `warmup_steps: {training.warmup_steps}` warms up over the "
                        f"run's only optimizer step ({rows} training rows in batches of "
                        f"{training.per_device_train_batch_size} × {training.gradient_accumulation_steps} accumulation "
                        f"× {run.launch.world_size} processes), which then trains at learning rate 0 and the run "
                        f"trains nothing; pass --warmup_steps 0, or train more steps (more rows, a smaller "
                        f"per_device_train_batch_size or more num_train_epochs).")


def check_compile_cache(run, source: str) -> None:
    """A compiled run's cache folder can be written: one its user named is refused, the default (a read-only home)
    gives way to torch's folder in /tmp, said in one line, since nothing the user set is wrong."""
    if not run.training.torch_compile:
        return
    unusable = compile_cache.unusable_compile_cache(run.finetune.compile_cache_dir)
    if unusable is None:
        return
    if unusable.named_by is None:
        say(f"compile caches: {unusable.folder} cannot be written ({unusable.reason}), so this launch compiles into "
            f"{compile_cache.inductor_cache()}, which later launches reuse only until /tmp is emptied; set "
            f"{compile_cache.COMPILE_CACHE_ENV} to a writable folder to keep them.")
        return
    named = (f"{run.source_of('compile_cache_dir')}: `compile_cache_dir: {run.finetune.compile_cache_dir}`"
             if unusable.named_by == "compile_cache_dir" else
             f"environment: {unusable.named_by}={os.environ[unusable.named_by]}")
    raise UserError(f"{named} names a compile cache folder that cannot be written ({unusable.folder}: "
                    f"{unusable.reason}); point it at a writable folder, or unset it to keep the caches in "
                    f"{compile_cache.default_compile_cache()}.")


def check_mlflow_installed(training, source: str) -> None:
    """Before anything loads: transformers would otherwise fail deep inside the Trainer's construction."""
    if "mlflow" in (training.report_to or []) and importlib.util.find_spec("mlflow") is None:
        raise UserError(
            f"{source}: `report_to: mlflow` needs the mlflow package, which is not installed; "
            f"pip install -e \".[mlflow]\" or drop mlflow from report_to."
        )


# transformers' reporting integrations that need a package of their own, and its name on PyPI (mlflow: run/tracking.py)
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


def check_chat_template(run, source: str) -> None:
    """TRL masks the loss to the answers with the template's {% generation %} markers, and fails after loading the
    model when a template it cannot rewrite has none."""
    from trl.chat_template_utils import has_generation_markers

    template = run.finetune.chat_template
    if template and run.training.assistant_only_loss and not has_generation_markers(template):
        raise UserError(f"{source}: `assistant_only_loss: true` needs {{% generation %}} markers around the answers in "
                        f"the recipe's `chat_template`, which has none; add them or set `assistant_only_loss: false`.")


def run_value(run, key: str):
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
            why = one_sentence(error).split(". ")[0].rstrip(".")
            optim = getattr(training.optim, "value", training.optim)
            raise UserError(f"{source}: `optim: {optim}` needs a package that is not installed ({why}); "
                            f"install it, or use `optim: adamw_torch`.") from None


def check_attention(model, source: str) -> None:
    """An attention implementation transformers knows (a kernel of its own, a `paged|` one, a hub kernel's id) or
    this toolkit's varlen kernel (models/attention.py)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from finetune.models.attention import VARLEN_ATTENTION

    known = ["eager", VARLEN_ATTENTION, *ALL_ATTENTION_FUNCTIONS.keys()]
    name = model.attn_implementation
    if name is None or "/" in name or name in known or name.removeprefix("paged|") in known:
        return
    raise UserError(f"{source}: `attn_implementation: {name}` is not an attention transformers knows; use one of "
                    f"{', '.join(dict.fromkeys(known))} or a hub kernel's id (org/name).")


def check_mxfp4(run, source: str) -> Iterator[UserError]:
    """An MXFP4 checkpoint (the recipe's, which --tiny stands in for) trains dequantized to the training dtype, or
    with its experts resident in MXFP4 in a single process through the grouped expert LoRA. Each refusal names the
    file or flag each setting came from."""
    from finetune.models import mxfp4

    name = run.model.model_name_or_path
    if not mxfp4.is_mxfp4_checkpoint(name):
        return
    resident = f"{run.source_of('dequantize_mxfp4')}: `dequantize_mxfp4: false`"
    if not run.finetune.dequantize_mxfp4:
        strategy, launched_by = run.launch.strategy, run.launch.config_file
        if strategy != "single" and run.launch.world_size > 1:
            yield UserError(f"{resident} keeps the experts resident in MXFP4 in one process only, and {launched_by} "
                            f"launches {run.launch.world_size} processes ({strategy}); launch one process (`--"
                            f"num_processes 1` with accelerate_configs/ddp.yaml) or set `dequantize_mxfp4: true`.")
        elif strategy != "single":
            yield UserError(f"{resident} keeps the experts resident in MXFP4 outside {strategy.upper()}'s sharding, "
                            f"which {launched_by} asks for; launch without that file (accelerate_configs/ddp.yaml "
                            f"with `--num_processes 1`) or set `dequantize_mxfp4: true`.")
        kernel = run.finetune.expert_lora_kernel
        if kernel != "grouped" and run.model.lora_target_parameters:
            yield UserError(f"{run.source_of('expert_lora_kernel')}: `expert_lora_kernel: {kernel}` adds B·A to the "
                            f"expert weights, which `dequantize_mxfp4: false` keeps packed in MXFP4 (set in "
                            f"{run.source_of('dequantize_mxfp4')}); use `expert_lora_kernel: grouped` or `dequantize_mxfp4: true`.")
    if run.model.load_in_4bit or run.model.load_in_8bit:
        flag = "load_in_4bit" if run.model.load_in_4bit else "load_in_8bit"
        yield UserError(
            f"{run.source_of(flag)}: `{flag}: true` asks bitsandbytes to quantize {name}, whose experts are already "
            f"MXFP4 and load dequantized; remove {flag} (LoRA on the bf16 model is the GPT-OSS recipe)."
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
# or schedule instead of the recipe's, without a word (an Adam/AdamW optimizer and any scheduler give way instead:
# config/launch_request.blocks_giving_way).
DEEPSPEED_BLOCKS = {"optimizer": "optim", "scheduler": "lr_scheduler_type"}


# An Adam/AdamW optimizer block's values as transformers fills them (HfTrainerDeepSpeedConfig.trainer_config_process),
# each from the recipe's keys
OPTIMIZER_PARAMS = {"lr": ("learning_rate",), "betas": ("adam_beta1", "adam_beta2"), "eps": ("adam_epsilon",),
                    "weight_decay": ("weight_decay",)}


def deepspeed_config_asked(run) -> tuple[str, dict] | None:
    """The DeepSpeed JSON the run trains with and where it is named, whichever way it arrives (an accelerate config's
    deepspeed_config_file, or transformers' own `deepspeed`: a flag or a recipe key holding a path or the JSON), as
    the launch read it once (config/launch_request.with_deepspeed_argument)."""
    if run.launch.deepspeed_config is None:
        return None
    return run.launch.deepspeed_file, run.launch.deepspeed_config


def strategy_asked(run) -> tuple[str, str]:
    """What the launch asks for (fsdp, zero1-3, ddp or single) and the file or field that asks for it."""
    return run.launch.strategy, run.launch.asked_by or run.launch.config_file


def check_deepspeed_agrees(run) -> None:
    """A DeepSpeed JSON, whichever way it arrives (deepspeed_config_asked), that asks for what DeepSpeed fails on or
    this toolkit does not run, hard-codes what the recipe decides (batch size, accumulation, clipping, bf16/fp16, the
    optimizer's values, which transformers compares only once the model is loaded), or brings an optimizer of its own:
    every problem at once, in one sentence naming both values. An Adam/AdamW optimizer block and a scheduler block
    give way to the recipe's, said in one line each."""
    asked = deepspeed_config_asked(run)
    if asked is None:
        return
    config_file, written = asked
    structural = accelerate_checks.deepspeed_json_problems(written)
    deepspeed = {**DEEPSPEED_UNSET, **written}
    training = run.training
    values = [f"`{key}: {_shown(deepspeed[key])}`{'' if key in written else ' (left out: accelerate sets it)'} "
              f"{_text_or(deepspeed[key], 'contradicts')} the recipe's `{recipe_key}: {getattr(training, recipe_key)}`"
              for key, recipe_key in DEEPSPEED_RECIPE_KEYS.items()
              if not _deepspeed_value_is(deepspeed.get(key, "auto"), getattr(training, recipe_key))]
    batch = training.per_device_train_batch_size * training.gradient_accumulation_steps * run.launch.world_size
    if not _deepspeed_value_is(deepspeed.get("train_batch_size", "auto"), batch):
        values.append(f"`train_batch_size: {_shown(deepspeed['train_batch_size'])}` "
                      f"{_text_or(deepspeed['train_batch_size'], 'is not')} the recipe's per-device batch × "
                      f"accumulation × processes, {batch}")
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
    giving_way = blocks_giving_way(written)
    values += _optimizer_contradictions(written, training) if "optimizer" in giving_way else []
    blocks = [f"its `{block}` block ({(deepspeed[block] or {}).get('type')}) would replace the recipe's "
              f"`{key}: {_value(getattr(training, key))}`"
              for block, key in DEEPSPEED_BLOCKS.items() if block in deepspeed and block not in giving_way]
    compiling = deepspeed.get("compile") or {}
    if compiling and not compiling.get("disable", False) and not training.torch_compile:  # DeepSpeed compiles only then
        blocks.append(f"its `compile` block ({compiling.get('backend', 'inductor')}) is ignored by a run that is not "
                      f"compiled (`torch_compile: false`)")
    if not values and not blocks and not structural:
        _say_what_gives_way(run, config_file, written, giving_way)
        return
    fixes = ([f"set {'them' if len(values) > 1 else 'it'} to \"auto\""] if values else []) + (
        [f"delete {'those blocks' if len(blocks) > 1 else 'that block'}"] if blocks else [])
    recipe_problems = [(_listed(values + blocks), f"{' and '.join(fixes)} so that the recipe decides")] \
        if values or blocks else []
    raise UserError(accelerate_checks.problems_sentence(config_file, structural + recipe_problems))


def _value(setting):
    return getattr(setting, "value", setting)


def _optimizer_contradictions(written: dict, training) -> list[str]:
    """An Adam/AdamW block's values that are neither "auto" nor the recipe's (transformers refuses them after loading)."""
    params = (written["optimizer"].get("params") or {})
    found = []
    for name, recipe_keys in OPTIMIZER_PARAMS.items():
        value, wanted = params.get(name, "auto"), [getattr(training, key) for key in recipe_keys]
        agrees = value == "auto" or (isinstance(value, list) and len(value) == len(wanted) and all(
            _deepspeed_value_is(one, other) for one, other in zip(value, wanted))) or \
            (len(wanted) == 1 and _deepspeed_value_is(value, wanted[0]))
        if not agrees:
            shown = wanted[0] if len(wanted) == 1 else wanted
            found.append(f"`optimizer.params.{name}: {json.dumps(value)}` contradicts the recipe's "
                         f"`{' and '.join(recipe_keys)}: {shown}`")
    return found


def _say_what_gives_way(run, config_file: str, written: dict, giving_way: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    training = run.training
    if "optimizer" in giving_way:
        say(f"{config_file}: its `optimizer` block ({written['optimizer'].get('type')}) gives way to the recipe's "
            f"`optim: {_value(training.optim)}` at the recipe's learning rate, betas, epsilon and weight decay"
            f"{', as DeepSpeed CPU Adam under its optimizer offload' if _offloads_optimizer(written) else ''}")
    if "scheduler" in giving_way:
        say(f"{config_file}: its `scheduler` block ({written['scheduler'].get('type')}) gives way to the recipe's "
            f"`lr_scheduler_type: {_value(training.lr_scheduler_type)}` with its warmup")


def _offloads_optimizer(written: dict) -> bool:
    offload = written["zero_optimization"].get("offload_optimizer")
    return isinstance(offload, dict) and offload.get("device") in ("cpu", "nvme")


def _deepspeed_value_is(value, wanted) -> bool:
    """A JSON value agrees with the recipe's when it is "auto" or the same number, written as a number: transformers
    compares "2" with 2 as different and stops on it once the model is loaded."""
    if isinstance(value, str):
        return value == "auto"
    try:
        return float(value) == float(wanted)
    except (TypeError, ValueError):
        return False


def _shown(value) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value)


def _text_or(value, verb: str) -> str:
    """How a value that disagrees with the recipe's is said to: a number written as text is named as such."""
    return "is text, which transformers compares as unequal to" if isinstance(value, str) else verb


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


# In the order a run meets them: the first problem found is the one a run reports.
RUN_CHECKS = (
    check_model_named,
    check_peft_settings,
    check_memory_settings,
    check_quantization,
    check_expert_targets,
    check_number_ranges,
    check_attention_named,
    check_data_found,
    check_packages,
    check_chat_template,
    check_compile_cache,
    fp8.check,
    check_launch,
    check_relaunch,
)
