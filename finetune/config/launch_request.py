"""What `accelerate launch` asked for, read from where accelerate leaves it: the launch's own arguments (handed down
by `finetune launch`, or read from a plain `accelerate launch`'s command line), the variables it exports (FSDP,
DeepSpeed and its JSON), and the strategy they name. Read without torch."""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from finetune import patches
from finetune.config.files import local_or_shipped, read_yaml_mapping
from finetune.errors import UserError

# The arguments `finetune launch` gave `accelerate launch`, passed on to the training processes as a JSON list
LAUNCH_ARGUMENTS = "FINETUNE_LAUNCH_ARGUMENTS"


def arguments_after_accelerate_launch(command: list[str]) -> list[str] | None:
    """What `command` gives `accelerate launch` (its flags, the script and the script's flags), or None when it is not
    an accelerate launcher: `accelerate launch`, the `accelerate-launch` console script accelerate installs beside it,
    or `python -m accelerate.commands.launch`."""
    for index, arg in enumerate(command):
        after_accelerate = index > 0 and Path(command[index - 1]).name == "accelerate"
        if arg == "accelerate.commands.launch" or Path(arg).name == "accelerate-launch" or \
                arg == "launch" and after_accelerate:
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
    return config_file_named(accelerate_launch_arguments())


def config_file_named(arguments: list[str] | None) -> str:
    """The --config_file of `accelerate launch ARGUMENTS`, or words for none, for error messages."""
    if arguments is None:
        return "the accelerate config file"
    for index, arg in enumerate(arguments[:-1]):
        if arg == "--config_file":
            return arguments[index + 1]
        if arg.startswith("--config_file="):
            return arg.split("=", 1)[1]
    return "the default accelerate config (`accelerate config`)"


# The DeepSpeed JSON key each DeepSpeed field of accelerate's launcher (a flag, or a field under deepspeed_config) sets
# (DeepSpeedPlugin.__post_init__'s plugin_to_config_mapping, accelerate 1.15-1.16). Beside a JSON, accelerate takes a
# flag's value only where the JSON says "auto".
DEEPSPEED_FIELD_KEYS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


# accelerate refuses these fields of an accelerate config file beside a deepspeed_config_file, which holds them
# (DeepSpeedPlugin._deepspeed_config_checks, accelerate 1.15-1.16), once the training arguments are built.
FIELDS_NOT_BESIDE_DEEPSPEED_FILE = (*DEEPSPEED_FIELD_KEYS, "mixed_precision")


def fields_beside_deepspeed_file_refusal(config_file: str, deepspeed_file: str, fields: list[str]) -> UserError:
    listed = " and ".join(f"`{field}`" for field in fields)
    return UserError(
        f"{config_file}: {listed} cannot be set beside `deepspeed_config_file: {deepspeed_file}` (accelerate refuses "
        f"{'them' if len(fields) > 1 else 'it'} there: the JSON holds those settings); remove "
        f"{'them' if len(fields) > 1 else 'it'} from that file, the JSON's \"auto\" values follow the recipe.")


def deepspeed_json_read(text: str, named: str):
    """A DeepSpeed JSON's text as DeepSpeed reads a config file (DeepSpeedConfig: hjson, which also takes the comments
    and trailing commas of DeepSpeed's own examples, and refuses a key set twice), or a UserError naming `named`.
    transformers and accelerate read JSON only; the run hands them what is read here (launch.deepspeed_config), so
    what DeepSpeed reads trains."""
    duplicates = []  # (key, the object holding it twice)

    def unique_keys(pairs):  # json and hjson keep the last of two equal keys without a word
        values = dict(pairs)
        duplicates.extend((key, values) for index, (key, _) in enumerate(pairs)
                          if key in [seen for seen, _ in pairs[:index]])
        return values

    try:
        values = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as error:
        duplicates.clear()  # found in the objects read before the error: hjson reads them again
        try:
            import hjson  # DeepSpeed's own reader, installed with it
        except ImportError:
            hjson = None
        try:
            values = hjson.loads(text, object_pairs_hook=unique_keys) if hjson else None
        except (ValueError, hjson.HjsonDecodeError):
            values = None
        if values is None:
            raise UserError(f"{named}: not valid JSON at line {error.lineno}, column {error.colno} ({error.msg}); fix "
                            f"it there.") from None
    if duplicates:
        dotted = list(dict.fromkeys(_path_to(holder, values) + key for key, holder in duplicates))
        listed = " and ".join(f"`{key}`" for key in dotted)
        raise UserError(f"{named}: {listed} {'is' if len(dotted) == 1 else 'are'} set twice in one object "
                        f"(DeepSpeed refuses that; transformers would keep the last without a word); keep one of "
                        f"each.")
    return values


