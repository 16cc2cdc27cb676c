"""An accelerate config file from anywhere (TRL's, accelerate's examples, alignment-handbook's) either runs as it says
or is refused in one sentence before the model loads, under `finetune launch` and `accelerate launch` alike.

accelerate's launcher copies a file's fields into its arguments (a flag on its command line wins) and exports them to
the training processes. Some of them this toolkit does not run: context, sequence and tensor parallelism and HSDP
(`parallelism_config`), accelerate's own FP8, distributed types other than NO, MULTI_GPU, FSDP and DEEPSPEED, and
several processes under a launcher that starts one. Others the recipe overrides or contradicts: mixed precision,
DeepSpeed's accumulation and clipping, dynamo compilation, FSDP's activation checkpointing. The request, a file's
fields with the launcher's flags on top, is read from the launcher's arguments (config/launch_request.py): by
`finetune launch` from the command it is about to run, which it passes on to the training processes; in a training
process once, with the rest of the launch, and carried on the run. `check_request` needs only the request;
`check_run` also compares it with the parsed recipe.
"""

import json
import os
import sys
from pathlib import Path

from finetune import patches
from finetune.config.launch_request import (
    FIELDS_NOT_BESIDE_DEEPSPEED_FILE,
    LaunchRequest,
    blocks_giving_way,
    fields_beside_deepspeed_file_refusal,
    launcher_parser,
    read_deepspeed_config,
    request_from_command,
)
from finetune.errors import UserError, say
from finetune.models import cpu

RUNNABLE_TYPES = ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED")


# accelerate's launcher starts one process for these, whatever num_processes says (several CPU ones only via mpirun)
ONE_PROCESS_TYPES = ("NO", "MULTI_CPU")


PARALLELISM_PREFIX = "parallelism_config_"


# Each parallelism a size above 1 asks for, why this toolkit does not run it, and the file that trains without it.
NOT_RUN_HERE = {
    "cp": (("context parallelism (ring attention), which runs only with SDPA attention and plain causal masks, not "
            "the per-conversation attention of packed rows this toolkit trains with"), "accelerate_configs/fsdp.yaml"),
    "sp": ("ALST/Ulysses sequence parallelism, which this toolkit does not run", "accelerate_configs/zero3.yaml"),
    "tp": ("tensor parallelism, which this toolkit does not run", "accelerate_configs/fsdp.yaml"),
    "dp_replicate": ("HSDP (shards replicated over groups of processes), which this toolkit does not run",
                     "accelerate_configs/fsdp.yaml"),
}


# transformers' training arguments that would pick the strategy or the process group apart from the accelerate config
# (the one file that decides them here): `fsdp` wraps the model in FSDP version 1 from inside the Trainer, and
# `ddp_backend` sets up a process group of its own (without a launcher: transformers' own traceback)
TRANSFORMERS_STRATEGY_ARGUMENTS = {
    "fsdp": ("asks transformers for FSDP version 1 apart from the accelerate config, which picks the strategy here; "
             "remove it and launch with --config_file accelerate_configs/fsdp.yaml (FSDP2)"),
    "fsdp_config": ("configures transformers' own FSDP apart from the accelerate config, which picks the strategy "
                    "here; remove it and set FSDP's fields in the accelerate config (accelerate_configs/fsdp.yaml)"),
    "ddp_backend": ("sets the process group's backend, which the launcher picks (NCCL on GPUs, gloo on a CPU); "
                    "remove it"),
}


def check_transformers_strategy_arguments(flags: set[str], recipe_keys: set[str], recipe_path: str | None) -> None:
    """A strategy asked for through transformers' own training arguments, on the command line or in the recipe."""
    for name, why in TRANSFORMERS_STRATEGY_ARGUMENTS.items():
        if name in flags or name in recipe_keys:
            source = "command line" if name in flags else recipe_path
            raise UserError(f"{source}: `{name}` {why}.")


