"""Where one micro-batch's time goes on the GPU: scripts/sft.py run in this process with the given arguments, and
torch.profiler around one training step (forward and backward of one micro-batch) after the compiled ones.

    python benchmarks/profile_step.py --label NAME --at 3 -- --config recipes/... [sft.py arguments]

Prints the profiler's table (CUDA time per kernel and operator) and writes it, with the step's wall time, to
$OUT/profile_NAME.txt. Write a few-layer GPT-OSS folder first with `--write_gpt_oss ARCH:LAYERS:FOLDER`.
"""

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def profile_training_step(at: int, label: str, out: Path) -> None:
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    original = transformers.Trainer.training_step
    calls = [0]

    def training_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] != at:
            return original(self, *args, **kwargs)
        synchronize = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        synchronize()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            loss = original(self, *args, **kwargs)
            synchronize()
        seconds = time.perf_counter() - started
        table = profiler.key_averages().table(sort_by="cuda_time_total" if torch.cuda.is_available() else "cpu_time_total", row_limit=45, max_name_column_width=70)
        text = f"{label}: micro-batch {at} took {seconds:.3f} s (under the profiler)\n{table}\n"
        print(text, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile_{label}.txt").write_text(text)
        # the timeline: where the GPU waits for the host (a read back, a launch-bound stretch) shows as a gap
        profiler.export_chrome_trace(str(out / f"trace_{label}.json"))
        return loss

    transformers.Trainer.training_step = training_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="step")
    parser.add_argument("--at", type=int, default=3, help="the training_step call to profile (1 = the first)")
    parser.add_argument("--write_gpt_oss", help="ARCH:LAYERS:FOLDER, a GPT-OSS folder of the first LAYERS layers")
    args, sft_arguments = parser.parse_known_args()
    if args.write_gpt_oss:
        from benchmarks.user_path import write_gpt_oss

        architecture, layers, folder = args.write_gpt_oss.split(":", 2)
        write_gpt_oss(Path(folder), architecture, int(layers))
        return
    profile_training_step(args.at, args.label, Path(os.environ.get("OUT", "runs/profile")))
    main_of_sft = runpy.run_path(str(ROOT / "scripts" / "sft.py"))["main"]
    main_of_sft([argument for argument in sft_arguments if argument != "--"])


if __name__ == "__main__":
    main()
