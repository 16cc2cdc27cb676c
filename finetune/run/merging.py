"""A LoRA adapter merged into a GPT-OSS MXFP4 base a piece of a tensor at a time, never holding the model nor one of
its shards: the 120B base dequantized is 218 GiB of host memory, one of its stored shards 4 GiB in MXFP4, one layer's
experts 6.4 GB in bf16.

The base model is built on the meta device and peft puts the adapter on it (`PeftModel.from_pretrained`: its wrappers,
and the dtypes it gives the adapter's weights), holding no weight. Each merged tensor is then made from the stored
one and written at once into its output shard (`shard_writing`: the header first, the bytes as they come), a run of
leading rows at a time read from the stored shard (a slice of its memory map, unmapped once read). A tensor that no
adapter wraps is written as from_pretrained(dtype="auto") would hold it, an expert weight's blocks and scales
dequantized (`mxfp4_experts.dequantize`, bit-equal to transformers'). A stack of experts that peft wraps
(`ParamWrapper`) is merged EXPERTS_PER_CHUNK experts at a time: the chunk dequantized plus the chunk's rows of the
delta peft's `get_delta_weight` forms (its einsum is per expert), rounded and added as peft adds it. Any other module
peft wraps (an attention projection) is made real with its adapter weights, merged by peft's own code for that module
(what `merge_and_unload` runs on it) and made meta again. So the result is bit for bit `merge_and_unload` of the base
loaded dequantized, in the files and index save_pretrained writes with shards as large as the largest stored one, and
host memory holds one chunk of experts being merged (with its float32 temporaries), one attention projection, and the
adapter: whole only at the start, while peft reads it, then one module's adapter weights at a time.
"""

import math
import warnings
from pathlib import Path

import torch
from peft.tuners.lora.layer import ParamWrapper

from finetune.errors import UserError
from finetune.models import mxfp4_experts, mxfp4_loading
from finetune.run import shard_writing
from finetune.run.model import load_adapter

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PACKED_SUFFIXES = ("_blocks", "_scales")
# Experts dequantized and merged at once: with their float32 temporaries (~13 bytes a weight) the merge of 8 experts of
# a 120B gate_up_proj peaks 1.6 GiB above the process's size before it (benchmarks/merge_memory.py --real_widths).
EXPERTS_PER_CHUNK = 8
# Values of any other tensor read and written at once: 128 MiB in bf16, an eighth of the 120B embedding.
VALUES_PER_PIECE = 1 << 26


def merge(checkpoint: Path, base_model: str, adapter_dir: str, output: Path) -> None:
    """Write the merged model of the MXFP4 checkpoint folder of `base_model` and the LoRA adapter in `adapter_dir`
    into the existing, empty folder `output`: safetensors shards (with a model.safetensors.index.json when more than
    one), config.json without quantization_config (the experts are now in the config's dtype) and
    generation_config.json."""
    from transformers import GenerationConfig

    config, skeleton = meta_model(checkpoint)
    stored = _StoredTensors(mxfp4_loading.weight_files(checkpoint), config.dtype)
    places = _places(skeleton, stored)
    planned = {name: _as_loaded(getattr(*place), config.dtype) for name, place in places.items()}
    largest_stored_shard = max(path.stat().st_size for path in set(stored.files.values()))
    shards = shard_writing.ShardedModel(output, planned, largest_stored_shard, skeleton.num_parameters())
    adapted = adapter_on(skeleton, adapter_dir, base_model)
    units = _merge_units(skeleton)
    names_of: dict[str | None, list[str]] = {}
    for name in planned:
        names_of.setdefault(_unit_of(name, units), []).append(name)
    adapter_file = Path(adapter_dir) / ADAPTER_WEIGHTS
    for name in planned:  # in order, so that each output shard is written through before the next one opens
        unit_name = _unit_of(name, units)
        if unit_name is None:
            for rows in stored.pieces(name):
                shards.write(name, stored.rows(name, rows))
        elif name == names_of[unit_name][0]:
            unit = units[unit_name]
            if _is_expert_stack(unit):
                _merge_expert_stack(adapted, unit_name, unit, names_of[unit_name], stored, shards, adapter_file)
            else:
                merged = _merged_unit(adapted, unit_name, unit, names_of[unit_name], places, stored, adapter_file)
                for merged_name, tensor in merged.items():
                    shards.write(merged_name, tensor)
    shards.close()
    config.save_pretrained(output)
    if (checkpoint / "generation_config.json").is_file():  # as from_pretrained reads it; else from the config
        skeleton.generation_config = GenerationConfig.from_pretrained(checkpoint)
    skeleton.generation_config.save_pretrained(output)