def _path_to(holder: dict, node, prefix: str = "") -> str:
    """The dotted path of the object `holder` inside `node` followed by a dot ("" for `node` itself, and for an object
    a repeated key has replaced, which is named by its own key alone)."""
    if node is holder:
        return prefix
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        found = _path_to(holder, child, f"{prefix}{key}.")
        if found:
            return found
    return ""


def read_deepspeed_config(config_file: str, accelerate_file: str | None = None,
                          field: str = "deepspeed_config_file") -> dict:
    """The DeepSpeed JSON accelerate hands to DeepSpeed (named in `accelerate_file`, by default the launcher's, as
    `field`; or in a recipe as transformers' own `deepspeed`), or a UserError. In a DeepSpeed training process also the
    accelerate config fields the launcher exported beside it (ACCELERATE_CONFIG_DS_FIELDS): accelerate refuses them
    with a message of its own when the training arguments are built, which is after this is called."""
    path = Path(local_or_shipped(config_file))
    if not path.is_file():
        naming = accelerate_file or accelerate_config_file()
        beside = Path(naming).parent / config_file  # where a path relative to the file naming it would point
        if not Path(config_file).is_absolute() and Path(naming).is_file() and beside.is_file():
            fix = f"write it as {beside.resolve()}, the file of that name beside {naming}"
        else:
            fix = ("launch from the folder it is relative to (the project root for accelerate_configs/*.yaml) or make "
                   "it absolute")
        raise UserError(
            f"{naming}: {field} {config_file} not found (from {Path.cwd()}: a relative path is read from the folder "
            f"you launch in, as transformers and accelerate read it); {fix}."
        )
    exported = os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",")
    beside = [field for field in FIELDS_NOT_BESIDE_DEEPSPEED_FILE if field in exported]
    if beside:
        raise fields_beside_deepspeed_file_refusal(accelerate_file or accelerate_config_file(), config_file, beside)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{config_file}: not UTF-8 text; save it as UTF-8.") from None
    values = deepspeed_json_read(text, config_file)
    if not isinstance(values, dict):
        raise UserError(f"{config_file}: a DeepSpeed config is a JSON object of settings, not a "
                        f"{type(values).__name__}; write it as one, e.g. {{\"zero_optimization\": {{\"stage\": 2}}, "
                        f"...}} as ds_configs/*.json are.")
    if not isinstance(values.get("zero_optimization"), dict):
        raise UserError(f"{config_file}: no `zero_optimization` object, which accelerate requires; add "
                        f"\"zero_optimization\": {{\"stage\": 2}} (or the stage you want), as ds_configs/*.json have.")
    refuse_blocks_not_objects(values, config_file)
    return values


# The blocks of a DeepSpeed JSON that transformers, accelerate and DeepSpeed read as objects (transformers fills
# `bf16.enabled`, `optimizer.params.lr`, ...; accelerate reads `zero_optimization.offload_param.device`), and the key
# a lone value written in place of one stands for: `"bf16": true` fails in transformers with an AttributeError
OBJECT_BLOCKS = {"bf16": "enabled", "fp16": "enabled", "amp": "enabled", "optimizer": None, "optimizer.params": None,
                 "scheduler": None, "scheduler.params": None, "zero_optimization.offload_optimizer": "device",
                 "zero_optimization.offload_param": "device", "compile": None, "tensor_parallel": None}


