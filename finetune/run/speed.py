"""The run's speed as the user's clock sees it, written beside the model (`finetune_speed.json`) and said in one line:
seconds from the process's start to the first optimizer step (loading and compiling included), real (non-padding)
tokens per second over the whole run and after the warm-up steps, peak GPU memory, and how many graphs the compiler
built. TRL counts the real tokens (`num_tokens`, every logging step); the times are taken at the first step and at
the steps that log, the GPU waited for there; the benchmarks read this file (with `logging_steps: 1`) rather than
timing steps of their own.
"""

import json
import logging
import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from finetune.errors import say

SPEED_RECORD = "finetune_speed.json"


WARMUP_STEPS = 5  # steady state: from the first logged step after these to the last
# Wall-clock moments (time.time()) of the run's start-up, written into the record: a benchmark subtracts its own launch
# time from them. finetune/sft.py marks them; on_train_begin and the steps add the rest.
MOMENTS: dict[str, float] = {}


def mark(moment: str) -> None:
    MOMENTS[moment] = time.time()


def process_start_time() -> float:
    """When this process started (Linux: /proc), else now."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + started
    except (OSError, ValueError, IndexError):
        return time.time()


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def compile_seconds() -> dict[str, float]:
    """Seconds spent so far in each timed phase of compiling (dynamo's tracing, AOTAutograd, inductor's lowering and
    code generation, waiting for the Triton workers), summed over the graphs: where a first step's wait goes."""
    from torch._dynamo.utils import compilation_time_metrics

    return {phase: round(sum(times), 2) for phase, times in compilation_time_metrics.items() if sum(times) >= 0.05}


# torch's loggers that say why a compiled graph was not cached (finetune/patches.py: CompileCacheEvents)
CACHE_LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")
CACHE_COUNTERS = {"inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
                  "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass",
                                   "autograd_cache_saved")}


class CompileCacheEvents(logging.Filter):
    """Collects the reasons torch gives for not caching a graph; passes on only the records torch's own level
    (TORCH_LOGS) would have let through."""

    def __init__(self):
        super().__init__()
        self.reasons: dict[str, int] = {}
        self.own_levels = {name: logging.getLogger(name).level for name in CACHE_LOGGERS}  # restored by close
        self.levels = {name: logging.getLogger(name).getEffectiveLevel() for name in CACHE_LOGGERS}
        for name in CACHE_LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(min(logging.INFO, self.levels[name]))
            logger.addFilter(self)

    def close(self) -> None:
        """The loggers as they were: a later run in this process (the Python API) listens afresh."""
        for name, level in self.own_levels.items():
            logger = logging.getLogger(name)
            logger.removeFilter(self)
            logger.setLevel(level)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "Bypassing" in message or "unable to serialize" in message:
            reason = message.split("\n")[0][:300]
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        return record.levelno >= self.levels.get(record.name, logging.WARNING)


def compile_caches(events: CompileCacheEvents | None) -> dict:
    """Graphs loaded from the compile caches (hit), not found there (miss; AOTAutograd stores only those Inductor
    compiled: `saved`), and compiled without them (bypass), by Inductor and by AOTAutograd, with the reasons torch
    gave for each bypass."""
    from torch._dynamo.utils import counters

    found = {name: counters[group][name] for group, names in CACHE_COUNTERS.items() for name in names}
    return {**found, "not_cached_because": dict(events.reasons) if events else {}}


class SpeedRecord(TrainerCallback):
    def __init__(self, output_dir: str, is_main_process: bool, compiled: bool = False):
        self.path = Path(output_dir) / SPEED_RECORD
        self.is_main_process = is_main_process
        self.cache_events = CompileCacheEvents() if compiled else None
        self.started = process_start_time()
        self.train_begin = None
        self.started_at_step = None
        self.max_steps = None
        self.steps: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        """The Trainer has loaded a resumed checkpoint's state by now: its step is where this launch starts."""
        self.train_begin = time.time()
        self.started_at_step, self.max_steps = state.global_step, state.max_steps

    def on_step_end(self, args, state, control, **kwargs):
        """The first step, the steps that log (the Trainer's flow callback has decided that by now) and the last:
        the GPU is waited for only there, not at every step of the run."""
        if self.steps and not control.should_log and state.global_step < state.max_steps:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.steps.append({"step": state.global_step, "time": time.time(), "compiled_graphs": compiled_graphs()})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "num_tokens" in logs and self.steps and self.steps[-1]["step"] == state.global_step:
            self.steps[-1]["num_tokens"] = int(logs["num_tokens"])

    def on_train_end(self, args, state, control, **kwargs):
        record = self.summary() if self.is_main_process and self.steps else None
        if self.cache_events:
            self.cache_events.close()
        if record is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(record, indent=1) + "\n")
        say(f"speed: {describe(record)} ({self.path})")

    def summary(self) -> dict:
        first, last = self.steps[0], self.steps[-1]
        counted = [entry for entry in self.steps if "num_tokens" in entry]
        steady = [entry for entry in counted if entry["step"] >= first["step"] + WARMUP_STEPS]
        record = {
            "process_start": self.started,
            **MOMENTS,
            "train_begin": self.train_begin,
            "started_at_step": self.started_at_step,
            "max_steps": self.max_steps,
            "seconds_to_first_step": round(first["time"] - self.started, 2),
            "seconds_to_last_step": round(last["time"] - self.started, 2),
            "steps": last["step"] - first["step"] + 1,
            "compiled_graphs": last["compiled_graphs"],
            "compile_seconds": compile_seconds(),
            "compile_caches": compile_caches(self.cache_events),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available()
            else None,
            # each retry freed the allocator's cache and waited for the GPU: memory near full, every step slower
            "allocator_retries": torch.cuda.memory_stats().get("num_alloc_retries") if torch.cuda.is_available()
            else None,
            "step_log": self.steps,
        }
        if counted:
            record["real_tokens"] = counted[-1]["num_tokens"]
            seconds = counted[-1]["time"] - self.started
            record["real_tokens_per_s_whole_run"] = round(counted[-1]["num_tokens"] / seconds)
        if len(steady) >= 2:
            tokens = steady[-1]["num_tokens"] - steady[0]["num_tokens"]
            record["real_tokens_per_s_steady"] = round(tokens / (steady[-1]["time"] - steady[0]["time"]))
        return record


def describe(record: dict) -> str:
    parts = [f"first optimizer step {record['seconds_to_first_step']:.0f} s after the process started"]
    if "real_tokens_per_s_whole_run" in record:
        parts.append(f"{record['real_tokens']:,} real tokens at {record['real_tokens_per_s_whole_run']:,} tok/s over "
                     f"the run")
    if "real_tokens_per_s_steady" in record:
        parts.append(f"{record['real_tokens_per_s_steady']:,} tok/s after step {WARMUP_STEPS}")
    if record["peak_memory_gib"] is not None:
        parts.append(f"peak {record['peak_memory_gib']} GiB")
    parts.append(f"{record['compiled_graphs']} compiled graphs")
    caches = record.get("compile_caches", {})
    if caches.get("fxgraph_cache_hit") or caches.get("fxgraph_cache_miss"):
        parts.append(f"{caches['fxgraph_cache_hit']} loaded from the compile cache, {caches['fxgraph_cache_miss']} "
                     f"compiled into it")
    return "; ".join(parts)
