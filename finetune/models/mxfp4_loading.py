"""Loading a GPT-OSS MXFP4 checkpoint with its experts kept as stored (`dequantize_mxfp4: false`): the model is built
on the meta device, its experts made resident (finetune/models/mxfp4_experts.py), and every tensor is copied from the
safetensors shards straight into its place on the device, one tensor at a time: blocks and scales as uint8, the rest
in the training dtype. No bf16 copy of the experts exists anywhere, and host memory holds at most one tensor of a
memory-mapped shard.

transformers' own MXFP4 loading without dequantizing needs the `kernels` package and a hub download of OpenAI's
Triton kernels, and silently dequantizes when they are missing; this path needs neither.
"""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from finetune.errors import UserError, say
from finetune.models import mxfp4_experts

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def checkpoint_folder(model_name_or_path: str, revision: str | None) -> Path:
    """A local folder as it is; a hub id through huggingface_hub's cache (its config, index and shards only: the hub
    repos also hold `original/` and `metal/` copies of the weights)."""
    folder = Path(model_name_or_path).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model_name_or_path, revision=revision,
                                  allow_patterns=["config.json", "generation_config.json", "model*.safetensors",
                                                  INDEX]))


def weight_files(folder: Path) -> dict[str, Path]:
    """Each stored tensor's name -> the shard that holds it."""
    if (folder / INDEX).is_file():
        weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / shard for name, shard in weight_map.items()}
    from safetensors import safe_open

    with safe_open(str(folder / SINGLE), "pt") as single:
        return dict.fromkeys(single.keys(), folder / SINGLE)


def _materialize(model: torch.nn.Module, device: torch.device) -> None:
    """Meta parameters become empty ones on `device`; buffers built for real (the rotary frequencies) move there."""
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.is_meta:
                setattr(module, name, torch.nn.Parameter(torch.empty_like(parameter, device=device),
                                                         requires_grad=parameter.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)


def load(model_name_or_path: str, device: torch.device | str, dtype: torch.dtype | str = "auto",
         revision: str | None = None, **from_config_kwargs) -> PreTrainedModel:
    """The model of an MXFP4 checkpoint (a local folder, sharded or not, or a hub id) on `device` with its experts
    resident in MXFP4. `from_config_kwargs`: attn_implementation, experts_implementation, trust_remote_code."""
    from accelerate import init_empty_weights

    device = torch.device(device)
    folder = checkpoint_folder(model_name_or_path, revision)
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # the experts are handled here, not by transformers' quantizer
    dtype = config.dtype if dtype == "auto" else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    config.name_or_path = model_name_or_path
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **from_config_kwargs)
    files = weight_files(folder)
    for name in sorted(files):
        if name.endswith("_blocks"):
            module_name, weight = name.removesuffix("_blocks").rsplit(".", 1)
            experts = model.get_submodule(module_name)
            if not isinstance(experts, mxfp4_experts.ResidentExperts):
                if not mxfp4_experts.fits(experts):
                    raise UserError(f"{folder}: {module_name} stores MXFP4 weights but is no GPT-OSS experts module; "
                                    f"set `dequantize_mxfp4: true` to load it dequantized.")
                mxfp4_experts.make_resident(experts, device, dtype)
    _materialize(model, device)
    _fill(model, files, device)
    say_without_triton(device)
    model.eval()
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def say_without_triton(device: torch.device) -> None:
    """Resident experts on a GPU compute through Triton kernels, which the plan counts on; without triton they fall
    back to torch's own operations, slower and with larger temporaries: said once, with the fix."""
    if device.type == "cuda" and mxfp4_experts.without_triton():
        say("triton is not installed: the MXFP4 experts are dequantized with torch's operations instead of its kernels "
            "(slower, and more memory than `finetune plan` counts); `pip install triton` fixes it.")


@torch.no_grad()
def _fill(model: torch.nn.Module, files: dict[str, Path], device: torch.device) -> None:
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)
    unknown = sorted(set(files) - set(targets))
    if unknown:
        raise UserError(f"{files[unknown[0]]}: holds {unknown[0]}, which the model built from its config.json does "
                        f"not have; re-download the model.")
    filled = set()
    for shard in sorted(set(files.values())):
        with safe_open(str(shard), "pt", device=str(device)) as tensors:
            for name in tensors.keys():
                targets[name].copy_(tensors.get_tensor(name))
                filled.add(targets[name].data_ptr())
    missing = [name for name, tensor in targets.items()
               if tensor.data_ptr() not in filled and not mxfp4_experts.is_placeholder(tensor)]
    if missing:
        raise UserError(f"{next(iter(files.values())).parent}: stores no {missing[0]}; re-download the model.")