def check_request(request: LaunchRequest, processes: int, check_json: bool = True) -> list[str]:
    """Refuse what this toolkit cannot run as the request asks, for `processes` processes in all; returns the notes
    to print about fields that are ignored. A training process leaves the DeepSpeed JSON (`check_json`) to the check
    that compares the JSON it carries with the recipe (checks/recipe.py), which names all of its problems at once."""
    kind = request.distributed_type()
    if kind not in RUNNABLE_TYPES + ONE_PROCESS_TYPES:
        raise UserError(f"{request.source}: `distributed_type: {kind}` is not one this toolkit trains with (NVIDIA "
                        f"GPUs or the CPU); use MULTI_GPU (DDP), FSDP or DEEPSPEED, as accelerate_configs/*.yaml do.")
    if kind in RUNNABLE_TYPES[1:] and request.value("num_processes") is None:
        raise UserError(f"{request.source}: `num_processes` is not set, and accelerate needs it under "
                        f"`distributed_type: {kind}`; add `num_processes: N` (processes on all machines together) or "
                        f"pass --num_processes N.")
    notes = _one_process_launch(request, kind)
    if kind == "FSDP" and str(request.value("fsdp_offload_params", False)).lower() == "true" and cpu.on_cpu():
        raise UserError(f"{request.source}: {request.written('fsdp_offload_params')} moves FSDP2's parameters out of "
                        f"GPU memory and this machine has no GPU (torch's offload then stops at the first layer); set "
                        f"it to false here.")
    _check_machines(request)
    _check_parallelism(request, kind, processes)
    _check_fp8(request)
    deepspeed_file = request.value("deepspeed_config_file")
    if kind == "DEEPSPEED" and deepspeed_file:
        section = request.fields.get("deepspeed_config") or {}
        beside = [name for name in FIELDS_NOT_BESIDE_DEEPSPEED_FILE if name in section]
        if "mixed_precision" in request.fields and "mixed_precision" not in request.flags:
            beside.append("mixed_precision")
        if beside:
            raise fields_beside_deepspeed_file_refusal(request.source, deepspeed_file, beside)
        if check_json:
            check_deepspeed_json(read_deepspeed_config(deepspeed_file, request.source), deepspeed_file)
    elif kind == "DEEPSPEED":
        _check_zero_stage(request.value("zero_stage"), request.written("zero_stage"), request.source)
        _check_offload(request)
    return notes


# What each offload field of accelerate's launcher moves out of GPU memory, the lowest ZeRO stage that does it
# (DeepSpeed offloads parameters only under ZeRO-3, and optimizer states from ZeRO-1: below, it ignores the field
# without a word), and the field naming its NVMe folder, which accelerate's launcher does not pass on (patches.py,
# `nvme_paths_accelerate_does_not_export`)
OFFLOAD_FIELDS = {"offload_param_device": ("parameters", 3, "offload_param_nvme_path"),
                  "offload_optimizer_device": ("optimizer states", 1, "offload_optimizer_nvme_path")}


def _check_offload(request: LaunchRequest) -> None:
    """The offload of a DeepSpeed launch without a JSON (flags or a config file's deepspeed_config fields, read as
    accelerate's DeepSpeedPlugin reads them) that DeepSpeed would ignore, or fail on once the model is loaded."""
    stage = request.value("zero_stage", 2)  # accelerate's default
    for field, (part, lowest, path_field) in OFFLOAD_FIELDS.items():
        device = str(request.value(field) or "none").lower()
        written = request.written(field)
        if device not in ("none", "cpu", "nvme"):
            raise UserError(f"{request.source}: {written} is not a device DeepSpeed offloads to (it fails on it once "
                            f"the model is loaded); set {request.named(field)} to cpu, nvme or none.")
        if device != "none" and stage < lowest:
            trains = request.written("zero_stage") if request.value("zero_stage") is not None else \
                "accelerate's default"
            raise UserError(f"{request.source}: {written} offloads the {part} only from ZeRO-{lowest} on, and this "
                            f"launch trains ZeRO-{stage} ({trains}), where DeepSpeed would ignore it; add --zero_stage "
                            f"{max(lowest, 2)} to the accelerate launch command or remove {written}.")
        problem = _nvme_problem_of(written, request.named(path_field), request.value(path_field),
                                   f"set {request.named(field)} to `cpu`") if device == "nvme" else None
        if problem:
            raise UserError(f"{request.source}: {problem[0]}; {problem[1]}.")


