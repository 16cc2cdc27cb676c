"""Merge a trained LoRA adapter into its base model, giving a folder that loads without peft."""

import json
from pathlib import Path

from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.errors import UserError


def merge_adapter(adapter_dir: str, output_dir: str, base_model: str | None = None) -> Path:
    adapter_config = Path(adapter_dir) / "adapter_config.json"
    if not adapter_config.is_file():
        raise UserError(f"{adapter_dir}: no adapter_config.json, so it is not a LoRA output; pass a LoRA run's output_dir.")
    output = Path(output_dir)
    if output.exists() and any(output.iterdir()):
        raise UserError(f"{output_dir}: already holds files; pass an empty or new folder to write the merged model.")
    base_model = base_model or json.loads(adapter_config.read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_model, dtype="auto")
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(output)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(output)
    return output
