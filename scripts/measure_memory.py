"""Measure peak GPU memory of real SFT steps and compare it with finetune.plan's estimate (benchmarks/memory.py).

    python scripts/measure_memory.py                 # on a CUDA GPU: every case, results in $OUT (or outputs/)
    python scripts/measure_memory.py --tiny          # on CPU: the tiny models, checks the script still runs
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.memory import main  # noqa: E402  (benchmarks/ is beside finetune/, not installed with it)

if __name__ == "__main__":
    sys.exit(main())
