"""Peak GPU memory of real SFT steps against finetune.planner's estimate: `--help`, or benchmarks/memory.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import main  # noqa: E402  (benchmarks/ is beside finetune/, not installed with it)

if __name__ == "__main__":
    sys.exit(main())
