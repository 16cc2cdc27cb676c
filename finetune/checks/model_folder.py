"""A model, adapter or tokenizer folder checked before it loads (missing, empty or damaged files, a hub id without
network), and the model's layers read from a skeleton on the meta device: LoRA targets and FSDP wrap classes that
match nothing are refused here instead of after loading."""

import json
import os
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from finetune import families, patches, run_folder
from finetune.config.launch_request import ExportedLaunch
from finetune.errors import UserError, first_line, say
from finetune.models import attention, mxfp4, mxfp4_loading, tiny
from finetune.run_folder import RUN_RECORD


def resolve_model_path(run) -> str:
    """The folder or hub id to load, checked (`check_model`, then its family: `family_of_run`): the recipe's model, or
    its tiny stand-in under --tiny (its width checked first), and against an FSDP launch's layer classes to wrap
    (`check_fsdp_wrap`)."""
    name, revision = run.model.model_name_or_path, run.model.model_revision
    if run.finetune.tiny:
        family = family_of_run(run).name
        tiny.check_width(family, run.finetune.tiny_width, run.recipe_path or "command line")
        path = str(tiny.tiny_model_folder(family, run.finetune.tiny_width))
    else:
        check_model(name, "--model_name_or_path", revision=revision)  # first: it names a missing or damaged config.json
        adapter = Path(name).expanduser()
        if (adapter / ADAPTER_CONFIG).is_file() and not (adapter / ADAPTER_WEIGHTS[0]).is_file():
            raise UserError(f"{adapter}: holds its adapter as {ADAPTER_WEIGHTS[1]} only, a pickle, which training "
                            f"never reads (it loads safetensors only; chat, generate, eval and merge read it "
                            f"weights-only); re-save the adapter with save_pretrained, which writes "
                            f"{ADAPTER_WEIGHTS[0]}.")
        family_of_run(run)
        path = name
    check_fsdp_wrap(path, name, run.launch)
    return path


# --tiny's stand-in for a model whose type cannot be read: the default run's tiny model (run/arguments.py DEFAULT_ARGS)
UNREAD_TINY_FAMILY = "llama"


def family_of_run(run) -> families.Family:
    """The family of the run's model (finetune/families.py), by its config.json's model type whatever its name; a
    model of none is refused in one sentence that lists the families, before anything loads. --tiny replaces the
    model whole with a tiny random one of its family, so there a model whose type cannot be read (a hub id offline
    and not in the hub cache, whose name tells no family) gets the tiny Llama, said in one line. A config.json that
    names a type of no family is refused all the same: the model the tiny one would stand in for cannot train."""
    name, revision = run.model.model_name_or_path, run.model.model_revision
    if not run.finetune.tiny:
        return families.family_of(name, revision)
    family = families.family_if_told(name, revision)
    if family is None:
        family = families.FAMILIES[UNREAD_TINY_FAMILY]
        say(f"--tiny: neither a config.json (in a folder or the hub cache) nor the name of {name} tells its model "
            f"type, so the tiny {family.name} model stands in for it")
    return family


ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


# The JSON files from_pretrained reads: an empty or cut one fails deep in transformers or tokenizers with a traceback
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.json", WEIGHTS_INDEX, ADAPTER_CONFIG)


REMAKE = "re-download the model or re-save it with save_pretrained"


REMAKE_ADAPTER = "re-save the adapter with save_pretrained, or pass one of its run's complete checkpoint-N folders"


