"""The GPU benchmarks, beside the library and not installed with it: throughput against plain TRL (runner.py, run by
scripts/bench.py) and the planner's memory estimates against measured peaks (memory.py, scripts/measure_memory.py),
sharing one random-weight model builder (models.py), one step timer (runner.StepTimer) and one report module."""