# DeepSpeed's names of the setting that gathers ZeRO-3's partitioned weights into one 16-bit model when it saves: its
# JSON key, its config model's own field name (axolotl's JSONs) and its old fp16 name (transformers' test JSONs), which
# DeepSpeed refuses beside the current one
GATHER_KEYS = ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
               "stage3_gather_fp16_weights_on_model_save")


def saves_partitioned_model(run) -> bool:
    """A full fine-tune under ZeRO-3 whose DeepSpeed config, as accelerate completed it (an "auto" filled from the
    launcher's --zero3_save_16bit_model) and DeepSpeed reads it, does not gather the weights when it saves:
    transformers then writes DeepSpeed's partitioned checkpoint in place of model.safetensors. A LoRA adapter is
    gathered either way (transformers gathers the trainable weights of a peft model under ZeRO-3 itself)."""
    plugin = run.training.deepspeed_plugin
    if run.model.use_peft or run.launch.strategy != "zero3" or plugin is None:
        return False
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return not DeepSpeedZeroConfig(**plugin.deepspeed_config["zero_optimization"]).gather_16bit_weights_on_model_save


def gather_left_off(launch) -> tuple[str, str]:
    """Where the launch leaves ZeRO-3's gather at save off, in the words the user wrote it, and the fix that turns it
    on: the DeepSpeed JSON's key under the name it uses, else accelerate's --zero3_save_16bit_model (a flag, or a
    field under an accelerate config's deepspeed_config)."""
    if launch.deepspeed_config is not None:
        zero = launch.deepspeed_config["zero_optimization"]
        key = next((name for name in GATHER_KEYS if name in zero), GATHER_KEYS[0])
        written = f"`zero_optimization.{key}: {json.dumps(zero[key])}`" if key in zero else \
            f"no `zero_optimization.{key}`"
        if zero.get(key) == "auto":
            written += " without --zero3_save_16bit_model true"
        return f"{launch.deepspeed_file} sets {written}", f"set \"{key}\": true under zero_optimization there"
    request, name = launch.request or LaunchRequest(None, {}, {}), "zero3_save_16bit_model"
    written = request.written(name) if request.value(name) is not None else f"no {request.named(name)}"
    if request.named(name).startswith("`--"):
        return (f"{request.source} passes {written}",
                "pass --zero3_save_16bit_model true to the accelerate launch command")
    return f"{request.source} sets {written}", "set `zero3_save_16bit_model: true` under deepspeed_config there"


def say_when_the_model_is_saved_partitioned(run) -> None:
    """Said before loading, where a full ZeRO-3 fine-tune will end without a model that loads: a sharded save is
    legitimate (a model too large to gather in one process), so it is not refused."""
    if saves_partitioned_model(run):
        setting, fix = gather_left_off(run.launch)
        say(f"{setting}: ZeRO-3 then saves the final model as DeepSpeed's partitioned checkpoint (global_stepN/), not "
            f"model.safetensors, and chat, generate, eval and merge cannot load it; {fix} to save the model itself.")


def _check_machines(request: LaunchRequest) -> None:
    """A machine rank outside the machines launched waits for a rendezvous that never completes: a hang, not an
    error."""
    rank, machines = request.value("machine_rank"), request.value("num_machines") or 1
    if isinstance(rank, int) and isinstance(machines, int) and not 0 <= rank < machines:
        raise UserError(f"{request.source}: {request.written('machine_rank')} is not one of the {machines} machines "
                        f"launched (ranks 0 to {machines - 1}), and the launch would wait for them forever; give each "
                        f"machine its own rank from 0.")


def _check_zero_stage(stage, written: str, source: str) -> None:
    problem = _zero_stage_problem(stage, written)
    if problem:
        raise UserError(f"{source}: {problem[0]}; {problem[1]}.")


