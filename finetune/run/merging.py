"""A LoRA adapter merged into a GPT-OSS MXFP4 base one safetensors shard at a time, never holding the model: the 120B
base dequantized is 218 GiB of host memory, one of its shards 4 GiB in MXFP4.

The base model is built on the meta device and peft puts the adapter on it (`PeftModel.from_pretrained`: its wrappers,
and the dtypes it gives the adapter's weights), holding no weight. The base's shards are then read one at a time. A
tensor that no adapter wraps is written as from_pretrained(dtype="auto") would hold it; an expert weight's blocks and
scales are dequantized (`mxfp4_experts.dequantize`, bit-equal to transformers'). The tensors of a module that peft
wrapped are made real with that module's adapter weights, merged by peft's own code for that module (what
`merge_and_unload` runs on it; an expert stack a chunk of experts at a time), and made meta again. So the result is
bit for bit `merge_and_unload` of the base loaded dequantized, and host memory holds one stored shard (memory-mapped),
merged tensors up to one stored shard's size before they are written, and the module being merged (with the parts of
one whose tensors straddle two shards until its last one is read); the whole adapter only at the start, while peft
reads it.
"""

import warnings
from pathlib import Path

import torch
from peft.tuners.lora.layer import ParamWrapper

from finetune.errors import UserError
from finetune.models import mxfp4_experts, mxfp4_loading
from finetune.run.model import load_adapter

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PACKED_SUFFIXES = ("_blocks", "_scales")
# Experts dequantized at once: the reference dequantizer's float32 temporaries are ~12 bytes per weight, 4 GiB for
# one 120B gate_up_proj of 8 experts instead of 64 GiB for all 128.
EXPERTS_PER_CHUNK = 8


def merge(checkpoint: Path, base_model: str, adapter_dir: str, output: Path) -> None:
    """Write the merged model of the MXFP4 checkpoint folder of `base_model` and the LoRA adapter in `adapter_dir`
    into the existing, empty folder `output`: shards with a model.safetensors.index.json, config.json without
    quantization_config (the experts are now in the config's dtype) and generation_config.json."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(checkpoint)
    del config.quantization_config  # the experts are written dequantized
    with init_empty_weights(include_buffers=False):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    stored = mxfp4_loading.weight_files(checkpoint)
    places = _places(skeleton, stored)
    with warnings.catch_warnings():  # torch's: the adapter's weights are not copied into the meta skeleton, on purpose
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*to a meta parameter")
        adapted = load_adapter(skeleton, adapter_dir, base_model, "--base_model")  # wraps the skeleton's modules
    units = _merge_units(skeleton)
    waiting = {unit: {name for name in places if _unit_of(name, units) == unit} for unit in units}
    arrived: dict[str, torch.Tensor] = {}  # a packed expert weight's half whose other half is in a later shard
    shards = []
    adapter_file = Path(adapter_dir) / ADAPTER_WEIGHTS
    # Written as soon as they hold as many bytes as the largest stored shard: each stored shard is ~4x that merged
    shard_bytes = max(path.stat().st_size for path in set(stored.values()))
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(set(stored.values())):
        with safe_open(str(shard), "pt") as tensors:
            for stored_name in tensors.keys():
                name, tensor = _unpacked(stored_name, tensors.get_tensor(stored_name), arrived, config.dtype)
                if tensor is None:
                    continue
                unit = _unit_of(name, units)
                if unit is None:
                    merged[name] = tensor
                else:
                    _make_real(places[name], tensor)
                    waiting[unit].discard(name)
                    if not waiting[unit]:
                        merged.update(_merged_unit(adapted, unit, units[unit], places, adapter_file))
                if sum(held.nbytes for held in merged.values()) >= shard_bytes:
                    shards.append(_write_shard(merged, output, len(shards)))
                    merged = {}
    if merged:
        shards.append(_write_shard(merged, output, len(shards)))
    _write_index(shards, output)
    config.save_pretrained(output)
    if (checkpoint / "generation_config.json").is_file():  # as from_pretrained reads it; else from the config
        skeleton.generation_config = GenerationConfig.from_pretrained(checkpoint)
    skeleton.generation_config.save_pretrained(output)


def _places(skeleton: torch.nn.Module, stored: dict[str, Path]) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each tensor the checkpoint stores (an expert weight under its unpacked name) -> its module and attribute, read
    before peft wraps the modules (the modules themselves stay, inside peft's wrappers)."""
    known = skeleton.state_dict(keep_vars=True)
    places = {}
    for stored_name in stored:
        name = stored_name.removesuffix(PACKED_SUFFIXES[0]).removesuffix(PACKED_SUFFIXES[1])
        if name not in known:
            raise UserError(f"{stored[stored_name]}: holds {stored_name}, which the model built from its config.json "
                            f"does not have; re-download the model.")
        module_name, _, attribute = name.rpartition(".")
        places[name] = (skeleton.get_submodule(module_name), attribute)
    return places