def value_at(values: dict, dotted: str):
    """A DeepSpeed JSON's value at a dotted key (`zero_optimization.stage`), or None where it has none."""
    node = values
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def refuse_blocks_not_objects(values: dict, named: str) -> None:
    """Every block of OBJECT_BLOCKS written as something other than an object, in one sentence, each with its fix."""
    problems = []
    for block, key in OBJECT_BLOCKS.items():
        value = value_at(values, block)
        if value is None or isinstance(value, dict):
            continue
        shown, last = json.dumps(value), block.split(".")[-1]
        fix = f"write it as `\"{last}\": {{\"{key}\": {shown}}}`" if key and not isinstance(value, (list, dict)) else \
            "write it as an object (`{...}`) of its settings or remove it"
        problems.append((f"`{block}: {shown}` is a lone value where transformers and DeepSpeed read an object", fix))
    if len(problems) == 1:
        raise UserError(f"{named}: {problems[0][0]}; {problems[0][1]}.")
    if problems:
        listed = "; ".join(f"({number}) {what}: {fix}" for number, (what, fix) in enumerate(problems, 1))
        raise UserError(f"{named}: {len(problems)} problems, each with its fix; {listed}.")


FSDP_V1_REFUSAL = (  # under both launchers
    "an FSDP version 1 file (no `fsdp_version: 2` under `fsdp_config`), which accelerate runs with FSDP1's wrappers "
    "and state dicts; this toolkit trains with FSDP2: use accelerate_configs/fsdp.yaml or add `fsdp_version: 2` with "
    "FSDP2's fields as that file has them.")


# What `accelerate launch` asked for is read from the variables it exports to the training processes, as accelerate's
# own state and FSDP plugin read them (AcceleratorState, FullyShardedDataParallelPlugin), in these functions only.
def fsdp_asked_for() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def fsdp_activation_checkpointing_asked_for() -> bool:
    return fsdp_asked_for() and os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true"


def deepspeed_asked_for() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def asked_deepspeed_file() -> str | None:
    """The DeepSpeed JSON the launch passes on, when it asks for DeepSpeed with one."""
    return (os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or None) if deepspeed_asked_for() else None


# The sections whose fields accelerate's launcher reads under a prefix (`fsdp_config: {version: 2}` is fsdp_version)
SECTION_PREFIXES = {"fsdp_config": "fsdp_", "fp8_config": "fp8_", "dynamo_config": "dynamo_"}


@dataclass
class LaunchRequest:
    """What one launch asks accelerate for: its config file's fields, and the flags of the launcher's command line,
    which win, both under the names accelerate's launcher gives them."""
    file: str | None
    fields: dict
    flags: dict

    @property
    def source(self) -> str:
        return self.file or "the accelerate launch command line"

    def value(self, name: str, default=None):
        if name in self.flags:
            return self.flags[name]
        return _as_launcher_arguments(self.fields).get(name, default)

    def named(self, name: str) -> str:
        """How the user names a field: `--flag` on the command line (also for a launch without a file), `field` in
        the file."""
        return f"`--{name}`" if name in self.flags or self.file is None else f"`{name}`"

    def written(self, name: str) -> str:
        """How the user wrote a field: `--flag value` on the command line, `field: value` in the file."""
        value = self.value(name)
        shown = str(value).lower() if isinstance(value, bool) else value  # as YAML and the flags spell it
        return f"`--{name} {shown}`" if name in self.flags else f"`{name}: {shown}`"

    def distributed_type(self) -> str:
        flags = (("cpu", "NO"), ("use_deepspeed", "DEEPSPEED"), ("use_fsdp", "FSDP"), ("multi_gpu", "MULTI_GPU"))
        for flag, kind in flags:
            if self.flags.get(flag):
                return kind
        if self.file is None:  # accelerate's own choice without a file: several GPUs for several processes
            import torch

            several = (self.value("num_processes") or 1) > 1 and torch.cuda.device_count() > 1
            return "MULTI_GPU" if several else "NO"
        return str(self.fields.get("distributed_type", "NO"))


def _as_launcher_arguments(fields: dict) -> dict:
    """A config file's fields as accelerate's launcher copies them into its arguments: a section's under its prefix."""
    flat = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            prefix = SECTION_PREFIXES.get(key, "")
            flat.update({name if name.startswith(prefix) else prefix + name: item for name, item in value.items()})
        else:
            flat[key] = value
    return flat


def launcher_parser():
    from accelerate.commands.launch import launch_command_parser  # torch: only where a launch is read

    return launch_command_parser()


