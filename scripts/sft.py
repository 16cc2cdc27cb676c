"""Supervised fine-tuning: parse the recipe, check it, load data and model, train, save (finetune/sft.py).

    accelerate launch [--config_file accelerate_configs/NAME.yaml] scripts/sft.py --config recipes/MODEL/METHOD.yaml [--tiny]

With no arguments it trains the tiny Llama on the bundled sample data (see finetune/run/arguments.py DEFAULT_ARGS).
"""

from finetune.errors import exit_on_user_error
from finetune.sft import main

if __name__ == "__main__":
    exit_on_user_error(main)
