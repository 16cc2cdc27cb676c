"""Benchmark plain TRL against this project's recipes on one GPU (or, with --tiny, on the CPU in seconds).

    python scripts/bench.py --out $OUT            # GPU: every case, bench.md + bench.json under --out
    python scripts/bench.py --tiny --out /tmp/b   # CPU: tiny models, a few steps (tests/test_bench.py)

The logic lives in finetune/bench.py.
"""

from finetune.bench import main

if __name__ == "__main__":
    main()
