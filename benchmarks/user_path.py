"""The user's path: each GPU recipe as shipped, through `accelerate launch ... scripts/sft.py`, on a local model folder
(the real architecture, random weights) and a JSONL file of chat rows of varied length, timed from the launch.

    python benchmarks/user_path.py --work runs/up --out OUT [--cases llama3b_lora,...] [--steps N]

For each case it prints and writes (OUT/user_path.json) the seconds from the launch to the first optimizer step,
real (non-padding) tokens per second over the whole run from the launch (loading and compiling included) and
steady (after the warm-up steps), peak memory and the graphs the compiler built, read from the run's
finetune_speed.json. The rows' token lengths (the model's tokenizer and chat template) are written beside the
results (OUT/lengths_<family>.json) for peers to train on rows of the same lengths.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is beside finetune/, not installed with it
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than call first who may down "
         "side been now find").split()
CASES = {  # name: recipe, model folder, extra flags
    "llama3b_lora": ("llama-3.2-3b/lora.yaml", "llama3b", []),
    "llama1b_full": ("llama-3.2-1b/full.yaml", "llama1b", []),
    "llama3b_qlora": ("llama-3.2-3b/qlora.yaml", "llama3b", []),
    "gptoss20b_lora": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b", []),
    "gptoss20b_lora_ckpt": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b", ["--gradient_checkpointing", "true"]),
}
ARCHITECTURES = {"llama3b": "meta-llama/Llama-3.2-3B-Instruct", "llama1b": "meta-llama/Llama-3.2-1B-Instruct"}


def write_chat_rows(folder: Path) -> None:
    """1,500 train and 64 test chat rows of log-normal length (mean ~870 tokens with the tiny tokenizers, max
    2,048), as ../shared/gpu/user_path/chat_data.py writes them."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", 1500), ("test", 64)):
        with open(folder / f"{split}.jsonl", "w") as out:
            for _ in range(count):
                words = int(min(max(rng.lognormvariate(5.7, 0.9), 40), 2800))
                question = max(5, words // 4)
                text = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (question, words - question)]
                out.write(json.dumps({"messages": [{"role": "system", "content": "Answer."},
                                                   {"role": "user", "content": text[0]},
                                                   {"role": "assistant", "content": text[1]}]}) + "\n")


def write_llama(name: str, folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from finetune.families import load_architecture
    from finetune.models import tiny

    tokenizer = tiny.build_tiny_tokenizer("llama")
    config = load_architecture(ARCHITECTURES[name])
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_gpt_oss(folder: Path) -> None:
    """Stored as openai/gpt-oss-20b is (MXFP4 experts, bf16 rest), random tensors drawn on the GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.families import load_architecture
    from finetune.models import tiny

    tokenizer = tiny.build_tiny_tokenizer("gpt-oss")
    config = load_architecture("gpt-oss-20b")
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator(device="cuda").manual_seed(0)

    def tensors():
        for name, shape in shapes.items():
            if name.endswith(mxfp4_checkpoints.EXPERT_WEIGHTS):
                experts, columns, rows = shape
                groups = columns // mxfp4_checkpoints.BLOCK
                yield f"{name}_blocks", torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8,
                                                      generator=generator, device="cuda").cpu()
                yield f"{name}_scales", torch.randint(118, 122, (experts, rows, groups), dtype=torch.uint8,
                                                      generator=generator, device="cuda").cpu()
            elif name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=torch.bfloat16)
            else:
                yield name, (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(torch.bfloat16).cpu()

    mxfp4_checkpoints.write_checkpoint(config, tensors(), folder)
    tokenizer.save_pretrained(folder)


def row_lengths(model_folder: Path, data: Path, max_length: int = 2048) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    with open(data / "train.jsonl") as rows:
        return [min(len(tokenizer.apply_chat_template(json.loads(row)["messages"], tokenize=True,
                                                      return_dict=True)["input_ids"]), max_length) for row in rows]


def prepare(work: Path, out: Path, models: set[str]) -> None:
    if not (work / "data" / "train.jsonl").exists():
        write_chat_rows(work / "data")
    for name in sorted(models):
        folder = work / name
        if not (folder / "config.json").exists():
            started = time.time()
            write_gpt_oss(folder) if name == "gpt-oss-20b" else write_llama(name, folder)
            print(f"wrote {folder} in {time.time() - started:.0f} s", flush=True)
        family = "gpt-oss" if name.startswith("gpt-oss") else "llama"
        lengths = out / f"lengths_{family}.json"
        if not lengths.exists():
            lengths.write_text(json.dumps(row_lengths(folder, work / "data")))


def launch_command(name: str, work: Path, output_dir: Path, accelerate_config: str, *flags: str) -> list[str]:
    """`accelerate launch [--config_file ...] scripts/sft.py` with CASE's recipe, model folder and the chat rows,
    logging every step, evaluating and scoring nothing, with `flags` and the case's own after them."""
    recipe, model, extra = CASES[name]
    config = ["--config_file", str(ROOT / "accelerate_configs" / accelerate_config)] if accelerate_config else []
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *config, "--num_processes", "1",
            str(ROOT / "scripts" / "sft.py"), "--config", str(ROOT / "recipes" / recipe),
            "--model_name_or_path", str(work / model), "--dataset_name", str(work / "data"), "--logging_steps", "1",
            "--eval_strategy", "no", "--eval_samples_before_after", "0", "--output_dir", str(output_dir), *flags,
            *extra]


