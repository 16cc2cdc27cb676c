"""What a profiled micro-batch's GPU did: the span of its kernels, the time the GPU was busy (idle gaps are the host's
waits), and the kernels by total time, from the chrome trace benchmarks/profile_step.py writes.

    python benchmarks/trace_summary.py trace_NAME.json[.gz] > summary.json
"""

import argparse
import collections
import gzip
import json


def summarize(trace: dict, top: int) -> dict:
    kernels = sorted((event for event in trace["traceEvents"] if event.get("ph") == "X"
                      and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda event: event["ts"])
    if not kernels:
        raise SystemExit("the trace holds no GPU kernel: profiled on a CPU, or without ProfilerActivity.CUDA")
    busy, run_start, run_end, gaps = 0.0, None, None, []
    for event in kernels:
        start, end = event["ts"], event["ts"] + event["dur"]
        if run_end is None or start > run_end:
            if run_end is not None:
                busy += run_end - run_start
                gaps.append(start - run_end)
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    busy += run_end - run_start
    by_name, calls = collections.Counter(), collections.Counter()
    for event in kernels:
        by_name[event["name"][:120]] += event["dur"]
        calls[event["name"][:120]] += 1
    return {
        "gpu_span_ms": round((run_end - kernels[0]["ts"]) / 1e3, 1),
        "gpu_busy_ms": round(busy / 1e3, 1),
        "idle_gaps_over_100us_ms": round(sum(gap for gap in gaps if gap > 100) / 1e3, 1),
        "kernels_by_total_ms": [{"name": name, "ms": round(micros / 1e3, 1), "calls": calls[name]}
                                for name, micros in by_name.most_common(top)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as handle:
        print(json.dumps(summarize(json.load(handle), args.top), indent=1))


if __name__ == "__main__":
    main()