def meta_model(checkpoint: Path):
    """(config without quantization_config, as the merged model's experts are in its dtype; the model on the meta
    device)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    del config.quantization_config
    with init_empty_weights(include_buffers=False):
        return config, AutoModelForCausalLM.from_config(config, dtype=config.dtype)


def adapter_on(skeleton: torch.nn.Module, adapter_dir: str, base_model: str):
    """The adapter's PeftModel on the meta `skeleton` (peft wraps the skeleton's modules): its weights are read and
    left out, each module's read again when it is merged."""
    with warnings.catch_warnings():  # torch's: the adapter's weights are not copied into the meta skeleton, on purpose
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*to a meta parameter")
        return load_adapter(skeleton, adapter_dir, base_model, "--base_model")


class _StoredTensors:
    """The checkpoint's tensors under their in-memory names (an expert weight's from its blocks and scales), read a
    run of leading rows at a time, each from a fresh memory map of its shard, so that no page stays mapped once read."""

    def __init__(self, files: dict[str, Path], dtype: torch.dtype):
        self.files, self.dtype = files, dtype
        self.names = list(dict.fromkeys(name.removesuffix(PACKED_SUFFIXES[0]).removesuffix(PACKED_SUFFIXES[1])
                                        for name in files))

    def packed(self, name: str) -> bool:
        return f"{name}{PACKED_SUFFIXES[0]}" in self.files

    def pieces(self, name: str) -> list[slice]:
        """Runs of leading rows: EXPERTS_PER_CHUNK experts of an expert weight, about VALUES_PER_PIECE values of any
        other tensor."""
        if self.packed(name):
            rows, per_piece = self._shape(f"{name}{PACKED_SUFFIXES[1]}")[0], EXPERTS_PER_CHUNK
        else:
            shape = self._shape(name)
            if not shape:
                return [slice(None)]
            rows, per_piece = shape[0], max(1, VALUES_PER_PIECE // max(1, math.prod(shape[1:])))
        return [slice(start, min(start + per_piece, rows)) for start in range(0, rows, per_piece)]

    def rows(self, name: str, rows: slice) -> torch.Tensor:
        """Those rows as from_pretrained(dtype="auto") holds them: floating tensors in the config's dtype."""
        if self.packed(name):
            blocks, scales = (self._read(f"{name}{suffix}", rows) for suffix in PACKED_SUFFIXES)
            return mxfp4_experts.dequantize(blocks, scales, self.dtype)
        tensor = self._read(name, rows)
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def whole(self, name: str) -> torch.Tensor:
        pieces = [self.rows(name, rows) for rows in self.pieces(name)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _read(self, stored_name: str, rows: slice) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[stored_name]), "pt") as tensors:
            if rows == slice(None):
                return tensors.get_tensor(stored_name)
            return tensors.get_slice(stored_name)[rows]

    def _shape(self, stored_name: str) -> list[int]:
        from safetensors import safe_open

        with safe_open(str(self.files[stored_name]), "pt") as tensors:
            return tensors.get_slice(stored_name).get_shape()


def _places(skeleton: torch.nn.Module, stored: _StoredTensors) -> dict[str, tuple[torch.nn.Module, str]]:
    """Each tensor the checkpoint stores (an expert weight under its unpacked name), in the model's state_dict order
    -> its module and attribute, read before peft wraps the modules (the modules themselves stay, inside peft's
    wrappers)."""
    known = skeleton.state_dict(keep_vars=True)
    unknown = [name for name in stored.names if name not in known]
    if unknown:
        stored_name = next(name for name in stored.files if name.startswith(unknown[0]))
        raise UserError(f"{stored.files[stored_name]}: holds {stored_name}, which the model built from its "
                        f"config.json does not have; re-download the model.")
    places = {}
    for name in known:
        if name in stored.names:
            module_name, _, attribute = name.rpartition(".")
            places[name] = (skeleton.get_submodule(module_name), attribute)
    return places


