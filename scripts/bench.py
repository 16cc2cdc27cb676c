"""Benchmark plain TRL against this project's recipes on one GPU (or, with --tiny, on the CPU in seconds).

    python scripts/bench.py --out $OUT            # GPU: every case, bench.md + bench.json under --out
    python scripts/bench.py --tiny --out /tmp/b   # CPU: tiny models, a few steps (tests/test_benchmarks.py)

The benchmark lives in benchmarks/ beside the library (runner.py, cases.py, models.py, report.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.runner import main  # noqa: E402  (benchmarks/ is beside finetune/, not installed with it)

if __name__ == "__main__":
    main()