def _zero_stage_problem(stage, written: str) -> tuple[str, str] | None:
    if isinstance(stage, str) and stage.strip() in ("0", "1", "2", "3"):
        return (f"{written} is text (DeepSpeed reads either, but accelerate and transformers compare the stage with a "
                f"number and would not run that stage's loading and saving)",
                f"write the number {stage.strip()} without quotes")
    if stage is not None and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        return (f"{written} is no ZeRO stage (DeepSpeed has 0 to 3, and fails on another after the model has loaded)",
                "use 2 or 3, as accelerate_configs/zero2.yaml and zero3.yaml do")
    return None


def check_deepspeed_json(values: dict, file: str) -> None:
    """Every problem of a DeepSpeed JSON (read by read_deepspeed_config) that DeepSpeed would fail on after the model
    has loaded, or that this toolkit does not run, in one sentence (deepspeed_json_problems)."""
    problems = deepspeed_json_problems(values)
    if problems:
        raise UserError(problems_sentence(file, problems))


def problems_sentence(file: str, problems: list[tuple[str, str]]) -> str:
    """Problems of one file in one sentence, in the words of its keys, each followed by its fix."""
    if len(problems) == 1:
        return f"{file}: {problems[0][0]}; {problems[0][1]}."
    listed = "; ".join(f"({number}) {what}: {fix}" for number, (what, fix) in enumerate(problems, 1))
    return f"{file}: {len(problems)} problems, each with its fix; {listed}."


def deepspeed_json_problems(values: dict) -> list[tuple[str, str]]:
    """What a DeepSpeed JSON (an object with a zero_optimization object) asks for that DeepSpeed would fail on after
    the model has loaded, or that this toolkit does not run (AutoTP's tensor parallelism): every (problem, fix)."""
    zero = values["zero_optimization"]
    problems = [_zero_stage_problem(zero.get("stage"), f"`zero_optimization.stage: {json.dumps(zero.get('stage'))}`")]
    if "bfloat16" in values:
        problems.append(("`bfloat16` is DeepSpeed's old name of the `bf16` block, which transformers fills from the "
                         "recipe only under its current name (an \"auto\" left there fails after loading)",
                         "rename it to `bf16`"))
    problems += _zero_field_problems(zero)
    for offload in ("offload_optimizer", "offload_param"):
        if isinstance(zero.get(offload), dict) and zero[offload].get("device") == "nvme":
            problems.append(_nvme_problem(offload, zero[offload].get("nvme_path")))
    dropped = ("bfloat16", *blocks_giving_way(values))  # refused above with the name to write; left out of the run
    unfilled = [key for key in _auto_keys(values) if key not in FILLED_FROM_THE_RUN and
                key.split(".")[0] not in dropped]
    if unfilled:
        listed = ", ".join(f"`{key}: \"auto\"`" for key in unfilled)
        problems.append((f"{listed} {'is a value' if len(unfilled) == 1 else 'are values'} that neither transformers "
                         f"nor accelerate fill from the run (accelerate stops on an \"auto\" it cannot fill, after "
                         f"loading)", f"remove {'it' if len(unfilled) == 1 else 'them'} (DeepSpeed's default then "
                         f"holds) or write a number"))
    if isinstance(zero.get("zenflow"), dict):
        problems.append(("`zero_optimization.zenflow` asks for DeepSpeed's ZenFlow, which builds its own optimizer from "
                         "the JSON's `optimizer` block (that block gives way to the recipe's optimizer here)",
                         "remove the zenflow block"))
    tensor_parallel = values.get("tensor_parallel")
    size = tensor_parallel.get("autotp_size", 1) if isinstance(tensor_parallel, dict) else 1
    if not isinstance(size, int) or size > 1:
        problems.append((f"`tensor_parallel.autotp_size: {size}` asks for DeepSpeed's tensor parallelism (AutoTP), "
                         f"which this toolkit does not run", "remove the tensor_parallel block"))
    return [problem for problem in problems if problem]


