"""Merge a LoRA adapter into its base model: python scripts/merge_lora.py ADAPTER_DIR OUTPUT_DIR [--base_model ID]."""

import argparse

from finetune.config import exit_on_user_error
from finetune.merge import merge_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("adapter_dir", help="a LoRA run's output_dir")
    parser.add_argument("output_dir", help="where to write the merged model")
    parser.add_argument("--base_model", help="base model id or folder (default: the one the adapter was trained on)")
    args = parser.parse_args()
    print(f"merged model written to {merge_adapter(args.adapter_dir, args.output_dir, args.base_model)}")


if __name__ == "__main__":
    exit_on_user_error(main)
