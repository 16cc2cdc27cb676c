"""Merge a LoRA adapter into its base model: python scripts/merge_lora.py ADAPTER_DIR OUTPUT_DIR [--base_model ID]."""

import sys

from finetune.cli import main

if __name__ == "__main__":
    sys.exit(main(["merge", *sys.argv[1:]]))