def _merge_units(skeleton: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules merge_and_unload merges and unloads one by one (peft's `BaseTuner._unload_and_optionally_merge`):
    the outermost ones that carry an unload method or wrap a base layer."""
    units = {}
    for name, module in skeleton.named_modules():
        inside = any(name.startswith(f"{unit}.") for unit in units)
        if not inside and (hasattr(module, "unload_and_optionally_merge_module") or hasattr(module, "base_layer")):
            units[name] = module
    return units


def _unit_of(name: str, units: dict[str, torch.nn.Module]) -> str | None:
    module_name = name.rpartition(".")[0]
    while module_name:
        if module_name in units:
            return module_name
        module_name = module_name.rpartition(".")[0]
    return None


def _unpacked(stored_name: str, tensor: torch.Tensor, arrived: dict[str, torch.Tensor],
              dtype: torch.dtype) -> tuple[str, torch.Tensor | None]:
    """(name, tensor as from_pretrained(dtype="auto") holds it): an expert weight once both its blocks and its scales
    are read (None before), the rest in the config's dtype."""
    if not stored_name.endswith(PACKED_SUFFIXES):
        return stored_name, tensor.to(dtype) if tensor.is_floating_point() else tensor
    name = stored_name[:-len(PACKED_SUFFIXES[0])]
    arrived[stored_name] = tensor
    blocks, scales = arrived.get(f"{name}_blocks"), arrived.get(f"{name}_scales")
    if blocks is None or scales is None:
        return name, None
    del arrived[f"{name}_blocks"], arrived[f"{name}_scales"]
    return name, _dequantized(blocks, scales, dtype)


def _dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    experts, outputs = scales.shape[:2]
    weight = torch.empty(experts, mxfp4_experts.in_features(blocks), outputs, dtype=dtype)
    for start in range(0, experts, EXPERTS_PER_CHUNK):
        chunk = slice(start, start + EXPERTS_PER_CHUNK)
        weight[chunk] = mxfp4_experts.dequantize(blocks[chunk], scales[chunk], dtype)
    return weight


def _make_real(place: tuple[torch.nn.Module, str], tensor: torch.Tensor) -> None:
    module, attribute = place
    if attribute in module._parameters:
        module._parameters[attribute] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attribute] = tensor


def _merged_unit(adapted, unit_name: str, unit: torch.nn.Module, places: dict, adapter_file: Path) -> dict:
    """The merged tensors of one wrapped module whose base tensors are all real: its adapter weights made real and
    loaded by peft (`set_peft_model_state_dict`, as from_pretrained loads them), merged and unloaded by peft's code
    for that module, then the module made meta again."""
    from peft import set_peft_model_state_dict
    from safetensors import safe_open

    for module in unit.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(parameter, device="cpu"),
                                                              requires_grad=parameter.requires_grad)
    prefix = f"base_model.model.{unit_name}."
    with safe_open(str(adapter_file), "pt") as adapter_weights:  # opened per module: its mapped pages stay resident
        own = {key: adapter_weights.get_tensor(key) for key in adapter_weights.keys() if key.startswith(prefix)}
    set_peft_model_state_dict(adapted, own)
    if isinstance(unit, ParamWrapper):  # its unload_and_optionally_merge_module, an expert stack a chunk at a time
        base = unit
        while isinstance(base, ParamWrapper):
            _merge_parameter(base)
            base = base.base_layer
    elif hasattr(unit, "unload_and_optionally_merge_module"):
        base = unit.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
    else:
        unit.merge()
        base = unit.get_base_layer()
    state = base.state_dict()
    merged = {name: state[name.removeprefix(f"{unit_name}.")] for name in places if name.startswith(f"{unit_name}.")}
    unit.to("meta")
    return merged


def _merge_parameter(wrapper: ParamWrapper) -> None:
    """`ParamWrapper.merge` (no safe merge, the active adapter), for a stack of experts EXPERTS_PER_CHUNK experts at a
    time: peft's `get_delta_weight` forms the whole stack's delta in float32 twice (17 GiB for one 120B gate_up_proj).
    Its einsum is per expert, so a chunk's delta is the whole delta's rows: the same einsum, scaling and rounding
    to the weight's dtype, added in place as peft adds it."""
    if wrapper.num_experts == 1:
        wrapper.merge()
        return
    (adapter,) = wrapper.active_adapters
    weight = getattr(wrapper.get_base_layer(), wrapper.parameter_name)
    weight_a = wrapper.lora_A[adapter].weight
    weight_b = wrapper.lora_B[adapter].weight
    weight_a = weight_a.reshape(wrapper.num_experts, -1, weight_a.shape[-1])  # experts x rank x in_features
    weight_b = weight_b.reshape(weight_b.shape[0], -1, wrapper.num_experts)  # out_features x rank x experts
    # stored [experts, out_features, in_features] when peft swapped them
    product = "o r e, e r i -> e o i" if wrapper._did_swap_in_out_features else "o r e, e r i -> e i o"
    for start in range(0, wrapper.num_experts, EXPERTS_PER_CHUNK):
        chunk = slice(start, start + EXPERTS_PER_CHUNK)
        delta = torch.einsum(product, weight_b[..., chunk], weight_a[chunk]) * wrapper.scaling[adapter]
        weight.data[chunk] += delta.to(weight.device, weight.dtype)
    wrapper.merged_adapters.append(adapter)


def _write_shard(tensors: dict[str, torch.Tensor], output: Path, number: int) -> tuple[Path, list[str], int]:
    from safetensors.torch import save_file

    path = output / f".shard-{number}.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path), metadata={"format": "pt"})
    return path, sorted(tensors), sum(tensor.nbytes for tensor in tensors.values())


def _write_index(shards: list[tuple[Path, list[str], int]], output: Path) -> None:
    import json

    weight_map, total = {}, 0
    for number, (path, names, size) in enumerate(shards):
        final = path.with_name(f"model-{number + 1:05d}-of-{len(shards):05d}.safetensors")
        path.rename(final)
        weight_map.update(dict.fromkeys(names, final.name))
        total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (output / mxfp4_loading.INDEX).write_text(json.dumps(index, indent=2) + "\n")