def _zero_field_problems(zero: dict) -> list[tuple[str, str]]:
    """`zero_optimization` read by DeepSpeed's own config model (its keys and their types), where DeepSpeed imports
    on this machine; DeepSpeed would otherwise refuse it only once the model is loaded."""
    if sys.modules.get("deepspeed", False) is None:  # hidden by an earlier run of this process that did not use it
        del sys.modules["deepspeed"]  # (patches.skip_unused_deepspeed); this run asks for it
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError
    except ImportError:  # no DeepSpeed here: the launch fails on that itself
        return []
    try:
        DeepSpeedZeroConfig(**zero)
    except ValidationError as error:
        problems = []
        for problem in error.errors():
            where = ".".join(str(part) for part in problem["loc"])
            fix = "remove it or fix its spelling" if problem["type"] == "extra_forbidden" else "fix its value"
            problems.append((f"`zero_optimization.{where}` {problem['msg'].lower()} (DeepSpeed's config model)", fix))
        return problems
    return []


# The "auto" values the run fills: transformers from the training arguments (HfTrainerDeepSpeedConfig's
# trainer_config_process and trainer_config_finalize), accelerate from its plugin and the model
# (DeepSpeedPlugin.__post_init__, Accelerator._prepare_deepspeed); accelerate raises on any other "auto" after loading
FILLED_FROM_THE_RUN = {
    "train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "amp.enabled", "amp.opt_level",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "zero_optimization.stage", "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.nvme_path", "zero_optimization.offload_param.nvme_path",
}