def check_model(name: str, flag: str, base: str | None = None, base_flag: str | None = None,
                revision: str | None = None) -> str | None:
    """Refuse before loading, in one sentence naming the file and the fix, a model that cannot load: a path that is
    no folder, a hub id missing from the offline cache, a damaged folder (its JSON files, its weights), a training
    run without its final model, or a LoRA adapter whose base model is any of these. Reads the JSON files and the
    weights' headers, nothing more. Returns the base model an adapter folder loads on (`base`, else its adapter_config.json's); None for a model."""
    patches.never_ask_to_run_remote_code()
    problem = model_problem(name, flag, revision)
    if problem:
        raise UserError(problem)
    adapter_config = Path(name).expanduser() / ADAPTER_CONFIG
    if not adapter_config.is_file():
        return None
    base = base or json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        fix = f"pass {base_flag} MODEL" if base_flag else "set it to the base model's folder or hub id"
        raise UserError(f"{adapter_config}: names no base model (base_model_name_or_path); {fix}.")
    problem = _adapter_weights_problem(adapter_config.parent)
    if problem:
        raise UserError(problem)
    problem = model_problem(base, base_flag or f"base_model_name_or_path in {ADAPTER_CONFIG}")
    if problem:
        raise UserError(f"{adapter_config}: its base model cannot be loaded: {problem}")
    if (Path(base).expanduser() / ADAPTER_CONFIG).is_file():  # transformers would load it with its own adapter on
        raise UserError(f"{base}: a LoRA adapter, not the base model of {name}, which would then carry two adapters; "
                        f"pass {base_flag or 'base_model_name_or_path'} the model it was trained on.")
    problem = _adapter_fit_problem(adapter_config.parent, base, base_flag or "base_model_name_or_path")
    if problem:
        raise UserError(problem)
    return base


def model_problem(name: str, flag: str, revision: str | None = None) -> str | None:
    """Why a model folder or hub id cannot load, as one sentence naming the file and the fix; None when it can."""
    folder = Path(name).expanduser()
    if folder.is_file():
        return f"{name}: a file, not a model folder; pass the folder that holds the model to {flag}."
    if folder.is_dir():
        return _folder_problem(folder, flag)
    return _hub_problem(name, flag, revision)


