"""The user's path: each GPU recipe as shipped, through `accelerate launch ... scripts/sft.py`, on a local model folder
(the real architecture, random weights) and a JSONL file of chat rows of varied length, timed from the launch.

    python benchmarks/user_path.py --work runs/up --out OUT [--cases llama3b_lora,...] [--steps N] [--second_launch]
    python benchmarks/user_path.py --all --part 1|2 --work runs/up --out OUT      (one device call each: gpu_lease.sh)

Every launch trains into a new, empty output folder, timed from the wall clock the benchmark reads just before it
starts the launcher. A run that resumed, was cut short (time limit, non-zero exit) or trained fewer steps than asked
gives no row: it is reported in words (`status`, `reason`). A row holds the seconds from the launch to the training
process's start, its imports done, the model loaded, the model on the device, training begun, the first and the last
optimizer step (the run's own finetune_speed.json keeps these moments as wall-clock times); real (non-padding)
tokens/s steady (after the warm-up steps) and from the launch; peak memory; the graphs the compiler built. Each case
compiles into a cache folder of its own, emptied before its first launch: `--second_launch` launches it again into
another new folder with that cache warm, as its own row.

`--all --part N` runs half of everything within `--budget` seconds (one device call under 10 minutes): part 1 the
Llama recipes, a second launch, SIGTERM at three moments (loading, compiling the first step, mid-run) and Unsloth on
the same row lengths; part 2 GPT-OSS-20B with and without checkpointing and Unsloth's GPT-OSS. Parts 3 to 5 are the
resident-MXFP4 rows (docs/gpt-oss.md): GPT-OSS-120B on one GPU (its 61 GiB folder written to /dev/shm), GPT-OSS-20B
resident against dequantized, resident with checkpointing and Unsloth's GPT-OSS. What the budget leaves
no time for is reported as not run. The models are written once per machine, each by a process of its own: this
process never touches the GPU, so a case trains on a GPU that holds nothing else. The rows' token lengths (the
model's tokenizer and chat template) are written beside the results (OUT/lengths_<family>.json), for Unsloth
(`unsloth_peer.py --lengths`) to train on rows of the same lengths.
"""

