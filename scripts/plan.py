"""`python scripts/plan.py --config recipes/X.yaml --gpus 8 --gpu H100`: the same as `finetune plan ...`."""
import sys; sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))  # noqa: E702
from finetune.cli import main; sys.exit(main(["plan", *sys.argv[1:]]))  # noqa: E702,E401