def run_case(name: str, work: Path, out: Path, steps: int, timeout: int, accelerate_config: str) -> dict:
    recipe = CASES[name][0]
    output_dir = work / "out" / name
    command = launch_command(name, work, output_dir, accelerate_config, "--max_steps", str(steps),
                             "--save_strategy", "no")
    launched = time.time()
    with open(out / f"{name}.log", "w") as log:
        try:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    result = {"case": name, "recipe": recipe, "command": " ".join(command[3:]), "exit": code,
              "wall_s": round(time.time() - launched, 1)}
    record_path = output_dir / "finetune_speed.json"
    if code != 0 or not record_path.exists():
        return result
    record = json.loads(record_path.read_text())
    steps_log = record.pop("step_log")
    first, last = steps_log[0], steps_log[-1]
    result.update({
        "seconds_launch_to_first_step": round(first["time"] - launched, 1),
        "seconds_launch_to_train_begin": round(record["train_begin"] - launched, 1),
        "seconds_launch_to_last_step": round(last["time"] - launched, 1),
        "real_tokens": last.get("num_tokens"),
        "real_tokens_per_s_from_launch": round(last["num_tokens"] / (last["time"] - launched)),
        "real_tokens_per_s_steady": record.get("real_tokens_per_s_steady"),
        "peak_memory_gib": record["peak_memory_gib"],
        "compiled_graphs": record["compiled_graphs"],
        "compiled_graphs_per_step": [step["compiled_graphs"] for step in steps_log],
        "steps": record["steps"],
    })
    return result


def sigterm_case(name: str, work: Path, out: Path, wait_for: str, delay: float, timeout: int,
                 accelerate_config: str) -> dict:
    """Launch NAME, wait until its log shows WAIT_FOR ("setup:" = training began, the first step compiling;
    "'loss'" = a step done), sleep DELAY, send SIGTERM to the launcher alone (as Kubernetes does), and time how long
    until the launcher and every process of its session are gone, and what was saved."""
    import signal

    output_dir = work / "out" / f"{name}_sigterm"
    shutil.rmtree(output_dir, ignore_errors=True)
    command = launch_command(name, work, output_dir, accelerate_config, "--max_steps", "200",
                             "--save_strategy", "steps", "--save_steps", "1000")
    log_path = out / f"{name}_sigterm_{wait_for.strip(chr(39))}.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started = time.time()
        while wait_for not in log_path.read_text() and launcher.poll() is None and time.time() - started < timeout:
            time.sleep(0.2)
        time.sleep(delay)
        signalled = time.time()
        launcher.send_signal(signal.SIGTERM)
        try:
            code = launcher.wait(timeout=120)
        except subprocess.TimeoutExpired:
            code = "still running 120 s after SIGTERM"
        launcher_gone = time.time()
        while _session_processes(launcher.pid) and time.time() - signalled < 120:
            time.sleep(0.2)
        left = _session_processes(launcher.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return {"case": name, "sigterm_when": wait_for, "seconds_launch_to_signal": round(signalled - started, 1),
            "launcher_exit": code, "seconds_signal_to_launcher_exit": round(launcher_gone - signalled, 1),
            "seconds_signal_to_no_process_left": round(time.time() - signalled, 1), "processes_left_killed": left,
            "checkpoints_saved": sorted(path.name for path in output_dir.glob("checkpoint-*")),
            "said": [line for line in log_path.read_text().splitlines() if "SIGTERM" in line][-2:]}


def _session_processes(session: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="runs/up")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/up/results"))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=int, default=480)
    parser.add_argument("--accelerate_config", default="ddp.yaml", help="'' for none (a CPU check of this script)")
    parser.add_argument("--sigterm", help="CASE: time SIGTERM while the first step compiles and after a step")
    args = parser.parse_args()
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.sigterm:
        prepare(work, out, {CASES[args.sigterm][1]})
        timings = [sigterm_case(args.sigterm, work, out, wait_for, delay, args.timeout, args.accelerate_config)
                   for wait_for, delay in (("setup:", 3.0), ("'loss'", 0.0))]
        (out / "sigterm.json").write_text(json.dumps(timings, indent=1) + "\n")
        print(json.dumps(timings), flush=True)
        return
    cases = args.cases.split(",")
    prepare(work, out, {CASES[name][1] for name in cases})
    results_path = out / "user_path.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    for name in cases:
        result = run_case(name, work, out, args.steps, args.timeout, args.accelerate_config)
        print(json.dumps(result), flush=True)
        results.append(result)
        results_path.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
