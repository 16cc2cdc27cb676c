"""GPT-OSS checkpoints as the hub ships them (mixture-of-experts weights in MXFP4, everything else in bf16), written
and read back here for the tests and benchmarks. A run only recognises one (finetune/models/mxfp4.py); transformers
dequantizes it on load.

The format (OCP Microscaling, as openai/gpt-oss-* store it): each expert matrix is stored [out, in], cut along `in`
into blocks of 32 values that share one power-of-two scale. A value is FP4 e2m1 (a sign bit and one of 0, 0.5, 1, 1.5,
2, 3, 4, 6), two per byte, the even-indexed value in the low nibble. A scale is E8M0: the byte `s` means 2**(s - 127).

    model.layers.N.mlp.experts.gate_up_proj_blocks  uint8 [experts, 2 * intermediate, hidden / 32, 16]
    model.layers.N.mlp.experts.gate_up_proj_scales  uint8 [experts, 2 * intermediate, hidden / 32]
    model.layers.N.mlp.experts.down_proj_blocks     uint8 [experts, hidden, intermediate / 32, 16]
    model.layers.N.mlp.experts.down_proj_scales     uint8 [experts, hidden, intermediate / 32]

transformers holds the same weights [experts, in, out] (`gate_up_proj` [E, hidden, 2 * intermediate], gate and up
interleaved along `out` in both), so stored = in-memory transposed. This module writes such checkpoints from a bf16
or float32 state dict (the tiny test model, or random weights of the real architecture) and dequantizes them
independently of transformers, so that what transformers loads can be checked against the format itself.
"""

import json
from pathlib import Path

import torch

BLOCK = 32
SCALE_BIAS = 127
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_EMAX = 2  # the largest magnitude, 6 = 1.5 * 2**2
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
# What openai/gpt-oss-20b and -120b carry in config.json.
QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 blocks and scales of an in-memory expert weight [experts, in, out] (round to nearest FP4 value).

    The shared exponent is floor(log2(max |x| of the block)) - 2, so that the largest value of each block lands in
    [4, 8) before rounding (values that round past 6 are clamped to 6)."""
    stored = weight.detach().to(torch.float32).transpose(1, 2)  # [experts, out, in]
    experts, rows, columns = stored.shape
    if columns % BLOCK:
        raise ValueError(f"the input dimension {columns} is not a multiple of the MXFP4 block size {BLOCK}")
    blocks = stored.reshape(experts, rows, columns // BLOCK, BLOCK)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.where(largest > 0, torch.floor(torch.log2(largest)) - FP4_EMAX, torch.zeros_like(largest))
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = blocks / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent.squeeze(-1) + SCALE_BIAS).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The in-memory weight [experts, in, out] that stored blocks [E, out, in/32, 16] and scales [E, out, in/32]
    stand for, computed from the format's definition."""
    values = torch.tensor([sign * magnitude for sign in (1.0, -1.0) for magnitude in FP4_MAGNITUDES])
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, out, in/32, 32]
    weights = values[codes] * torch.exp2(scales.to(torch.float32) - SCALE_BIAS).unsqueeze(-1)
    experts, rows, groups, _ = weights.shape
    return weights.reshape(experts, rows, groups * BLOCK).transpose(1, 2).to(dtype).contiguous()


