"""GPT-OSS checkpoints as the hub ships them: mixture-of-experts weights in MXFP4, everything else in bf16. A run
recognises one here; loading then either asks transformers to dequantize the experts (`dequantize_mxfp4: true`,
finetune/run/model.py) or keeps them packed on the GPU (`false`: mxfp4_loading.py, mxfp4_experts.py), and a LoRA merge
goes into the experts dequantized shard by shard (finetune/run/merging.py). The format itself, with a writer and an
independent reader for the tests and benchmarks, is in benchmarks/mxfp4_checkpoints.py.
"""

import json
from pathlib import Path

from finetune.families import FAMILIES


def is_mxfp4_checkpoint(model_name_or_path: str) -> bool:
    """A local folder whose config.json says MXFP4, or one of OpenAI's GPT-OSS hub checkpoints."""
    config_file = Path(model_name_or_path).expanduser() / "config.json"
    if config_file.is_file():
        try:
            quantization = json.loads(config_file.read_text()).get("quantization_config") or {}
        except (ValueError, AttributeError):  # a damaged config.json: model.check_model names it
            return False
        return quantization.get("quant_method") == "mxfp4"
    return any(family.mxfp4_hub_checkpoints and model_name_or_path in family.hub_ids for family in FAMILIES.values())


BLOCK = 32  # values that share one scale byte (mxfp4_experts.BLOCK, which imports torch)


def packed_shapes(config: dict) -> dict[str, list[int]]:
    """The shape config.json implies for each packed expert tensor, by its name's last part (all of them uint8): a
    weight used [experts, in, out] is stored [experts, out, in / 32, 16] (two FP4 values a byte) with scales
    [experts, out, in / 32]."""
    experts, hidden, intermediate = (config.get(key) for key in ("num_local_experts", "hidden_size",
                                                                  "intermediate_size"))
    if not all(isinstance(size, int) for size in (experts, hidden, intermediate)):
        return {}  # a config.json without them cannot build the model: from_config names the field
    rows = {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}
    shapes = {}
    for weight, (outputs, inputs) in rows.items():
        shapes[f"{weight}_blocks"] = [experts, outputs, inputs // BLOCK, BLOCK // 2]
        shapes[f"{weight}_scales"] = [experts, outputs, inputs // BLOCK]
    return shapes


def packed_problem(config: dict, headers: dict[Path, dict]) -> str | None:
    """The first packed expert tensor of the safetensors `headers` (by shard) whose dtype or shape is not what
    config.json implies, or whose blocks come without scales, as a sentence naming it; None when all are right. Read
    from the headers only, before loading: a wrong one would be broadcast, cast to zeros, or fail in a traceback."""
    shapes = packed_shapes(config)
    stored = {name: (shard, entry) for shard, header in headers.items() for name, entry in header.items()
              if name.rsplit(".", 1)[-1] in shapes}
    implied = (f"config.json ({config.get('num_local_experts')} experts, hidden_size {config.get('hidden_size')}, "
               f"intermediate_size {config.get('intermediate_size')})")
    for name, (shard, entry) in sorted(stored.items()):
        expected = shapes[name.rsplit(".", 1)[-1]]
        if entry.get("dtype") != "U8" or entry.get("shape") != expected:
            return (f"{shard}: {name} is stored as {entry.get('dtype')} {entry.get('shape')}, where {implied} "
                    f"implies U8 {expected}")
        partner = name.removesuffix("_blocks") + "_scales"
        if name.endswith("_blocks") and partner not in stored:
            return f"{shard}: {name} has no {partner} beside it in any shard"
    return None
