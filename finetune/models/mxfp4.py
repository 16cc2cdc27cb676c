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