def to_hub_tensors(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors a hub checkpoint stores for one in-memory tensor: blocks and scales for an expert weight,
    the tensor itself in bf16 otherwise (expert biases included). Blocks and scales given as such are kept."""
    if name.endswith(("_blocks", "_scales")):
        return {name: tensor.contiguous()}
    for weight in EXPERT_WEIGHTS:
        if name.endswith(f"mlp.experts.{weight}"):
            blocks, scales = quantize(tensor)
            return {f"{name}_blocks": blocks, f"{name}_scales": scales}
    return {name: tensor.detach().to(torch.bfloat16).contiguous()}


def random_hub_tensors(shapes: dict, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """(name, tensor) of a GPT-OSS state dict's SHAPES as the hub stores them, random: the experts as FP4 codes with
    scales around 2**-7 (values within +-0.05), the norms 1, the rest N(0, 0.02) in DTYPE; drawn on the generator's
    device one tensor at a time and handed over on the CPU."""
    device = generator.device
    for name, shape in shapes.items():
        if name.endswith(EXPERT_WEIGHTS):
            experts, columns, rows = shape
            groups = columns // BLOCK
            yield f"{name}_blocks", torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8,
                                                  generator=generator, device=device).cpu()
            yield f"{name}_scales", torch.randint(118, 122, (experts, rows, groups), dtype=torch.uint8,
                                                  generator=generator, device=device).cpu()
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype)
        else:
            yield name, (torch.randn(shape, generator=generator, device=device) * 0.02).to(dtype).cpu()


def write_checkpoint(config, named_tensors, folder: Path, shard_bytes: int = 4 << 30) -> Path:
    """Write a GPT-OSS model as the hub ships it: `model-0000N-of-0000M.safetensors` shards, their
    `model.safetensors.index.json` and a config.json with MXFP4 `quantization_config` and bf16 dtype.

    `named_tensors` yields (name, in-memory tensor) pairs, one at a time, so that a real-size model can be written
    without holding it whole."""
    folder.mkdir(parents=True, exist_ok=True)
    shards, current, current_bytes = [], {}, 0
    for name, tensor in named_tensors:
        for stored_name, stored in to_hub_tensors(name, tensor).items():
            if current and current_bytes + stored.nbytes > shard_bytes:
                shards.append(_write_shard(current, folder, len(shards)))
                current, current_bytes = {}, 0
            current[stored_name] = stored
            current_bytes += stored.nbytes
    if current:
        shards.append(_write_shard(current, folder, len(shards)))
    weight_map, total = {}, 0
    for index, (path, names, size) in enumerate(shards):
        final = folder / f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        path.rename(final)
        weight_map.update(dict.fromkeys(names, final.name))
        total += size
    index_file = folder / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config = config.__class__.from_dict(config.to_dict())
    config.quantization_config = dict(QUANTIZATION_CONFIG)
    config.dtype = torch.bfloat16
    config.architectures = ["GptOssForCausalLM"]
    config.save_pretrained(folder)
    return folder


def _write_shard(tensors: dict, folder: Path, number: int) -> tuple[Path, list[str], int]:
    import safetensors.torch

    path = folder / f".shard-{number}.safetensors"
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return path, sorted(tensors), sum(tensor.nbytes for tensor in tensors.values())


def resharded(folder: Path, target: Path, shard_bytes: int) -> Path:
    """The checkpoint in `folder` written again into `target` in shards of at most `shard_bytes`, with its generation
    config and tokenizer."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    stored = {}
    for shard in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(str(shard)))
    write_checkpoint(AutoConfig.from_pretrained(folder), sorted(stored.items()), target, shard_bytes=shard_bytes)
    _copy_beside_weights(folder, target)
    return target


def stored_expert_weights(folder: Path, layer: int | None = None) -> dict[str, torch.Tensor]:
    """Every expert weight of a checkpoint folder (or of one layer), dequantized here from its stored blocks and
    scales."""
    from safetensors import safe_open

    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {}
    for name in sorted(index):
        if not name.endswith("_blocks") or layer is not None and not name.startswith(f"model.layers.{layer}."):
            continue
        weight = name.removesuffix("_blocks")
        with safe_open(str(folder / index[name]), "pt") as blocks_file:
            blocks = blocks_file.get_tensor(name)
        with safe_open(str(folder / index[f"{weight}_scales"]), "pt") as scales_file:
            scales = scales_file.get_tensor(f"{weight}_scales")
        weights[weight] = dequantize(blocks, scales)
    return weights


def expected_shapes(config) -> dict[str, tuple[list[int], str]]:
    """Per layer-independent suffix, the shape and dtype the hub stores for each expert tensor of `config`."""
    experts, hidden, intermediate = config.num_local_experts, config.hidden_size, config.intermediate_size
    return {
        "mlp.experts.gate_up_proj_blocks": ([experts, 2 * intermediate, hidden // BLOCK, BLOCK // 2], "U8"),
        "mlp.experts.gate_up_proj_scales": ([experts, 2 * intermediate, hidden // BLOCK], "U8"),
        "mlp.experts.gate_up_proj_bias": ([experts, 2 * intermediate], "BF16"),
        "mlp.experts.down_proj_blocks": ([experts, hidden, intermediate // BLOCK, BLOCK // 2], "U8"),
        "mlp.experts.down_proj_scales": ([experts, hidden, intermediate // BLOCK], "U8"),
        "mlp.experts.down_proj_bias": ([experts, hidden], "BF16"),
    }


def _copy_beside_weights(source: Path, target: Path) -> None:
    import shutil

    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def tiny_checkpoint() -> Path:
    """The tiny GPT-OSS written as the hub ships openai/gpt-oss-*: experts in MXFP4 (blocks and scales), every other
    tensor in bf16, sharded with an index, `quantization_config: {quant_method: mxfp4}` in config.json. Written once
    beside the tiny model's folder and reused."""
    import shutil
    import tempfile

    import safetensors.torch
    from transformers import AutoConfig

    from finetune.models import tiny

    source = tiny.tiny_model_folder("gpt-oss")
    folder = source.parent / f"{source.name}-mxfp4"
    if (folder / "config.json").is_file():
        return folder
    staging = Path(tempfile.mkdtemp(dir=source.parent, prefix=f".{folder.name}-"))
    tensors = safetensors.torch.load_file(str(source / "model.safetensors"))
    write_checkpoint(AutoConfig.from_pretrained(source), sorted(tensors.items()), staging)
    _copy_beside_weights(source, staging)
    try:
        staging.rename(folder)
    except OSError:  # another process finished first; its folder is identical
        shutil.rmtree(staging, ignore_errors=True)
    return folder