def _as_loaded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of the shape and dtype from_pretrained(dtype="auto") gives `tensor`."""
    return torch.empty(tensor.shape, device="meta", dtype=dtype if tensor.is_floating_point() else tensor.dtype)


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


def _make_real(place: tuple[torch.nn.Module, str], tensor: torch.Tensor) -> None:
    module, attribute = place
    if attribute in module._parameters:
        module._parameters[attribute] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[attribute] = tensor


def _merged_unit(adapted, unit_name: str, unit: torch.nn.Module, names: list[str], places: dict,
                 stored: _StoredTensors, adapter_file: Path) -> dict[str, torch.Tensor]:
    """The merged tensors of a wrapped module (an attention projection): its base tensors and adapter weights made
    real, merged and unloaded by peft's code for that module, then the module made meta again."""
    for name in names:
        _make_real(places[name], stored.whole(name))
    _load_adapter_weights(adapted, unit_name, unit.modules(), adapter_file)
    if hasattr(unit, "unload_and_optionally_merge_module"):
        base = unit.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
    else:
        unit.merge()
        base = unit.get_base_layer()
    state = base.state_dict()
    merged = {name: state[name.removeprefix(f"{unit_name}.")] for name in names}
    unit.to("meta")
    return merged


def _load_adapter_weights(adapted, unit_name: str, modules, adapter_file: Path) -> None:
    """The adapter's weights for the module `unit_name`, in the meta parameters of `modules` made real, loaded by peft
    (`set_peft_model_state_dict`, as from_pretrained loads them)."""
    from peft import set_peft_model_state_dict
    from safetensors import safe_open

    for module in modules:
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(parameter, device="cpu"),
                                                              requires_grad=parameter.requires_grad)
    prefix = f"base_model.model.{unit_name}."
    with safe_open(str(adapter_file), "pt") as adapter_weights:  # opened per module: its mapped pages stay resident
        own = {key: adapter_weights.get_tensor(key) for key in adapter_weights.keys() if key.startswith(prefix)}
    set_peft_model_state_dict(adapted, own)


def _is_expert_stack(unit: torch.nn.Module) -> bool:
    """peft's wrappers of a stack of experts' parameters (one per parameter, nested), each with one adapter."""
    return isinstance(unit, ParamWrapper) and all(wrapper.num_experts > 1 and len(wrapper.active_adapters) == 1
                                                  for wrapper in _wrappers(unit))


def _wrappers(unit: ParamWrapper) -> list[ParamWrapper]:
    wrappers = [unit]
    while isinstance(wrappers[-1].base_layer, ParamWrapper):
        wrappers.append(wrappers[-1].base_layer)
    return wrappers


def _merge_expert_stack(adapted, unit_name: str, unit: ParamWrapper, names: list[str], stored: _StoredTensors,
                        shards: shard_writing.ShardedModel, adapter_file: Path) -> None:
    """Each tensor of the experts module, written EXPERTS_PER_CHUNK experts at a time: a wrapped weight's chunk is
    the stored chunk plus that chunk's delta (`ParamWrapper.merge` with no safe merge, the active adapter). peft's
    `get_delta_weight` forms the whole stack's delta in float32 twice (17 GiB for one 120B gate_up_proj); its einsum
    is per expert, so a chunk's delta is the whole delta's rows: the same einsum, scaling and rounding to the weight's
    dtype, added as peft adds it."""
    wrappers = {wrapper.parameter_name: wrapper for wrapper in _wrappers(unit)}
    base = unit.get_base_layer()
    _load_adapter_weights(adapted, unit_name, [module for module in unit.modules() if module is not base],
                          adapter_file)
    for name in names:
        wrapper = wrappers.get(name.rpartition(".")[2])
        for experts in stored.pieces(name):
            merged = stored.rows(name, experts)
            if wrapper is not None:
                merged += _delta(wrapper, experts).to(merged.dtype)
            shards.write(name, merged)
    unit.to("meta")


def _delta(wrapper: ParamWrapper, experts: slice) -> torch.Tensor:
    """Rows `experts` of peft's `ParamWrapper.get_delta_weight` for the active adapter, in float32."""
    (adapter,) = wrapper.active_adapters
    weight_a = wrapper.lora_A[adapter].weight
    weight_b = wrapper.lora_B[adapter].weight
    weight_a = weight_a.reshape(wrapper.num_experts, -1, weight_a.shape[-1])  # experts x rank x in_features
    weight_b = weight_b.reshape(weight_b.shape[0], -1, wrapper.num_experts)  # out_features x rank x experts
    # stored [experts, out_features, in_features] when peft swapped them
    product = "o r e, e r i -> e o i" if wrapper._did_swap_in_out_features else "o r e, e r i -> e i o"
    return torch.einsum(product, weight_b[..., experts], weight_a[experts]) * wrapper.scaling[adapter]