def _hub_problem(name: str, flag: str, revision: str | None) -> str | None:
    """A name that is no hub id either, or (offline) a hub model missing from the cache or damaged there."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"{name}: no such folder; pass a model folder or a hub id to {flag}."
    if not constants.HF_HUB_OFFLINE:
        return None  # downloaded as it loads; the loader's own error names a hub id that does not exist
    folder = _cached_folder(name, revision)
    if folder is None:
        return (f"{name}: no such folder, and no hub model of that id is in the local cache while HF_HUB_OFFLINE is "
                f"set; download it where there is network (`hf download {name}`) or pass a local model folder to "
                f"{flag}.")
    return _folder_problem(folder, flag)


def _cached_folder(name: str, revision: str | None) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    return Path(cached).parent if isinstance(cached, str) else None


def checked_folder(name: str, revision: str | None = None) -> Path | None:
    """The folder `check_model` reads for a model: a local one, or a hub model's in the cache while HF_HUB_OFFLINE is
    set; None for a hub id that is downloaded as it loads."""
    from huggingface_hub import constants

    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    return _cached_folder(name, revision) if constants.HF_HUB_OFFLINE else None


def partitioned_checkpoint(folder: Path) -> str | None:
    """The tag (global_stepN) of the DeepSpeed checkpoint a folder holds in place of model or adapter weights: what
    transformers saves under ZeRO-3 when the weights are not gathered (the engine's partitions, which DeepSpeed names
    in `latest`); None for a folder holding weights."""
    latest = folder / "latest"
    if not latest.is_file() or any((folder / name).is_file() for name in (WEIGHTS, WEIGHTS_INDEX, *ADAPTER_WEIGHTS)):
        return None
    tag = latest.read_text(encoding="utf-8", errors="replace").strip()
    return tag if tag and (folder / tag).is_dir() else None


def _folder_problem(folder: Path, flag: str) -> str | None:
    tag = partitioned_checkpoint(folder)
    if tag:  # the fix: the relaunch saves the final model from the run's newest checkpoint (finetune/run/trainer.py)
        run_dir = folder.parent if (folder.parent / RUN_RECORD).is_file() else folder
        then = f", then pass {run_dir} to {flag}" if run_dir != folder else ""
        return (f"{folder}: holds DeepSpeed's partitioned ZeRO-3 checkpoint ({tag}) and no model weights (its run "
                f"saved with `stage3_gather_16bit_weights_on_model_save` off); set it to true in the run's DeepSpeed "
                f"JSON (or pass --zero3_save_16bit_model true to accelerate launch) and relaunch the training command, "
                f"which writes {run_dir / WEIGHTS} from the run's newest complete checkpoint{then}.")
    if (folder / RUN_RECORD).is_file() and not (folder / run_folder.FINAL_MARKER).is_file():
        newest = run_folder.newest_complete(folder)
        instead = f"use its newest complete checkpoint {newest} instead, or " if newest else ""
        return (f"{folder}: this training run has no complete final model (no {run_folder.FINAL_MARKER}: training "
                f"is still running, was stopped, or its final save was cut short); {instead}relaunch the training "
                f"command to finish it.")
    problem = next(filter(None, (_json_problem(folder / name) for name in JSON_FILES)), None)
    if problem or (folder / ADAPTER_CONFIG).is_file():
        return problem  # an adapter's weights and base are checked once its base is known
    if not (folder / "config.json").is_file():
        return (f"{folder}: holds neither a model (config.json) nor a LoRA adapter (adapter_config.json); pass a model "
                f"folder or a finished training run's output_dir to {flag}.")
    return _config_problem(folder) or _weights_problem(folder)


def _json_problem(path: Path) -> str | None:
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        value = json.loads(text)
    except UnicodeDecodeError:
        what = "not UTF-8 text"
    except ValueError as error:
        what = "empty" if not text.strip() else f"not valid JSON ({error.msg} at line {error.lineno})"
    else:
        if isinstance(value, dict):
            return None
        what = f"a JSON {type(value).__name__}, not an object"
    return f"{path}: {what}, so it was cut short or damaged; {REMAKE_ADAPTER if path.name == ADAPTER_CONFIG else REMAKE}."


def _config_problem(folder: Path) -> str | None:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    settings = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    model_type = settings.get("model_type")
    if settings.get("auto_map") and model_type not in CONFIG_MAPPING:
        # only the folder's own code could build it: transformers would ask on stdin whether to run it
        # (patches.never_ask_to_run_remote_code: it no longer asks, it refuses), and this toolkit never runs it
        code = sorted({str(name) for name in (settings["auto_map"].values() if isinstance(settings["auto_map"], dict)
                                              else [settings["auto_map"]])})
        import transformers

        return (f"{folder / 'config.json'}: `model_type: {model_type}` is unknown to transformers "
                f"{transformers.__version__} and its `auto_map` names code of the model folder ({', '.join(code)}), "
                f"which finetune never runs; pass a model whose type transformers has (upgrade transformers if the "
                f"model is newer).")
    if model_type is None:  # save_pretrained always writes it: a config.json without it is not a whole one
        return f"{folder / 'config.json'}: names no `model_type`, so transformers cannot tell the model; {REMAKE}."
    if model_type not in CONFIG_MAPPING:
        import transformers

        return (f"{folder / 'config.json'}: `model_type: {model_type}` is unknown to transformers "
                f"{transformers.__version__}; upgrade transformers if the model is newer, else {REMAKE}.")
    return None


def _weights_problem(folder: Path) -> str | None:
    """A full model's safetensors weights: there, listed by the index if sharded, each complete."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            return f"{index}: lists no weights (`weight_map`); {REMAKE}."
        shards = sorted(set(map(str, weight_map.values())))
    elif (folder / WEIGHTS).is_file():
        shards = [WEIGHTS]
    else:
        pickled = sorted(path.name for path in folder.glob("*.bin"))
        found = f"only {', '.join(pickled)}, which this toolkit never unpickles" if pickled else "no weights"
        return f"{folder}: holds {found} (no {WEIGHTS} or {WEIGHTS_INDEX}); {REMAKE} (it writes safetensors)."
    for shard in shards:
        if not shard.endswith(".safetensors"):
            return (f"{index}: lists {shard}, which is not a .safetensors file (a pickle this toolkit never "
                    f"unpickles); {REMAKE} (it writes safetensors).")
        if not (folder / shard).is_file():
            return f"{index}: lists {shard}, which is missing; {REMAKE}."
        problem = run_folder.safetensors_problem(folder / shard)
        if problem:
            return f"{folder}/{problem}; {REMAKE}."
    headers = {folder / shard: run_folder.safetensors_header(folder / shard)[1] for shard in shards}
    packed = mxfp4.is_mxfp4_checkpoint(str(folder))
    if packed:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        problem = mxfp4.packed_problem(config, headers)
        if problem:
            return f"{problem}; {REMAKE}."
    problem = _tensors_problem(folder, headers, index if index.is_file() else folder / WEIGHTS) or \
        (_scales_problem(headers) if packed else None)
    return f"{problem}; {REMAKE}." if problem else None


