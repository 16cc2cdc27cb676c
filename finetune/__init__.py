"""finetune: supervised fine-tuning recipes for Llama 3.2 and GPT-OSS over TRL, peft, accelerate and DeepSpeed."""

__version__ = "0.1.0"