def request_from_command(arguments: list[str], default_file: str | None) -> LaunchRequest | None:
    """The request of `accelerate launch ARGUMENTS` as accelerate reads it: the --config_file, else `default_file` when
    it exists, with the flags given. None when accelerate could not parse the command (it then says why itself)."""
    try:
        args = launcher_parser().parse_args(arguments)
    except SystemExit:
        return None
    given = patches.launcher_flags_given(args) - {"config_file", "training_script", "training_script_args", "quiet"}
    flags = {name: getattr(args, name) for name in sorted(given)}
    default_found = default_file and Path(default_file).is_file() and not args.cpu
    file = args.config_file or (default_file if default_found else None)
    fields = read_yaml_mapping(file, "accelerate config", "pass one of accelerate_configs/*.yaml") if file else {}
    return LaunchRequest(file, fields, flags)


def _request_of(arguments: list[str] | None) -> LaunchRequest | None:
    """The request of the `accelerate launch` given ARGUMENTS that started this training process, None when none did."""
    if arguments is None:
        return None
    from accelerate.commands.config.config_args import default_config_file

    return request_from_command(arguments, default_config_file)


@dataclass(frozen=True)
class ExportedLaunch:
    """What the launch asked for, read once (`read_exported_launch`, when the run's arguments are parsed) and carried
    on the run's RunConfig: every check and the run's setup check read it there."""

    strategy: str  # fsdp, zero1-3, ddp or single
    config_file: str  # the accelerate config file as given to the launcher, or words for none (for messages)
    deepspeed_file: str | None  # the DeepSpeed JSON the launch passes on
    deepspeed_config: dict | None  # that JSON, read once
    world_size: int
    fsdp_activation_checkpointing: bool  # the file asks accelerate to wrap each layer in a checkpoint
    asked_by: str | None = None  # what picked the strategy (a file, or transformers' `deepspeed`); None: nothing did
    request: LaunchRequest | None = None  # the accelerate config's fields as read and the launcher's flags


def read_exported_launch() -> ExportedLaunch:
    """The launch request of this process, from accelerate's exported variables and its launcher's arguments, each
    file the launch names (the accelerate config, the DeepSpeed JSON) read here once. A DeepSpeed JSON that cannot be
    used is the one-sentence UserError of `read_deepspeed_config`."""
    arguments = accelerate_launch_arguments()
    config_file = config_file_named(arguments)
    deepspeed_file = asked_deepspeed_file()
    deepspeed_config = read_deepspeed_config(deepspeed_file, config_file) if deepspeed_file else None
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if fsdp_asked_for():
        strategy = "fsdp"
    elif deepspeed_asked_for():
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # accelerate's DeepSpeedPlugin's default
        if deepspeed_config is not None:
            stage = str(deepspeed_config.get("zero_optimization", {}).get("stage", stage))
        strategy = f"zero{stage}"
    else:
        strategy = "ddp" if world_size > 1 else "single"
    request = _request_of(arguments)
    if deepspeed_config is not None:
        refuse_flags_the_json_overrides(request, deepspeed_config, deepspeed_file)
    if request is not None:  # the file accelerate read (the default one only where it exists), or its command line
        config_file = request.source
    return ExportedLaunch(strategy, config_file, deepspeed_file, deepspeed_config, world_size,
                          fsdp_activation_checkpointing_asked_for(),
                          config_file if strategy not in ("ddp", "single") else None, request)