def _scales_problem(headers: dict[Path, dict]) -> str | None:
    """The first MXFP4 scale tensor holding a byte that dequantizes its block to NaN or infinite values
    (`mxfp4_experts.nonfinite_scale`): the one damaged value the check after loading cannot see where the experts stay
    packed (uint8), nor a streamed merge, which never loads the model. Reads the scales, a seventeenth of the experts'
    bytes (0.6 s per GB from the page cache on a 2-core CPU: GPT-OSS-20B's 0.6 GB in 0.4 s, 120B's 3.6 GB in ~2 s), and
    a block's bytes only under a scale from 253 up (the tensors are memory maps)."""
    import contextlib

    from safetensors import safe_open

    from finetune.models import mxfp4_experts

    shard_of = {name: shard for shard, header in headers.items() for name in header if name != "__metadata__"}
    with contextlib.ExitStack() as stack:
        opened = {shard: stack.enter_context(safe_open(str(shard), framework="pt")) for shard in headers}
        for name, shard in sorted(shard_of.items()):
            blocks = name.removesuffix("_scales") + "_blocks"
            if not name.endswith("_scales") or blocks not in shard_of:
                continue
            byte = mxfp4_experts.nonfinite_scale(opened[shard_of[blocks]].get_tensor(blocks),
                                                 opened[shard].get_tensor(name))
            if byte is not None:
                meaning = "NaN in the MXFP4 format" if byte == 255 else \
                    f"2**{byte - mxfp4_experts.SCALE_BIAS}, which times its block's larger FP4 values passes bf16's range"
                return (f"{shard}: {name} holds the scale byte {byte} ({meaning}), so the expert weights it scales "
                        f"hold NaN or infinite values once dequantized and every output they touch would be NaN (a run "
                        f"trained on it logs its loss as 0)")
    return None


FLOATING = {"F16", "BF16", "F32", "F64"}


