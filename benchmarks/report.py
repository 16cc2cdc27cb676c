"""The benchmarks' results as JSON and as markdown tables."""

from __future__ import annotations

import contextlib
import json
import platform
from importlib.metadata import version
from pathlib import Path

GIB = 2**30


def versions(device: str) -> dict:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": trl.__version__, "peft": peft.__version__, "accelerate": accelerate.__version__}
    with contextlib.suppress(ImportError):
        info["liger_kernel"] = version("liger_kernel")
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _fmt(value, spec=",.0f", missing="—"):
    return missing if value is None else format(value, spec)


def _throughput_cell(result: dict | None) -> str:
    if result is None:
        return "—"
    if "error" in result:
        return f"failed ({result['error'][:60]})"
    mfu = f", MFU {result['mfu']:.2f}" if result.get("mfu") is not None else ""
    memory = f", {result['peak_gib']:.1f} GiB" if result.get("peak_gib") is not None else ""
    return f"{result['tokens_per_s']:,.0f}{mfu}{memory}"


def _planned_cell(result: dict) -> str:
    """finetune.planner's estimate of the peak, and estimate / measured where the peak was measured."""
    if result.get("planned_gib") is None:
        return "—"
    ratio = f" ({result['planned_over_peak']:.2f}x)" if result.get("planned_over_peak") else ""
    return f"{result['planned_gib']:.1f}{ratio}"


def markdown(report: dict) -> str:
    lines = [f"# Benchmark: plain TRL vs finetune recipes ({report['mode']})", "",
             f"Date: {report['date']}. " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".", "",
             "| case | plain TRL default | plain TRL best | finetune (recipe as shipped) | finetune fast | "
             "recipe / best | fast / best | fast / default | target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        results = {r["variant"]: r for r in case["results"]}
        best_fast = max((r for r in case["results"] if r["variant"].startswith("finetune") and "error" not in r
                         and not r["variant"].startswith("finetune_48g")),
                        key=lambda r: r["tokens_per_s"], default=None)
        plain_best = results.get("plain_best", {}).get("tokens_per_s")
        plain_default = results.get("plain_default", {}).get("tokens_per_s")
        fast = best_fast["tokens_per_s"] if best_fast else None
        fast_cell = f"{_throughput_cell(best_fast)} ({best_fast['variant']})" if best_fast else "—"
        ratio_best = f"{fast / plain_best:.2f}x" if fast and plain_best else "—"
        recipe = results.get("finetune", {}).get("tokens_per_s")
        ratio_recipe = f"{recipe / plain_best:.2f}x" if recipe and plain_best else "—"
        ratio_default = f"{fast / plain_default:.2f}x" if fast and plain_default else "—"
        plain_cells = " | ".join(_throughput_cell(results.get(variant))
                                 for variant in ("plain_default", "plain_best", "finetune"))
        lines.append(f"| {case['title']} | {plain_cells} | {fast_cell} | {ratio_recipe} | {ratio_best} | "
                     f"{ratio_default} | {case['target']} |")
    lines += ["", "## Every variant", "",
              "| case | variant | settings | tokens/s | MFU | peak GiB | planned GiB | loss first → last | step s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        for r in case["results"]:
            if "error" in r:
                lines.append(f"| {case['key']} | {r['variant']} | {r['label']} | failed: {r['error'][:160]} "
                             "| | | | | |")
                continue
            lines.append(
                f"| {case['key']} | {r['variant']} | {r['label']} | {r['tokens_per_s']:,.0f} | "
                f"{_fmt(r.get('mfu'), '.2f')} | {_fmt(r.get('peak_gib'), '.1f')} | {_planned_cell(r)} | "
                f"{r['loss_first']:.3f} → {r['loss_last']:.3f} | {r['step_time_median_s']:.3f} |")
    numerics = report.get("numerics")
    if numerics:
        lines += ["", "## Numerics check", ""]
        if "error" in numerics:
            lines.append(f"failed: {numerics['error']}")
        else:
            lines.append(f"{numerics['model']}, {numerics['steps']} steps: max relative loss difference "
                         f"{numerics['max_rel_diff']:.4f} (final {numerics['final_rel_diff']:.4f}); "
                         f"{'PASSED' if numerics['passed'] else 'FAILED'}.")
            lines.append("")
            lines.append("plain: " + " ".join(f"{x:.3f}" for x in numerics["plain"]))
            lines.append("")
            lines.append("fast:  " + " ".join(f"{x:.3f}" for x in numerics["fast"]))
            if "compiled" in numerics:
                lines.append("")
                lines.append(f"compiled (max relative difference {numerics['max_rel_diff_compiled']:.4f}): "
                             + " ".join(f"{x:.3f}" for x in numerics["compiled"]))
    lines += ["", "## Commands (finetune rows)", ""]
    for case in report["cases"]:
        for r in case["results"]:
            if r.get("command"):
                lines.append(f"- {case['key']} / {r['variant']}: `{r['command']}`")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out_dir: Path) -> None:
    (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "bench.md").write_text(markdown(report))


def memory_markdown(rows: list[dict]) -> str:
    lines = ["| case | est. allocated GiB | measured max allocated GiB | ratio | est. reserved GiB | "
             "measured max reserved GiB | ratio |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][:80]} | | | | | |")
            continue
        cells = [_fmt(r.get(key), ".2f", "n/a") for key in ("estimated_allocated_gib", "measured_allocated_gib",
                 "ratio_allocated", "estimated_reserved_gib", "measured_reserved_gib", "ratio_reserved")]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_memory_report(rows: list[dict], out_dir: Path) -> None:
    rows.sort(key=lambda row: row["case"])
    (out_dir / "planner_validation.json").write_text(json.dumps(rows, indent=2))
    (out_dir / "planner_validation.md").write_text(memory_markdown(rows))