def with_deepspeed_argument(launch: ExportedLaunch, asked: str | dict | None, source: str) -> ExportedLaunch:
    """The launch once transformers' own `deepspeed` (the --deepspeed flag, or a recipe key holding a path or the JSON
    itself, named by `source`) is taken into account, as transformers takes it: it decides where the launch asked for
    no strategy of its own (torchrun, the `deepspeed` launcher, `accelerate launch` without a file or with a MULTI_GPU
    one, which the Trainer turns into DeepSpeed), and is refused in one sentence where the accelerate config asks for
    another one. Its JSON is read here, once, and carried."""
    if not asked:
        return launch
    if isinstance(asked, dict):
        written, named = asked, f"{source} (`deepspeed`)"
        if not isinstance(written.get("zero_optimization"), dict):
            raise UserError(f"{source}: `deepspeed` has no `zero_optimization` object, which accelerate requires; add "
                            f"zero_optimization: {{stage: 2}} (or the stage you want) under it.")
        refuse_blocks_not_objects(written, named)
    else:
        named = f"--deepspeed {asked}" if source == "command line" else f"{source}: `deepspeed: {asked}`"
        if launch.deepspeed_file and Path(local_or_shipped(asked)).resolve() == \
                Path(local_or_shipped(launch.deepspeed_file)).resolve():
            return launch  # the same JSON both ways: the launch's, already read
        written = read_deepspeed_config(asked, source, field="--deepspeed" if source == "command line" else "`deepspeed`")
    stage = written["zero_optimization"].get("stage", 0)
    request = launch.request
    deepspeed_without_json = launch.asked_by is not None and launch.strategy.startswith("zero") and \
        request is not None and request.file is None  # `accelerate launch --use_deepspeed`
    if launch.asked_by is not None and not deepspeed_without_json:
        ours = f"`deepspeed_config_file: {launch.deepspeed_file}`" if launch.deepspeed_file else \
            f"{launch.strategy.upper()}"
        raise UserError(f"{launch.config_file}: asks for {ours} while {named} asks for ZeRO-{stage}, and one launch "
                        f"trains with one of them; launch without --config_file (torchrun --nproc_per_node N "
                        f"scripts/sft.py, or accelerate_configs/ddp.yaml) to train with {named}, or remove "
                        f"{'--deepspeed' if source == 'command line' else f'`deepspeed` from {source}'} to train as "
                        f"that file says.")
    refuse_flags_the_json_overrides(request, written, named)  # the JSON decides, as transformers lets it
    return replace(launch, strategy=f"zero{stage}", deepspeed_file=asked if isinstance(asked, str) else named,
                   deepspeed_config=written, asked_by=named)


def refuse_flags_the_json_overrides(request: LaunchRequest | None, written: dict, named: str) -> None:
    """A DeepSpeed flag of the launcher beside a DeepSpeed JSON (`named`: an accelerate config's deepspeed_config_file
    or transformers' `deepspeed`) trains only where the JSON agrees with it, or says "auto" in a DeepSpeed launch,
    which exports the flag for accelerate to fill it in; any other flag would be ignored without a word, and is
    refused naming both, as accelerate refuses those fields in a config file beside a JSON."""
    if request is None:
        return
    for name, key in DEEPSPEED_FIELD_KEYS.items():
        if name not in request.flags:
            continue
        given, theirs = request.flags[name], value_at(written, key)
        if _same_value(given, theirs) or theirs == "auto" and deepspeed_asked_for():
            continue
        if name == "zero_stage" and isinstance(theirs, int):
            asked, answer = f"ZeRO-{given}", f"asks for ZeRO-{theirs}"
        else:
            asked = f"`{key}: {given}`"
            answer = f"sets no `{key}`" if theirs is None else f"asks for `{key}: {json.dumps(theirs)}`"
        flag = request.written(name)
        raise UserError(f"{request.source}: {flag} asks for {asked} while {named} {answer}, and one launch trains "
                        f"with one of them; remove {flag.strip('`')} from the accelerate launch command to train with "
                        f"{named}.")


def _same_value(given, theirs) -> bool:
    """A flag's value (text or a number, as accelerate's parser gives it) and a JSON's are the same setting."""
    try:
        return float(given) == float(theirs)
    except (TypeError, ValueError):
        return str(given).lower() == str(theirs).lower()


# A DeepSpeed JSON's blocks that give way to the recipe: transformers would otherwise build DeepSpeed's optimizer or
# schedule in place of the recipe's. An optimizer block gives way when it is DeepSpeed's Adam or AdamW (the recipe's
# AdamW at the recipe's values: its own values are "auto" or checked to equal them); a scheduler block always.
OPTIMIZERS_THAT_GIVE_WAY = ("adam", "adamw")


def blocks_giving_way(config: dict) -> list[str]:
    optimizer = config.get("optimizer")
    giving_way = []
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in OPTIMIZERS_THAT_GIVE_WAY:
        giving_way.append("optimizer")
    if "scheduler" in config:
        giving_way.append("scheduler")
    return giving_way


def deepspeed_config_to_train(launch: ExportedLaunch) -> dict | None:
    """The JSON the training arguments are given (transformers fills its "auto" values from them): the launch's,
    read once, without the blocks that give way to the recipe."""
    if launch.deepspeed_config is None:
        return None
    giving_way = blocks_giving_way(launch.deepspeed_config)
    return {key: value for key, value in json.loads(json.dumps(launch.deepspeed_config)).items()
            if key not in giving_way}