def _tensors_problem(folder: Path, headers: dict[Path, dict], weights: Path) -> str | None:
    """The model's weights (a skeleton built from config.json on the meta device) against the safetensors headers:
    a weight no shard holds, which transformers would initialise at random with only a warning, one stored in
    another shape (a traceback at load), a floating weight stored as integers (cast without a word). Left to the
    load: a checkpoint quantized otherwise than MXFP4 (its tensors are not the model's weights), one whose names
    follow another scheme (transformers renames them as it loads), an MXFP4 expert weight (`mxfp4.packed_problem`)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    quantized = (config.get("quantization_config") or {}).get("quant_method")
    skeleton = None if quantized not in (None, "mxfp4") else _skeleton(str(folder))
    if skeleton is None:
        return None
    stored = {name: (shard, entry) for shard, header in headers.items() for name, entry in header.items()
              if name != "__metadata__"}
    prefix = f"{skeleton.base_model_prefix}."
    names_of = {}  # each weight (tied weights are one) and its names
    for name, tensor in skeleton.named_parameters(remove_duplicate=False):  # buffers are rebuilt, or left to the load
        names_of.setdefault(id(tensor), (tensor, []))[1].append(name)

    def found(names):
        return next((stored[key] + (key,) for name in names for key in (name, name.removeprefix(prefix))
                     if key in stored), None)

    weights_found = [(tensor, names, found(names)) for tensor, names in names_of.values()]
    if sum(1 for *_, where in weights_found if where) * 2 < len(weights_found):
        return None  # another naming scheme
    packed = mxfp4.packed_shapes(config) if quantized == "mxfp4" else {}
    missing = [f"{names[0]}_blocks" if f"{names[0].rsplit('.', 1)[-1]}_blocks" in packed else names[0]
               for tensor, names, where in weights_found
               if where is None and found([f"{name}_blocks" for name in names]) is None]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        holds = "lists no shard holding" if weights.name == WEIGHTS_INDEX else "holds no"
        return (f"{weights}: {holds} {missing[0]}{more}, which transformers would fill with random values (a model "
                f"trained from it would train on them without a word)")
    taken = {key for _, names in names_of.values() for name in names
             for key in (name, name.removeprefix(prefix), f"{name}_blocks", f"{name}_scales")}
    ignored = [re.compile(pattern) for pattern in getattr(skeleton, "_keys_to_ignore_on_load_unexpected", None) or []]
    dropped = sorted(name for name in stored if name not in taken and name.endswith((".weight", ".bias"))
                     and not any(pattern.search(name) for pattern in ignored))
    if dropped:  # a config.json that describes a smaller model than its weights (fewer layers, no bias)
        shard = stored[dropped[0]][0]
        return (f"{shard}: holds {dropped[0]}, a weight the model of its config.json does not have (transformers "
                f"would drop it with a warning), so config.json does not describe these weights")
    for tensor, names, (shard, entry, key) in ((t, n, w) for t, n, w in weights_found if w):
        shape = list(tensor.shape)
        if entry.get("shape") != shape or (tensor.is_floating_point() and entry.get("dtype") not in FLOATING
                                           and quantized is None):
            wanted = "a floating type" if entry.get("shape") == shape else shape
            return f"{shard}: {key} is stored as {entry.get('dtype')} {entry.get('shape')}, where config.json implies {wanted}"
    return None


def _adapter_weights_problem(folder: Path) -> str | None:
    weights = next((folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        return f"{folder}: holds no adapter weights ({ADAPTER_WEIGHTS[0]}); {REMAKE_ADAPTER}."
    problem = run_folder.safetensors_problem(weights) if weights.suffix == ".safetensors" else None
    return f"{folder}/{problem}; {REMAKE_ADAPTER}." if problem else None


def _adapter_fit_problem(folder: Path, base: str, base_flag: str) -> str | None:
    """The adapter's tensors (its safetensors header) against those peft would load into its base: the base's skeleton
    on the meta device with the adapter_config.json's adapter put on it. peft loads a missing tensor with a warning
    (the layer keeps its untrained initial value, and a merge writes it in), drops a tensor of a layer the base lacks
    without a word, casts integer tensors, and ends in a traceback when `target_modules` match no layer. Left to the
    load: an adapter peft cannot put on the skeleton for another reason, or one in a pickled adapter_model.bin."""
    weights = folder / ADAPTER_WEIGHTS[0]
    skeleton = _skeleton(base) if weights.is_file() else None
    if skeleton is None:
        return None
    from peft import PeftConfig, get_peft_model, get_peft_model_state_dict

    try:
        config = PeftConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            wanted = get_peft_model_state_dict(get_peft_model(skeleton, config))
    except ValueError as error:
        if type(error).__name__ != "NoMatchingPeftModuleError":
            return None
        return (f"{folder / ADAPTER_CONFIG}: its `target_modules` {sorted(config.target_modules or [])} match no layer "
                f"of {base}, so it was trained on another model; pass the model it was trained on to {base_flag}.")
    except Exception:
        return None
    stored = {key: entry for key, entry in run_folder.safetensors_header(weights)[1].items() if key != "__metadata__"}
    missing = sorted(set(wanted) - set(stored))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        return (f"{weights}: holds no {missing[0]}{more}, which peft would leave at its untrained initial value (a "
                f"merge would write it in); {REMAKE_ADAPTER}.")
    extra = sorted(set(stored) - set(wanted))
    if extra:
        return (f"{weights}: holds {extra[0]}, which no layer of {base} takes (peft would drop it without a word), so "
                f"it was trained on another model; pass the model it was trained on to {base_flag}.")
    for key, tensor in wanted.items():
        entry = stored[key]
        if entry.get("shape") != list(tensor.shape):
            return (f"{weights}: {key} is {entry.get('shape')} in the adapter and {list(tensor.shape)} on {base} "
                    f"with its adapter_config.json, so it was trained on another model or another `r`; pass the model "
                    f"it was trained on to {base_flag}.")
        if tensor.is_floating_point() and entry.get("dtype") not in FLOATING:
            return f"{weights}: {key} is stored as {entry.get('dtype')}, not a floating type; {REMAKE_ADAPTER}."
    return None


def nonfinite_sentence(where: str | Path, tensor: str, fix: str) -> str:
    """The refusal of weights holding NaN or infinite values, read once loaded (finetune/run/model.py `check_finite`)
    or from a file (`nonfinite_problems`)."""
    return (f"{where}: {tensor} holds NaN or infinite values, so every output it touches would be NaN (a run trained "
            f"on it logs its loss as 0); {fix}.")


def nonfinite_problems(name: str, base: str | None = None, revision: str | None = None) -> list[UserError]:
    """Each weights file of a model folder (`checked_folder`), or of a LoRA adapter folder and its base (`base`, else
    its adapter_config.json's), whose tensors hold NaN or infinite values: one sentence per file naming its first such
    tensor, in `check_finite`'s words, before anything loads. Every floating tensor is read once from its memory map
    (`nonfinite_tensor`): 0.6 to 1.1 s per GB of bf16 on a 2-core CPU (a 3.2 GB file from the page cache; a cold disk
    adds its own read). MXFP4 experts are uint8, never NaN, and not read (their scales are `check_model`'s), so
    GPT-OSS-120B reads its 4.3 GB of bf16 weights, not its 65 GB. For a folder `check_model` let through."""
    folder = checked_folder(name, revision)
    if folder is None:
        return []
    if (folder / ADAPTER_CONFIG).is_file():
        files = [(folder / ADAPTER_WEIGHTS[0], REMAKE_ADAPTER)] if (folder / ADAPTER_WEIGHTS[0]).is_file() else []
        base = base or json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))["base_model_name_or_path"]
        return [*_nonfinite_files(files), *nonfinite_problems(base)]
    return _nonfinite_files([(shard, REMAKE) for shard in sorted(set(mxfp4_loading.weight_files(folder).values()))])


def _nonfinite_files(files: list[tuple[Path, str]]) -> list[UserError]:
    found = ((weights, fix, nonfinite_tensor(weights)) for weights, fix in files)
    return [UserError(nonfinite_sentence(weights, tensor, fix)) for weights, fix, tensor in found if tensor]


def nonfinite_tensor(weights: Path) -> str | None:
    """The first floating tensor of a .safetensors file holding NaN or infinite values, read one tensor at a time from
    its memory map, one float32 sum each (non-finite if any element is)."""
    from safetensors import safe_open

    with safe_open(str(weights), framework="pt") as tensors:
        for name in tensors.keys():
            tensor = tensors.get_tensor(name)
            if tensor.is_floating_point() and not torch.isfinite(torch.sum(tensor, dtype=torch.float32)):
                return name
    return None


def _skeleton(model_path: str, attn_implementation: str | None = None):
    """The model's modules on the meta device (no weights, no memory), built as from_pretrained would build them with
    this attention implementation, or None for a model that cannot be built so: the checks reading it are then left to
    the load. A ValueError is transformers' refusal of the attention implementation for this model."""
    attention.register()
    try:
        config = AutoConfig.from_pretrained(model_path)
    except Exception:
        return None
    chosen = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:  # outside deepspeed.zero.Init, which a ZeRO-3 launch sets up: meta tensors hold nothing to partition
        with torch.device("meta"), patches.zero3_init_off():
            return AutoModelForCausalLM.from_config(config, **chosen)
    except ValueError:
        if not chosen:
            return None
        raise
    except Exception:
        return None


def check_fsdp_wrap(model_path: str, name: str, launch: ExportedLaunch) -> None:
    """An FSDP file's `fsdp_transformer_layer_cls_to_wrap` (accelerate's own examples name BertLayer) must name layer
    classes of this model: accelerate fails on it only once the model is loaded."""
    if launch.strategy != "fsdp" or \
            os.environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        return
    wanted = [cls.strip() for cls in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if cls.strip()]
    skeleton = _skeleton(model_path) if wanted else None
    if skeleton is None:
        return
    classes = {type(module).__name__ for module in skeleton.modules()}
    missing = [cls for cls in wanted if cls not in classes]
    if missing:
        layers = ", ".join(patches.no_split_modules(skeleton) or sorted(classes))
        raise UserError(f"{launch.config_file}: `fsdp_transformer_layer_cls_to_wrap: {','.join(wanted)}` names "
                        f"{', '.join(missing)}, which {name} does not have (its decoder layers: {layers}); "
                        f"remove the field to wrap each decoder layer, as accelerate_configs/fsdp.yaml does.")


def check_layers(run, model_path: str) -> None:
    """What the recipe asks of the model's layers, read from a skeleton on the meta device before loading: an
    attention implementation it cannot use, LoRA target modules that match none of its layers."""
    name = run.model.attn_implementation
    where = run.source_of("attn_implementation")
    try:  # a hub kernel's id ("org/name") would be fetched: left to the load
        skeleton = _skeleton(model_path, None if name is None or "/" in name else name)
    except ValueError as error:
        raise UserError(f"{where}: `attn_implementation: {name}` cannot run {run.model.model_name_or_path} "
                        f"({first_line(error).split('. ')[0]}); pick another attention (eager runs every model).") from None
    if skeleton is None:  # peft's and the attention's own checks still run at load
        return
    if name == attention.VARLEN_ATTENTION:
        needs = sorted({what for module in skeleton.modules() for what, has in (
            ("sliding windows", getattr(module, "sliding_window", None)), ("attention sinks", hasattr(module, "sinks")))
            if has})
        if needs:
            raise UserError(f"{where}: `attn_implementation: {name}` is plain causal attention, and "
                            f"{run.model.model_name_or_path} has {' and '.join(needs)}; use `attn_implementation: "
                            f"flex_attention` (or eager).")
    check_lora_targets(run, skeleton)


def check_lora_targets(run, skeleton) -> None:
    """LoRA target modules that match no layer of the model: refused before loading, naming the layers there are.
    peft adapts what matches and says nothing of a misspelled name beside a right one (or fails after loading when
    none matches). A single pattern is matched as peft matches it, against the whole module name."""
    from peft.tuners.tuners_utils import match_target_against_key

    targets = run.model.lora_target_modules
    if not run.model.use_peft or not targets or targets in ("all-linear", ["all-linear"]):
        return
    names = [name for name, module in skeleton.named_modules() if isinstance(module, torch.nn.Linear)]
    if isinstance(targets, str):
        unmatched = [] if any(match_target_against_key(targets, name) for name in names) else [targets]
    else:
        unmatched = [target for target in targets
                     if not any(name == target or name.endswith("." + target) for name in names)]
    if unmatched:
        layers = sorted({name.rsplit(".", 1)[-1] for name in names})
        raise UserError(f"{run.source_of('lora_target_modules')}: `lora_target_modules` {unmatched} match no layer of "
                        f"{run.model.model_name_or_path}; its linear layers are {layers} (or use all-linear).")
