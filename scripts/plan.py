"""`python scripts/plan.py --config recipes/X.yaml --gpus 8 --gpu H100`: the same as `finetune plan ...`."""

import sys

from finetune.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