import argparse
import json
import os
import random
import shutil
import signal
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
# A compiled recipe's short benchmark run stands for a long training run: without `--torch_compile true` a run of 20
# steps would run eager (finetune/models/compilation.py: compile_only_if_it_pays)
COMPILED = ["--torch_compile", "true"]
CASES = {  # name: recipe, model folder, extra flags
    "llama3b_lora": ("llama-3.2-3b/lora.yaml", "llama3b", COMPILED),
    "llama1b_full": ("llama-3.2-1b/full.yaml", "llama1b", []),
    "llama3b_qlora": ("llama-3.2-3b/qlora.yaml", "llama3b", []),
    "gptoss20b_lora": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b", COMPILED),
    "gptoss20b_lora_ckpt": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b", [*COMPILED, "--gradient_checkpointing", "true"]),
    "gptoss20b_resident": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b", [*COMPILED, "--dequantize_mxfp4", "false"]),
    "gptoss20b_resident_ckpt": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b",
                                [*COMPILED, "--dequantize_mxfp4", "false", "--gradient_checkpointing", "true"]),
    # the same through benchmarks/sft_dequantize_ahead.py: the next chunk dequantized ahead on a second stream
    "gptoss20b_resident_ckpt_ahead": ("gpt-oss-20b/lora.yaml", "gpt-oss-20b",
                                      [*COMPILED, "--dequantize_mxfp4", "false", "--gradient_checkpointing", "true"]),
    # the one-GPU recipe with its experts resident, as shipped (activation offloading on), and the same recipe with
    # them dequantized at load; both again with the layer inputs kept on the GPU
    "gptoss20b_mxfp4": ("gpt-oss-20b/lora_mxfp4.yaml", "gpt-oss-20b", COMPILED),
    "gptoss20b_mxfp4_dequantized": ("gpt-oss-20b/lora_mxfp4.yaml", "gpt-oss-20b",
                                    [*COMPILED, "--dequantize_mxfp4", "true"]),
    "gptoss20b_mxfp4_not_offloaded": ("gpt-oss-20b/lora_mxfp4.yaml", "gpt-oss-20b",
                                      [*COMPILED, "--activation_offloading", "false"]),
    "gptoss20b_mxfp4_not_offloaded_dequantized": ("gpt-oss-20b/lora_mxfp4.yaml", "gpt-oss-20b",
                                                  [*COMPILED, "--activation_offloading", "false", "--dequantize_mxfp4",
                                                   "true"]),
    "gptoss120b_lora": ("gpt-oss-120b/lora.yaml", "gpt-oss-120b", COMPILED),
    "gptoss120b_lora_eager": ("gpt-oss-120b/lora.yaml", "gpt-oss-120b", ["--torch_compile", "false"]),
    # the recipe header's variant for one 141 GB GPU (H200)
    "gptoss120b_lora_r16": ("gpt-oss-120b/lora.yaml", "gpt-oss-120b",
                            [*COMPILED, "--lora_r", "16", "--lora_alpha", "32", "--optim", "adamw_torch_fused"]),
    # the same with twice the rows a micro-batch (512 rows an expert: the chunked path; planned 91.1 GiB)
    "gptoss120b_lora_r16_b8": ("gpt-oss-120b/lora.yaml", "gpt-oss-120b",
                               [*COMPILED, "--lora_r", "16", "--lora_alpha", "32", "--optim", "adamw_torch_fused",
                                "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]),
}
# An optimizer step of the 120B recipe is 16 rows of 2,048 tokens: 8 steps give 3 after the warm-up ones. GPT-OSS-20B's
# steps take ~3 s: 12 give 7 after the warm-up ones and leave a device call room for a cold and a warm launch.
STEPS_OF_CASE = {**{name: 8 for name in ("gptoss120b_lora", "gptoss120b_lora_eager", "gptoss120b_lora_r16",
                                         "gptoss120b_lora_r16_b8")},
                 **{name: 12 for name in ("gptoss20b_lora_ckpt", "gptoss20b_resident_ckpt",
                                          "gptoss20b_resident_ckpt_ahead", "gptoss20b_mxfp4",
                                          "gptoss20b_mxfp4_dequantized", "gptoss20b_mxfp4_not_offloaded",
                                          "gptoss20b_mxfp4_not_offloaded_dequantized")}}
SCRIPT_OF_CASE = {"gptoss20b_resident_ckpt_ahead": "benchmarks/sft_dequantize_ahead.py"}  # the others run scripts/sft.py
# The GPU machine's disk (64 GiB) cannot hold GPT-OSS-120B's 61 GiB folder: it is written to memory (a tmpfs)
BIG_MODELS = Path(os.environ.get("USER_PATH_BIG_MODELS", "/dev/shm/finetune-up"))
ARCHITECTURES = {"llama3b": "meta-llama/Llama-3.2-3B-Instruct", "llama1b": "meta-llama/Llama-3.2-1B-Instruct"}


def write_chat_rows(folder: Path, train_rows: int = 1500) -> None:
    """TRAIN_ROWS train and 64 test chat rows of log-normal length (mean ~870 tokens with the tiny tokenizers, max
    2,048), as ../shared/gpu/user_path/chat_data.py writes them."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train_rows), ("test", 64)):
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


def write_gpt_oss(folder: Path, architecture: str, layers: int | None = None) -> None:
    """Stored as openai/gpt-oss-20b and -120b are (MXFP4 experts, bf16 rest), random tensors drawn on the GPU; with
    LAYERS, only the first ones (a profile of one layer's work needs no whole model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks import mxfp4_checkpoints
    from finetune.families import load_architecture
    from finetune.models import tiny

    tokenizer = tiny.build_tiny_tokenizer("gpt-oss")
    config = load_architecture(architecture)
    if layers:
        config.num_hidden_layers, config.layer_types = layers, config.layer_types[:layers]
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    generator = torch.Generator(device="cuda").manual_seed(0)
    mxfp4_checkpoints.write_checkpoint(config, mxfp4_checkpoints.random_hub_tensors(shapes, generator), folder)
    tokenizer.save_pretrained(folder)


def row_lengths(model_folder: Path, data: Path, max_length: int = 2048) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    with open(data / "train.jsonl") as rows:
        return [min(len(tokenizer.apply_chat_template(json.loads(row)["messages"], tokenize=True,
                                                      return_dict=True)["input_ids"]), max_length) for row in rows]


def family(model: str) -> str:
    return "gpt-oss" if model.startswith("gpt-oss") else "llama"


def model_folder(work: Path, name: str) -> Path:
    return BIG_MODELS / name if name == "gpt-oss-120b" else work / name


def write_model(name: str, work: Path) -> None:
    """The model's folder, written into one beside it and renamed when whole: a write cut short is not taken for a
    model."""
    folder = model_folder(work, name)
    partial = folder.with_name(f"{name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    write_gpt_oss(partial, name) if family(name) == "gpt-oss" else write_llama(name, partial)
    partial.rename(folder)


def prepare(work: Path, out: Path, models: set[str], timeout: float) -> list[dict]:
    """The chat rows, each model folder not yet on this machine (written by a child process, so that this one never
    holds GPU memory) and the rows' token lengths per family; what could not be written, in words."""
    if not (work / "data" / "train.jsonl").exists():
        write_chat_rows(work / "data")
    failed = []
    for name in sorted(models):
        folder = model_folder(work, name)
        if not (folder / "config.json").exists():
            command = [sys.executable, __file__, "--write_model", name, "--work", str(work)]
            code = launch(command, out / f"write_{name}.log", timeout)[1]
            if code != 0:
                failed.append(not_reported(f"write {name}", "failed", f"writing the model {exit_words(code, timeout)}"))
                continue
        lengths = out / f"lengths_{family(name)}.json"
        if not lengths.exists():
            lengths.write_text(json.dumps(row_lengths(folder, work / "data")))
    return failed


def launch_command(name: str, work: Path, output_dir: Path, accelerate_config: str, *flags: str) -> list[str]:
    """`accelerate launch [--config_file ...] scripts/sft.py` with CASE's recipe, model folder and the chat rows,
    logging every step, evaluating and scoring nothing, with the case's own flags and `flags` after them (the last of a
    flag given twice wins: `--flags` overrides a case's)."""
    recipe, model, extra = CASES[name]
    config = ["--config_file", str(ROOT / "accelerate_configs" / accelerate_config)] if accelerate_config else []
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *config, "--num_processes", "1",
            str(ROOT / SCRIPT_OF_CASE.get(name, "scripts/sft.py")), "--config", str(ROOT / "recipes" / recipe),
            "--model_name_or_path", str(model_folder(work, model)), "--dataset_name", str(work / "data"), "--logging_steps", "1",
            "--eval_strategy", "no", "--eval_samples_before_after", "0", "--output_dir", str(output_dir), *extra,
            *flags]


def new_folder(path: Path) -> Path:
    """An output folder that holds nothing: a run launched into a used one would resume from its checkpoints."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise SystemExit(f"{path}: could not be emptied; remove it or pass another --work.")
    return path


def compile_environment(cache: Path) -> dict:
    """The run's environment with its compile cache folder moved to CACHE as a user moves it
    (FINETUNE_COMPILE_CACHE): a case's first launch compiles from nothing, its second launch finds what the first
    compiled."""
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return dict(environment, FINETUNE_COMPILE_CACHE=str(cache))


def launch(command: list[str], log_path: Path, timeout: float, env: dict | None = None,
           signal_when=None) -> tuple[float, int | None, dict]:
    """Start COMMAND in a session of its own with its output in LOG_PATH, reading the wall clock just before; wait at
    most TIMEOUT s, then end every process of the session (launcher, training processes, compile workers), so that
    none holds GPU memory into the next case. With SIGNAL_WHEN (a test of the log's text and the seconds since the
    launch), SIGTERM the launcher alone once it holds (as a scheduler stops a job) and time the way out.
    Returns the launch time, the exit code (None: cut short) and the SIGTERM's timings."""
    timings = {}
    with open(log_path, "w") as log:
        launched = time.time()
        launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if signal_when is not None:
            while launcher.poll() is None and time.time() - launched < timeout and \
                    not signal_when(log_path.read_text(errors="replace"), time.time() - launched):
                time.sleep(0.2)
            timings = sigterm(launcher, launched, log_path)
        try:
            code = launcher.wait(timeout=max(1.0, timeout - (time.time() - launched)))
        except subprocess.TimeoutExpired:
            code = None
    end_session(launcher.pid)
    return launched, code, timings


def sigterm(launcher: subprocess.Popen, launched: float, log_path: Path) -> dict:
    signalled = time.time()
    steps_done = log_path.read_text(errors="replace").count("'loss'")
    launcher.send_signal(signal.SIGTERM)
    while _session_processes(launcher.pid) and time.time() - signalled < 120:
        time.sleep(0.2)
    gone = time.time() - signalled
    return {"seconds_launch_to_signal": round(signalled - launched, 1), "steps_done_at_signal": steps_done,
            "launcher_exit": launcher.poll(), "seconds_signal_to_no_process_left": round(gone, 1),
            "all_gone_within_30_s": gone <= 30}


def end_session(session: int) -> None:
    for pid in _session_processes(session):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    while _session_processes(session) and time.time() < deadline:
        time.sleep(0.2)


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


def not_reported(case: str, status: str, reason: str) -> dict:
    return {"case": case, "status": status, "reason": reason}


def exit_words(code: int | None, timeout: float) -> str:
    return f"was still running after its {timeout:.0f} s and was stopped" if code is None else f"exited with code {code}"


def last_words(log_path: Path) -> str:
    """The run's own last line that says why it stopped: its `error:` sentence, else its last line."""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "no output")


def run_case(name: str, work: Path, out: Path, steps: int, timeout: float, accelerate_config: str,
             second: bool = False, flags: tuple[str, ...] = ()) -> dict:
    """One launch of CASE into a new output folder; its row, or why it has none."""
    label = f"{name} (second launch)" if second else name
    output_dir = new_folder(work / "out" / (f"{name}_second" if second else name))
    cache = work / "compile-cache" / name
    if not second:
        shutil.rmtree(cache, ignore_errors=True)
    steps = STEPS_OF_CASE.get(name, steps)
    command = launch_command(name, work, output_dir, accelerate_config, "--max_steps", str(steps),
                             "--save_strategy", "no", *flags)
    log_path = out / f"{label.replace(' ', '_').strip('()')}.log"
    launched, code, _ = launch(command, log_path, timeout, compile_environment(cache))
    result = judge(label, code, timeout, launched, output_dir, steps, log_path)
    result.update({"recipe": CASES[name][0], "command": " ".join(command[3:]), "wall_s": round(time.time() - launched, 1),
                   "compile_caches": "warm (the first launch's)" if second else "empty"})
    return result


MOMENTS = ("process_start", "imports_done", "model_loaded", "model_on_device", "train_begin")


def judge(label: str, code: int | None, timeout: float, launched: float, output_dir: Path, steps: int,
          log_path: Path) -> dict:
    """The row of a fresh, whole run, read from the run's own records; or, for any other run, why it has none."""
    from finetune.run.speed import SPEED_RECORD

    if code != 0:
        return not_reported(label, "cut short" if code is None else "failed",
                            f"the run {exit_words(code, timeout)}: {last_words(log_path)}")
    record_path = output_dir / SPEED_RECORD
    if not record_path.exists():
        return not_reported(label, "failed", f"the run wrote no {record_path.name}: {last_words(log_path)}")
    record = json.loads(record_path.read_text())
    started = record.get("started_at_step")
    if started != 0:
        return not_reported(label, "resumed", f"the run started at step {started} of a checkpoint, not at step 0: "
                                              f"its times include no loading of a fresh run's first step")
    trained = json.loads((output_dir / "trainer_state.json").read_text())["global_step"] - started
    if trained < steps:
        return not_reported(label, "cut short", f"the run trained {trained} of the {steps} steps asked")
    step_log = record["step_log"]
    first, last = step_log[0], step_log[-1]
    row = {"case": label, "status": "ok", "steps": trained}
    row.update({f"seconds_launch_to_{moment}": round(record[moment] - launched, 1) for moment in MOMENTS})
    row.update({
        "seconds_launch_to_first_step": round(first["time"] - launched, 1),
        "seconds_launch_to_last_step": round(last["time"] - launched, 1),
        "real_tokens": last.get("num_tokens"),
        "real_tokens_per_s_steady": record.get("real_tokens_per_s_steady"),
        "real_tokens_per_s_from_launch": round(last["num_tokens"] / (last["time"] - launched)),
        "peak_memory_gib": record["peak_memory_gib"],
        "compiled_graphs": record["compiled_graphs"],
        "compiled_graphs_per_step": [entry["compiled_graphs"] for entry in step_log],
        "compile_cache_events": record.get("compile_caches"),
        "compile_seconds_top": dict(sorted(record.get("compile_seconds", {}).items(), key=lambda item: -item[1])[:12]),
    })
    return row


def sigterm_cases(name: str, work: Path, out: Path, timeout: float, accelerate_config: str,
                  fresh_row: dict | None) -> list[dict]:
    """NAME launched three times, SIGTERM sent while it loads (halfway from its imports to the model on the device, as
    its fresh row timed them, else 10 s after the launch), while the first step compiles (3 s after training began)
    and mid-run (after its third step): how long until no process of the launch is left, and whether a checkpoint
    was saved exactly when a step had completed since the last one."""
    row = fresh_row if fresh_row and fresh_row["status"] == "ok" else None
    loading = (row["seconds_launch_to_imports_done"] + row["seconds_launch_to_model_on_device"]) / 2 if row else 10.0
    compiling_since = {}

    def compiling(text: str, seconds: float) -> bool:
        if "setup:" in text:
            compiling_since.setdefault("seconds", seconds)
        return seconds >= compiling_since.get("seconds", float("inf")) + 3

    moments = {"loading": lambda text, seconds: seconds >= loading, "compiling the first step": compiling,
               "mid-run": lambda text, seconds: text.count("'loss'") >= 3}
    results = []
    for moment, signal_when in moments.items():
        output_dir = new_folder(work / "out" / f"{name}_sigterm")
        command = launch_command(name, work, output_dir, accelerate_config, "--max_steps", "200",
                                 "--save_strategy", "steps", "--save_steps", "1000")
        log_path = out / f"{name}_sigterm_{moment.replace(' ', '_')}.log"
        _, code, timings = launch(command, log_path, timeout, compile_environment(work / "compile-cache" / name),
                                  signal_when)
        saved = sorted(path.name for path in output_dir.glob("checkpoint-*"))
        expected = timings.get("steps_done_at_signal", 0) > 0
        results.append({"case": name, "sigterm_when": moment, **timings, "exit": code, "checkpoints_saved": saved,
                        "checkpoint_expected": expected,
                        "passed": bool(timings.get("all_gone_within_30_s")) and bool(saved) == expected,
                        "said": [line for line in log_path.read_text(errors="replace").splitlines()
                                 if "SIGTERM" in line][-2:]})
    return results


UNSLOTH_CASES = {"llama": ["unsloth_llama3b_lora", "unsloth_llama1b_full"],
                 "gpt-oss": ["unsloth_gptoss20b_lora_experts", "unsloth_gptoss20b_lora_experts_gc"]}
UNSLOTH_SITE = "/tmp/site2"  # Unsloth's own wheels (it pins trl <= 1.15), installed apart from the project's


def unsloth(family_name: str, out: Path, peer: Path, steps: int, budget: float) -> list[dict]:
    """Unsloth's cases of FAMILY on rows of the lengths this benchmark's runs trained on, through its peer script,
    with its own packages first on the path; its results, or why there are none."""
    folder = out / f"unsloth_{family_name}"
    command = [sys.executable, str(peer), "--out", str(folder), "--lengths", str(out / f"lengths_{family_name}.json"),
               "--steps", str(steps), "--budget", str(int(budget)), *UNSLOTH_CASES[family_name]]
    env = dict(os.environ, PYTHONPATH=f"{UNSLOTH_SITE}:{ROOT}")
    log_path = out / f"unsloth_{family_name}.log"
    code = launch(command, log_path, budget + 30, env)[1]
    results = folder / "unsloth_peer.json"
    if results.exists():
        return json.loads(results.read_text())
    return [not_reported(f"unsloth {family_name}", "failed", f"{peer} {exit_words(code, budget + 30)}: "
                                                             f"{last_words(log_path)}")]


# Each part, in the order it runs: what comes first matters most when the budget runs short.
PARTS = {
    1: [("run", "llama3b_lora"), ("second", "llama3b_lora"), ("run", "llama1b_full"), ("run", "llama3b_qlora"),
        ("sigterm", "llama3b_lora"), ("unsloth", "llama")],
    2: [("run", "gptoss20b_lora_ckpt"), ("run", "gptoss20b_lora"), ("unsloth", "gpt-oss"),
        ("second", "gptoss20b_lora_ckpt")],
    3: [("run", "gptoss120b_lora"), ("run", "gptoss120b_lora_eager")],
    4: [("run", "gptoss20b_resident"), ("run", "gptoss20b_lora")],
    5: [("run", "gptoss20b_resident_ckpt"), ("unsloth", "gpt-oss")],
    # the first step, cold (an empty cache folder, as on a new machine) and warm (a second launch on the same machine)
    # (three chained calls of one lease: the first also writes GPT-OSS-20B for the other two)
    6: [("run", "llama3b_lora"), ("second", "llama3b_lora"), ("run", "llama1b_full"), ("second", "llama1b_full"),
        ("unsloth", "llama"), ("model", "gpt-oss-20b")],
    7: [("run", "gptoss20b_lora_ckpt"), ("second", "gptoss20b_lora_ckpt")],
    8: [("run", "gptoss20b_resident_ckpt"), ("second", "gptoss20b_resident_ckpt"), ("unsloth", "gpt-oss")],
    # GPT-OSS-120B at r16 with fp32 AdamW: on one H200 (kind nvidia-h200)
    9: [("run", "gptoss120b_lora_r16"), ("run", "gptoss120b_lora_r16_b8")],
    # GPT-OSS-20B resident against dequantized, with and without checkpointing, in one call (issue 42's 0.95x row)
    10: [("run", "gptoss20b_resident_ckpt"), ("run", "gptoss20b_resident"), ("run", "gptoss20b_lora")],
    # GPT-OSS-20B resident against dequantized with checkpointing, one call (then the prefetch's own benchmark)
    11: [("run", "gptoss20b_resident_ckpt"), ("run", "gptoss20b_lora_ckpt")],
    # as 11, then the variant that dequantizes the next chunk ahead on a second stream
    12: [("run", "gptoss20b_resident_ckpt"), ("run", "gptoss20b_lora_ckpt"), ("run", "gptoss20b_resident_ckpt_ahead")],
    # the one-GPU recipe as shipped (12,288 tokens a micro-batch, activation offloading) resident against dequantized
    # (issue 42's 0.95x row within 24 GiB), then both with the layer inputs kept on the GPU
    13: [("run", "gptoss20b_mxfp4"), ("run", "gptoss20b_mxfp4_dequantized"),
         ("run", "gptoss20b_mxfp4_not_offloaded"), ("run", "gptoss20b_mxfp4_not_offloaded_dequantized")],
    # 13's second pair first (the recipe without activation offloading, resident against dequantized), then the recipe
    # as shipped: whether offloading, which saved no memory at 8 rows, earns its place at 6
    14: [("run", "gptoss20b_mxfp4_not_offloaded"), ("run", "gptoss20b_mxfp4_not_offloaded_dequantized"),
         ("run", "gptoss20b_mxfp4")],
}
LEAST_SECONDS = 60  # no task starts with less of the budget left


def gpu_name() -> str | None:
    """The GPU, asked of nvidia-smi: this process never initialises CUDA."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              check=False, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def run_tasks(tasks: list[tuple[str, str]], args, work: Path, out: Path, results: dict, save) -> None:
    deadline = time.time() + args.budget
    models = {CASES[name][1] for kind, name in tasks if kind in ("run", "second", "sigterm")}  # Unsloth reads their rows' lengths
    results["not_reported"] += prepare(work, out, models, max(LEAST_SECONDS, deadline - time.time()))
    for kind, name in tasks:
        if kind == "model":  # written ahead for the lease's next call, after every row of this one
            results["not_reported"] += prepare(work, out, {name}, max(LEAST_SECONDS, deadline - time.time()))
            continue
        left = deadline - time.time()
        if left < LEAST_SECONDS:
            results["not_reported"].append(not_reported(f"{kind} {name}", "not run",
                                                        f"{left:.0f} s left of the --budget {args.budget} s"))
            continue
        timeout = min(args.timeout, left)
        if kind in ("run", "second"):
            row = run_case(name, work, out, args.steps, timeout, args.accelerate_config, second=kind == "second",
                           flags=tuple(args.flags.split()))
            results["rows" if row["status"] == "ok" else "not_reported"].append(row)
        elif kind == "sigterm":
            fresh = next((row for row in results["rows"] if row["case"] == name), None)
            results["sigterm"] += sigterm_cases(name, work, out, timeout / 3, args.accelerate_config, fresh)
        else:
            results["unsloth"] += unsloth(name, out, Path(args.unsloth_peer), args.steps, left - 30)
        save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="runs/up")
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/up/results"))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=int, default=480, help="seconds per launch, loading and compiling included")
    parser.add_argument("--accelerate_config", default="ddp.yaml", help="'' for none (a CPU check of this script)")
    parser.add_argument("--flags", default="", help="more flags for every run, e.g. '--max_length 128' on a CPU")
    parser.add_argument("--second_launch", action="store_true", help="launch each case again, its compile caches warm")
    parser.add_argument("--sigterm", help="CASE: time SIGTERM while it loads, while its first step compiles and mid-run")
    parser.add_argument("--all", action="store_true", help="every recipe case, a second launch, the SIGTERM timings "
                        "and Unsloth, in two parts (--part)")
    parser.add_argument("--part", type=int, choices=sorted(PARTS), help="with --all: the part to run")
    parser.add_argument("--budget", type=int, default=540, help="seconds the whole invocation may take (models "
                        "written included); tasks it leaves no time for are reported as not run")
    parser.add_argument("--unsloth_peer", default=str(ROOT / ".peers" / "unsloth_peer.py"))
    parser.add_argument("--write_model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    if args.write_model:
        write_model(args.write_model, work)
        return
    if args.all and not args.part:
        parser.error("--all runs in two device calls: add --part 1, then --part 2")
    out.mkdir(parents=True, exist_ok=True)
    if args.all:
        tasks = PARTS[args.part]
    elif args.sigterm:
        tasks = [("run", args.sigterm), ("sigterm", args.sigterm)]
    else:
        tasks = [(kind, name) for name in args.cases.split(",")
                 for kind in (("run", "second") if args.second_launch else ("run",))]
    results_path = out / (f"user_path_part{args.part}.json" if args.all else "user_path.json")
    results = {"gpu": gpu_name(), "steps": args.steps, "rows": [], "not_reported": [], "sigterm": [], "unsloth": []}

    def save():
        results_path.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({key: value for key, value in results.items() if value}), flush=True)

    run_tasks(tasks, args, work, out, results, save)
    save()


if __name__ == "__main__":
    main()