def _auto_keys(values: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a JSON's "auto" values, in the file's order."""
    found = []
    for key, value in values.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(f"{prefix}{key}")
    return found


def _nvme_problem(offload: str, folder) -> tuple[str, str] | None:
    """A JSON's NVMe offload (`offload`: offload_param or offload_optimizer) that cannot run here (_nvme_problem_of)."""
    return _nvme_problem_of(f"`zero_optimization.{offload}.device: nvme`", "`nvme_path`", folder,
                            f"set `zero_optimization.{offload}.device` to `cpu`")


def _nvme_problem_of(asking: str, path_field: str, folder, to_cpu: str) -> tuple[str, str] | None:
    """NVMe offload needs a folder on this machine for DeepSpeed's swap files and DeepSpeed's async_io op; DeepSpeed
    fails on either only once the model is loaded (a folder it can create, it creates wherever the path points).
    `asking` is the setting as written, `path_field` the folder's, `to_cpu` the fix that offloads to CPU memory."""
    lacking = []
    if not folder or not Path(str(folder)).is_dir():
        where = f"{folder} is not a folder on this machine" if folder else "not set"
        lacking.append(f"a folder for its swap files at {path_field} ({where})")
    if not _async_io_loads():
        lacking.append("DeepSpeed's async_io op, which cannot load here (libaio missing: `apt install libaio-dev`, "
                       "then reinstall deepspeed)")
    if not lacking:
        return None
    return (f"{asking} needs {' and '.join(lacking)}",
            f"{to_cpu} (or create that folder on a local NVMe drive)" if len(lacking) == 1 and "folder" in lacking[0]
            else to_cpu)


def _async_io_loads() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _one_process_launch(request: LaunchRequest, kind: str) -> list[str]:
    """accelerate starts one process under NO, MULTI_CPU (without mpirun) or --cpu, whatever num_processes asks."""
    asked = request.value("num_processes")
    if kind not in ONE_PROCESS_TYPES or not isinstance(asked, int) or asked <= 1:
        return []
    written = request.written("num_processes")
    if kind == "NO" and "num_processes" not in request.flags and "distributed_type" in request.fields:
        # a file that says NO, as TRL's single_gpu.yaml does beside `num_processes: 8`: one process is what it asks for
        return [f"{request.source}: {written} is ignored under `distributed_type: NO`: one process trains"]
    why = "`--cpu`" if request.flags.get("cpu") else f"`distributed_type: {kind}`" if request.file else \
        "no accelerate config file, on a machine without several GPUs"
    if kind == "MULTI_CPU":
        why += " (accelerate starts several CPU processes only through mpirun)"
    raise UserError(f"{request.source}: {written} starts one process under {why}; launch with a MULTI_GPU file such as "
                    f"accelerate_configs/ddp.yaml, which runs {asked} processes on GPUs or on the CPU.")


def _check_parallelism(request: LaunchRequest, kind: str, processes: int) -> None:
    section = request.fields.get("parallelism_config") or {}
    if not isinstance(section, dict):
        raise UserError(f"{request.source}: `parallelism_config` must be a mapping of parallelism_config_* fields; "
                        f"rewrite it as one or remove it.")
    known = {action.dest for action in patches.parser_actions(launcher_parser())
             if action.dest.startswith(PARALLELISM_PREFIX)}
    for key in section:
        if key not in known:
            hint = f"`{PARALLELISM_PREFIX}{key}`" if PARALLELISM_PREFIX + key in known else "one of " + ", ".join(
                sorted(known))
            raise UserError(f"{request.source}: `{key}` under parallelism_config is not a field accelerate reads, so "
                            f"it would be ignored; name it {hint}.")
    sizes = {}
    for dimension in ("cp", "sp", "tp", "dp_replicate", "dp_shard"):
        name = f"{PARALLELISM_PREFIX}{dimension}_size"
        size = request.value(name, 1)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UserError(f"{request.source}: {request.written(name)} must be a whole number of at least 1; fix it.")
        sizes[dimension] = size
    for dimension, (what, instead) in NOT_RUN_HERE.items():
        if sizes[dimension] > 1:
            written = request.written(f"{PARALLELISM_PREFIX}{dimension}_size")
            raise UserError(f"{request.source}: {written} asks for {what}; remove the parallelism_config block to "
                            f"train as {instead} does.")
    exported = bool(section) or any(name.startswith(PARALLELISM_PREFIX) for name in request.flags)
    shard = request.written(f"{PARALLELISM_PREFIX}dp_shard_size")
    if sizes["dp_shard"] > 1 and kind != "FSDP":
        raise UserError(f"{request.source}: {shard} shards the model with FSDP2, but the file's distributed_type is "
                        f"{kind}; remove the parallelism_config block.")
    if exported and kind == "FSDP" and sizes["dp_shard"] != processes:
        raise UserError(f"{request.source}: {shard} does not match the {processes} processes launched (FSDP2 shards "
                        f"over all of them here); set it to {processes} or remove the parallelism_config block.")


def _check_fp8(request: LaunchRequest) -> None:
    precision = str(request.value("mixed_precision") or "no").lower()
    fp8_config = request.fields.get("fp8_config") or {}
    if precision != "fp8" and not fp8_config and "fp8_backend" not in request.flags:
        return
    written = request.written("mixed_precision") if precision == "fp8" else "`fp8_config`"
    backend = request.value("fp8_backend") or "Transformer Engine, MS-AMP or torchao"
    raise UserError(f"{request.source}: {written} asks for accelerate's FP8 ({backend}), which this toolkit does not "
                    f"use; remove mixed_precision: fp8 and fp8_config from that file and set `fp8: true` in the recipe "
                    f"(float8 through torchao, finetune/models/fp8.py).")


def check_run(run) -> None:
    """The request of the `accelerate launch` that started this process (read once with the launch, carried on the
    run), checked and compared with the parsed recipe before anything loads; its notes printed once."""
    request = run.launch.request
    if request is None:
        return
    notes = check_request(request, launched_processes(), check_json=False)
    notes += _precision_contradiction(request, run)
    kind = request.distributed_type()
    if kind == "DEEPSPEED":
        _check_deepspeed_fields(request, run.training)
    notes += _compilation_contradiction(request, run.training)
    if kind == "FSDP" and str(request.value("fsdp_activation_checkpointing", False)).lower() == "true" and \
            _checkpointing(run.training):
        raise UserError(f"{request.source}: `fsdp_activation_checkpointing: true` and the recipe's "
                        f"`gradient_checkpointing: true` both checkpoint the layers, which transformers refuses; set "
                        f"one of them to false.")
    if int(os.environ.get("RANK", "0")) == 0:
        for note in notes:
            say(f"{note}")


def launched_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _checkpointing(training) -> bool:
    return bool(getattr(training, "activation_checkpointing", False)
                or getattr(training, "gradient_checkpointing", False))


def asked_precision(run) -> str:
    """bf16, fp16 or no: what the recipe and the command line ask for. On a machine without a GPU, which trains in
    float32 whatever they say, the recipe's value as written (TRL's default: bf16 unless fp16)."""
    training = run.training
    bf16, fp16 = bool(training.bf16), bool(training.fp16)
    if cpu.on_cpu() and not (bf16 or fp16) and not {"bf16", "fp16"} & set(getattr(run, "flags", ())):
        written = run.recipe  # as the parse read it: axolotl's `bf16: auto` is already true there
        fp16 = written.get("fp16") is True
        bf16 = written.get("bf16", not fp16) is True
    return "bf16" if bf16 else "fp16" if fp16 else "no"


def _precision_contradiction(request: LaunchRequest, run) -> list[str]:
    """The Trainer takes the recipe's bf16/fp16 over the file's mixed_precision, and the file's only when the recipe
    asks for neither: a file naming another precision is refused; `no`, accelerate's default answer, is noted."""
    written = request.value("mixed_precision")
    if written is None:
        return []
    written, asked = str(written).lower(), asked_precision(run)
    if written == asked:
        return []
    if written == "no":
        return [(f"{request.source}: {request.written('mixed_precision')} gives way to the recipe's `{asked}: true`, "
                 f"which runs")]
    recipe_says = f"`{asked}: true`" if asked != "no" else "`bf16: false`"
    raise UserError(f"{request.source}: {request.written('mixed_precision')} contradicts the recipe's {recipe_says}; "
                    f"set it to '{asked}' or remove it, so that one precision is asked for.")


def _check_deepspeed_fields(request: LaunchRequest, training) -> None:
    """DeepSpeed's accumulation and clipping from the accelerate file (without a JSON) must be the recipe's:
    transformers compares them once the model is loaded and stops there."""
    for name, recipe_key in (("gradient_accumulation_steps", "gradient_accumulation_steps"),
                             ("gradient_clipping", "max_grad_norm")):
        value, wanted = request.value(name), getattr(training, recipe_key)
        if value is None or str(value) == "auto":
            continue
        try:
            agrees = float(value) == float(wanted)
        except (TypeError, ValueError):
            agrees = False
        if not agrees:
            where = " under deepspeed_config" if name not in request.flags else ""
            raise UserError(f"{request.source}: {request.written(name)}{where} contradicts the recipe's "
                            f"`{recipe_key}: {wanted}`; remove it so that the recipe decides, or make the two equal.")


def _compilation_contradiction(request: LaunchRequest, training) -> list[str]:
    """A dynamo backend in the file compiles the whole model in accelerate. This toolkit compiles through the recipe's
    torch_compile (finetune/models/compilation.py), and lets the file's dynamo_config decide only where it compiles the
    whole model itself: compiled, without checkpointing."""
    backend = str(request.value("dynamo_backend") or "no").upper()
    if backend == "NO":
        return []
    written = request.written("dynamo_backend")
    if not training.torch_compile:
        why = "no GPU here" if cpu.on_cpu() else "the recipe's `torch_compile: false`"
        raise UserError(f"{request.source}: {written} would compile the whole model of a run that is not compiled "
                        f"({why}); set it to 'NO', compiling is the recipe's `torch_compile`.")
    if _checkpointing(training):
        raise UserError(f"{request.source}: {written} would compile the whole model around the checkpointed layers "
                        f"that `torch_compile` with `gradient_checkpointing` compiles one by one; set it to 'NO'.")
    return [f"{request.source}: {written} compiles the whole model as its dynamo_config says, not each decoder layer"]
