"""FP8 keeps the result: the Llama-3.2-1B architecture (random weights, seed 0) trained by
recipes/llama-3.2-1b/full.yaml as shipped (bf16, liger, eager) and with the FP8 flags (`--fp8 true --torch_compile true
--use_liger_kernel false`), from the same weights on the same learnable rows in the same order (a random Markov chain
whose loss floor is ln 4 = 1.386 nats, benchmarks/models.markov_rows), for 200 optimizer steps. Each run is the trainer
scripts/sft.py builds (`finetune.config.parse_args` on the recipe, `finetune.trainer.build_trainer`), through the
throughput benchmark's `run_variant`, so its tokens/s and peak memory come with it.

    python3 benchmarks/fp8_parity.py --out DIR --budget 240       # GPU: both runs, 2-3 minutes on an H200
    python3 benchmarks/fp8_parity.py --plot DIR/fp8_parity.json   # the PNG from the JSON, where matplotlib is
    python3 benchmarks/fp8_parity.py --out DIR --tiny             # CPU: the tiny Llama, a few steps, both runs
                                                                  #   in float32 (no float8 matmul): plumbing only

Writes DIR/fp8_parity.json (both loss curves, settings, each run's tokens/s and peak memory), DIR/fp8_parity.csv
(step, bf16 loss, fp8 loss) and DIR/fp8_parity.png (both curves; left out, and said so, without matplotlib), and
prints the final losses (each the mean of the last 10 steps) and their relative difference: passed within 1%.
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cases import fp8_parity_case, tiny_case  # noqa: E402  (benchmarks/ is beside finetune/)
from benchmarks.report import versions  # noqa: E402
from benchmarks.runner import release_memory, restoring_modeling_modules, run_variant, time_limit  # noqa: E402

LAST_STEPS = 10  # the final loss is their mean: one step's loss moves with its batch
TOLERANCE = 0.01


def compare(report: dict) -> None:
    """The final losses of the two runs and their relative difference, into the report."""
    bf16, fp8 = (report["runs"].get(key, {}).get("losses") for key in ("bf16", "fp8"))
    if not bf16 or not fp8 or len(bf16) != len(fp8):
        report["passed"] = False
        return
    final_bf16, final_fp8 = statistics.mean(bf16[-LAST_STEPS:]), statistics.mean(fp8[-LAST_STEPS:])
    report.update(final_bf16=final_bf16, final_fp8=final_fp8, final_rel_diff=abs(final_fp8 - final_bf16) / final_bf16,
                  max_rel_diff=max(abs(b - f) / b for b, f in zip(bf16, fp8)))
    report["passed"] = report["final_rel_diff"] <= TOLERANCE and final_bf16 < bf16[0]


def write_curves(report: dict, out: Path) -> None:
    bf16, fp8 = (report["runs"].get(key, {}).get("losses") or [] for key in ("bf16", "fp8"))
    rows = ["step,bf16,fp8"] + [f"{step},{b},{f}" for step, (b, f) in enumerate(zip(bf16, fp8), start=1)]
    (out / "fp8_parity.csv").write_text("\n".join(rows) + "\n")
    (out / "fp8_parity.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def plot(report: dict, path: Path) -> str:
    """Both loss curves in one PNG; what was written, or why nothing was."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return "no PNG: matplotlib is not installed here (rerun with --plot on the JSON where it is)"
    figure = Figure(figsize=(7, 4))
    axes = figure.subplots()
    for key, label in (("bf16", "bf16 (recipe as shipped)"), ("fp8", "fp8 (float8 linears, compiled)")):
        losses = report["runs"].get(key, {}).get("losses") or []
        axes.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    axes.axhline(report.get("loss_floor", 0), color="grey", linestyle=":", linewidth=1, label="the data's loss floor")
    difference = report.get("final_rel_diff")
    axes.set_title(f"{report['title']}" + (f": final loss {100 * difference:.2f}% apart" if difference is not None
                                           else ""), fontsize=9)
    axes.set_xlabel("step")
    axes.set_ylabel("train loss (nats per token)")
    axes.set_yscale("log")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return str(path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for fp8_parity.json, .csv and .png")
    parser.add_argument("--plot", help="an fp8_parity.json to draw as the PNG beside it (nothing is trained)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (200; tiny 6)")
    # The recipe's micro-batch: after the throughput benchmark's fp8 case, its compiled layer comes from inductor's cache
    parser.add_argument("--seq", type=int, default=2048, help="tokens per row")
    parser.add_argument("--batch", type=int, default=8, help="rows per step (one micro-batch)")
    parser.add_argument("--learning_rate", type=float, default=3e-4, help="peak of the recipe's cosine schedule")
    parser.add_argument("--budget", type=float, default=240, help="seconds for both runs; a run past it is stopped")
    parser.add_argument("--method", choices=("full", "lora"), default="full",
                        help="which Llama-3.2-1B recipe: full (the issue's parity run) or lora (fp8 on the frozen base)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Llama on CPU, to check the script runs")
    args = parser.parse_args(argv)
    if args.plot:
        report = json.loads(Path(args.plot).read_text())
        print(plot(report, Path(args.plot).with_suffix(".png")))
        return report
    if not args.out:
        parser.error("--out is needed (or --plot JSON)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (6 if args.tiny else 200)
    case = fp8_parity_case(steps, args.seq, args.batch, args.learning_rate, args.method)
    if args.tiny:
        case = tiny_case(case, warmup=1, timed=steps - 1)
    device = "cpu" if args.tiny else "cuda"
    started = time.monotonic()
    title = case.title.replace("Llama-3.2-1B", "tiny Llama") if args.tiny else case.title
    report = {"title": title, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv[1:],
              "versions": versions(device), "steps": steps, "seq": case.seq, "loss_floor": 1.386,
              "final_is_mean_of_last_steps": LAST_STEPS, "tolerance": TOLERANCE, "runs": {}}
    for variant in case.variants:
        left = args.budget - (time.monotonic() - started)
        print(f"[fp8 parity] {variant.key}: {variant.label} ({left:.0f} s of the budget left)", flush=True)
        try:
            if left < 20:
                raise TimeoutError("skipped: the --budget was spent")
            with restoring_modeling_modules(), time_limit(left - 5):
                result = run_variant(case, variant, out, args.tiny)
            print(f"[fp8 parity]   {result['tokens_per_s']:,.0f} tok/s, peak {result.get('peak_gib')}, "
                  f"loss {result['loss_first']:.3f} -> {result['loss_last']:.3f}", flush=True)
        except Exception as error:  # the other run and the report still come back
            print(f"[fp8 parity]   FAILED {traceback.format_exc()[-3000:]}", flush=True)
            result = {"error": f"{type(error).__name__}: {error}"[:400]}
        report["runs"][variant.key] = result
        release_memory(device)
        write_curves(report, out)
    compare(report)
    report["plot"] = plot(report, out / "fp8_parity.png")
    write_curves(report, out)
    if "final_rel_diff" in report:
        print(f"[fp8 parity] final loss (mean of the last {LAST_STEPS} steps): bf16 {report['final_bf16']:.4f}, "
              f"fp8 {report['final_fp8']:.4f}, relative difference {report['final_rel_diff']:.4%} "
              f"(largest at any step {report['max_rel_diff']:.4%}); {'PASSED' if report['passed'] else 'FAILED'} "
              f"(within {TOLERANCE:.0%})", flush=True)
    else:
        print("[fp8 parity] FAILED: a run did not finish; see fp8_parity.json", flush=True)
    print(f"[fp8 parity] {report['plot']}; {time.monotonic() - started:.0f} s", flush=True)
    return report


if __name__ == "__main__":
    main()
