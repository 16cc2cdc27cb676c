"""Every accelerate config trains with two processes on CPU, runs the strategy it asks for, gives the same answer as
a single process, saves a model (or adapter) that reloads in a fresh process, and resumes from its checkpoints.

Each test launches the real `accelerate launch --config_file accelerate_configs/X.yaml --num_processes 2` in a
subprocess, as a user would, with the shipped config file. Runs are shared between tests through module fixtures:
one launch per (recipe, config) pair, about 10-25 s each on 2 cores.

Same answer: the 2-process runs use per-device batch 4, the single-process reference per-device batch 4 with 2
accumulation steps. accelerate hands consecutive per-device batches of the seeded sampler to ranks 0 and 1, so every
optimizer step sees the same 8 rows in the same two micro-batches of 4 (same padding), and the loss is normalised by
the token count of the global batch in both. (A single-process batch of 8 gives the same rows but padded together:
for the tiny Llama that agrees to ~1e-7, for the tiny GPT-OSS only to ~3e-4 after 4 steps at lr 1e-2.) Dropout is off
and the learning rate is constant, so that a resumed run can be compared with an uninterrupted one.

    cd /work/main && HF_HUB_OFFLINE=1 python -m pytest tests/test_distributed.py -x -q
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import ACCELERATE, ROOT, free_port

pytestmark = pytest.mark.launches  # its tests start training processes

CONFIGS = ROOT / "accelerate_configs"
STRATEGIES = ["ddp", "fsdp", "zero2", "zero3", "zero3_offload"]
LORA_STRATEGIES = ["ddp", "fsdp", "zero2", "zero3"]  # zero3_offload + LoRA: verified by hand, offload tested above
# What each config file must run as: (strategy in the setup line, the wrapper around the model).
EXPECTED = {
    "ddp": ("ddp", "DistributedDataParallel"),
    "fsdp": ("fsdp", None),  # FSDP2 wraps in place: the class becomes FSDP<ModelClass>, checked below
    "zero2": ("zero2", "DeepSpeedEngine"),
    "zero3": ("zero3", "DeepSpeedEngine"),
    "zero3_offload": ("zero3", "DeepSpeedEngine"),
}
STEPS = 4
# Relative agreement asked for in float32. Measured on CPU: losses <= 1.2e-7; weights <= 1.2e-5 (||diff|| / ||tensor||;
# as max |diff| / max |tensor|: <= 1.7e-4, Adam turns float32 rounding of near-zero gradients into full-size steps).
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
# A resumed run against the uninterrupted run of the same config (1e-6 is the bar under ZeRO-2/3 and FSDP2).
# Measured: ddp, fsdp, zero2, zero3 bitwise equal (0); zero3_offload losses 1.5e-7, weights 7.2e-7 (its CPU Adam
# does not continue bitwise from a reloaded state; not investigated further), hence its own bound.
RESUME_RTOL = {"zero3_offload": 1e-5}

# Settings that make runs of different strategies comparable step for step.
COMPARABLE = [
    "--logging_steps", "1", "--eval_strategy", "no", "--report_to", "none",
    "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
    "--per_device_train_batch_size", "4", "--seed", "42",
]
# No dropout; LoRA needs a larger step to move in 4 steps; activation checkpointing on (FSDP2 + checkpointing + LoRA).
LORA = ["--lora_dropout", "0", "--learning_rate", "1e-2", "--gradient_checkpointing", "true"]
# the recipe adapts the attention only; the experts' 3-D parameters are what sharding can get wrong, so adapt them too
EXPERT_LORA = ["--lora_target_parameters", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def per_config(configs: list[str]) -> list:
    """The tests of one config file run on one pytest-xdist worker: they share that config's launches (`runs`)."""
    return [pytest.param(config, marks=pytest.mark.xdist_group(f"distributed-{config}")) for config in configs]


def launch_env(**extra) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def accelerate_command(config: str | None, processes: int, port: int, *machine_flags: str) -> list[str]:
    command = [ACCELERATE, "launch", "--num_processes", str(processes), "--main_process_port", str(port)]
    if config:
        command[2:2] = ["--config_file", str(CONFIGS / f"{config}.yaml")]
    return command + list(machine_flags)


def sft_args(recipe: str, output_dir: Path, *flags: str) -> list[str]:
    return ["scripts/sft.py", "--config", f"recipes/{recipe}.yaml", "--tiny", "--output_dir", str(output_dir), *flags]


class Run:
    """One finished launch: its output folder, everything it printed, and its loss history at that moment."""

    def __init__(self, output_dir: Path, output: str, seconds: float):
        self.output_dir, self.output, self.seconds = output_dir, output, seconds
        state_file = output_dir / "trainer_state.json"
        state = json.loads(state_file.read_text()) if state_file.is_file() else {"log_history": []}
        self.losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]

    @property
    def setup(self) -> dict:
        match = re.search(r"\[finetune\] setup: (\{.*\})", self.output)
        assert match, f"no setup line in the log of {self.output_dir}:\n{self.output[-3000:]}"
        return json.loads(match.group(1))


def run_sft(config: str | None, recipe: str, output_dir: Path, *flags: str, processes: int = 2, env=None) -> Run:
    """Launch scripts/sft.py as a user would and return the finished run; fail with the log if it failed."""
    command = accelerate_command(config, processes, free_port()) + sft_args(recipe, output_dir, *flags)
    start = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=launch_env(**(env or {})), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(command)} failed ({result.returncode}):\n{output[-6000:]}"
    return Run(output_dir, output, time.monotonic() - start)


def batch_flags(processes: int) -> list[str]:
    """Micro-batches of 4 rows and a global batch of 8, whatever the number of processes."""
    return ["--gradient_accumulation_steps", str(2 // processes)]


# --- Weights, reloaded here: a fresh process, not the one that trained.


def tiny_model_folder(family: str) -> Path:
    from finetune.models import tiny

    return tiny.tiny_model_folder(family)


def reload_full_model(folder: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], f"{folder}: incomplete model: {info}"
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def reload_adapter(folder: Path, family: str) -> dict:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder(family), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder)
    adapter = {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if "lora_" in name}
    assert adapter, f"{folder}: the adapter has no LoRA tensors"
    return adapter


def max_relative_difference(weights: dict, reference: dict) -> float:
    """The largest ||difference|| / ||tensor|| over all tensors (Frobenius norms)."""
    assert weights.keys() == reference.keys(), f"different tensors: {sorted(weights.keys() ^ reference.keys())[:6]}"
    worst = 0.0
    for name, ref in reference.items():
        scale = ref.norm().item() or 1.0
        worst = max(worst, (weights[name] - ref).norm().item() / scale)
    return worst


def max_relative_loss_difference(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) == STEPS, f"{len(losses)} logged losses, reference {len(reference)}"
    return max(abs(loss - ref) / abs(ref) for loss, ref in zip(losses, reference))


def assert_setup(run: Run, config: str) -> None:
    setup = run.setup
    strategy, wrapper = EXPECTED[config]
    assert setup["world_size"] == 2, setup
    assert setup["strategy"] == strategy, setup
    assert setup["global_batch"] == 8 and setup["per_device_batch"] == 4, setup
    if config == "fsdp":
        assert setup["distributed_type"] == "FSDP" and setup["dtensor_parameters"], setup
        assert setup["wrapper"].startswith("FSDP"), setup
    else:
        assert setup["wrapper"] == wrapper, setup
        assert not setup["dtensor_parameters"], setup
    if config.startswith("zero"):
        assert setup["distributed_type"] == "DEEPSPEED" and setup["zero_stage"] == int(strategy[-1]), setup


# --- Runs shared by the tests below (each launched once, when a test first needs it).


class Runs:
    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, Run] = {}
        self.failures: dict[str, str] = {}

    def get(self, key: str, launch) -> Run:
        if key in self.failures:  # the other tests sharing this launch fail with its error, not a relaunch's
            pytest.fail(f"shared launch {key} failed earlier:\n{self.failures[key]}")
        if key not in self.cache:
            try:
                self.cache[key] = launch(self.root / key)
            except AssertionError as error:
                self.failures[key] = str(error)[-6000:]
                raise
        return self.cache[key]

    def full_single(self) -> Run:
        return self.get("llama-full-single", lambda out: run_sft(
            None, "llama-3.2-1b/full", out, *COMPARABLE, *batch_flags(1), "--max_steps", str(STEPS), processes=1))

    def full_resumed(self, config: str) -> tuple[Run, Run]:
        """An uninterrupted run of STEPS steps saving checkpoints, and a relaunch of it in a new folder that holds only
        its run record and its first checkpoint (as a run killed after that checkpoint leaves it): it resumes."""
        flags = [*COMPARABLE, *batch_flags(2), "--max_steps", str(STEPS), "--save_strategy", "steps",
                 "--save_steps", str(STEPS // 2)]

        def resumed(out):
            out.mkdir(parents=True)
            shutil.copy(uninterrupted.output_dir / "finetune_run.json", out)
            shutil.copytree(uninterrupted.output_dir / f"checkpoint-{STEPS // 2}", out / f"checkpoint-{STEPS // 2}")
            return run_sft(config, "llama-3.2-1b/full", out, *flags)

        key = f"llama-full-{config}"
        uninterrupted = self.get(key + "-uninterrupted", lambda out: run_sft(config, "llama-3.2-1b/full", out, *flags))
        return uninterrupted, self.get(key, resumed)

    def gpt_oss_lora(self, config: str | None) -> Run:
        processes = 2 if config else 1
        checkpoint = [] if config else ["--save_strategy", "steps", "--save_steps", str(STEPS // 2)]  # resumed below
        return self.get(f"gpt-oss-lora-{config or 'single'}", lambda out: run_sft(
            config, "gpt-oss-20b/lora", out, *COMPARABLE, *LORA, *EXPERT_LORA, *batch_flags(processes),
            "--max_steps", str(STEPS), *checkpoint,
            processes=processes))

    def gpt_oss_lora_resumed(self) -> Run:
        """The single-process expert LoRA run relaunched in a folder holding only its record and first checkpoint."""
        uninterrupted = self.gpt_oss_lora(None)

        def resumed(out):
            out.mkdir(parents=True)
            shutil.copy(uninterrupted.output_dir / "finetune_run.json", out)
            shutil.copytree(uninterrupted.output_dir / f"checkpoint-{STEPS // 2}", out / f"checkpoint-{STEPS // 2}")
            return run_sft(None, "gpt-oss-20b/lora", out, *COMPARABLE, *LORA, *EXPERT_LORA, *batch_flags(1),
                           "--max_steps", str(STEPS), "--save_strategy", "steps", "--save_steps", str(STEPS // 2),
                           processes=1)

        return self.get("gpt-oss-lora-single-resumed", resumed)


@pytest.fixture(scope="module")
def runs():
    # Not under pytest's numbered basetemp: a concurrent pytest session may rotate it away while runs are reused.
    root = Path(tempfile.mkdtemp(prefix="finetune-distributed-"))
    yield Runs(root)
    shutil.rmtree(root, ignore_errors=True)


# --- The single-process reference.


def test_single_process_reference_trains_and_saves_a_changed_model(runs):
    run = runs.full_single()
    assert run.setup["world_size"] == 1 and run.setup["strategy"] == "single", run.setup
    assert run.losses[-1] < run.losses[0], run.losses
    trained, initial = reload_full_model(run.output_dir), reload_full_model(tiny_model_folder("llama"))
    unchanged = [name for name in trained if (trained[name] - initial[name]).abs().max() == 0]
    assert not unchanged, f"the saved model still has its initial {unchanged}"


# --- Full fine-tuning under every config file: strategy, same answer, full model saved, resume.


@pytest.mark.parametrize("config", per_config(STRATEGIES))
def test_full_finetune_runs_the_strategy_of_its_config_file(runs, config):
    first, resumed = runs.full_resumed(config)
    assert_setup(first, config)
    assert_setup(resumed, config)
    assert resumed.losses[-1] < resumed.losses[0], resumed.losses
    # on CPU DeepSpeed's collectives go through gloo: it loads (and on a first run compiles) no shared-memory op
    assert "shm_comm" not in first.output + resumed.output, first.output[-3000:]


@pytest.mark.parametrize("config", per_config(STRATEGIES))
def test_full_finetune_resumes_from_its_checkpoint_to_the_uninterrupted_result(runs, config):
    uninterrupted, resumed = runs.full_resumed(config)
    assert "[finetune] resuming from" not in uninterrupted.output
    checkpoint = resumed.output_dir / f"checkpoint-{STEPS // 2}"
    assert f"[finetune] resuming from {checkpoint}" in resumed.output, resumed.output[-3000:]
    # The relaunch trained only the remaining steps (one logged loss each), and its curve continues the first one's.
    assert resumed.output.count("{'loss':") == STEPS - STEPS // 2, resumed.output[-3000:]
    assert resumed.losses[: STEPS // 2] == uninterrupted.losses[: STEPS // 2] and len(resumed.losses) == STEPS
    loss_difference = max(abs(a - b) / abs(b) for a, b in zip(resumed.losses, uninterrupted.losses, strict=True))
    weight_difference = max_relative_difference(reload_full_model(resumed.output_dir),
                                                reload_full_model(uninterrupted.output_dir))
    print(f"\n[{config}] resumed vs uninterrupted, max relative difference: losses {loss_difference:.1e}, "
          f"weights {weight_difference:.1e}")
    bound = RESUME_RTOL.get(config, 1e-6)
    assert loss_difference <= bound and weight_difference <= bound


@pytest.mark.parametrize("config", per_config(STRATEGIES))
def test_full_finetune_gives_the_single_process_answer(runs, config):
    reference = runs.full_single()
    _, run = runs.full_resumed(config)
    loss_difference = max_relative_loss_difference(run.losses, reference.losses)
    assert loss_difference <= LOSS_RTOL, (run.losses, reference.losses)
    weight_difference = max_relative_difference(reload_full_model(run.output_dir), reload_full_model(reference.output_dir))
    print(f"\n[{config}] max relative difference: losses {loss_difference:.1e}, weights {weight_difference:.1e}")
    assert weight_difference <= WEIGHT_RTOL


# --- LoRA (GPT-OSS: attention and expert parameters) under every config file: a non-empty adapter, same answer.


@pytest.mark.parametrize("config", per_config(LORA_STRATEGIES))
def test_lora_saves_the_single_process_adapter(runs, config):
    reference = runs.gpt_oss_lora(None)
    run = runs.gpt_oss_lora(config)
    assert_setup(run, config)
    assert run.losses[-1] < run.losses[0], run.losses
    loss_difference = max_relative_loss_difference(run.losses, reference.losses)
    assert loss_difference <= LOSS_RTOL, (run.losses, reference.losses)
    adapter, expected = reload_adapter(run.output_dir, "gpt-oss"), reload_adapter(reference.output_dir, "gpt-oss")
    assert any("experts" in name for name in adapter), sorted(adapter)[:6]
    grouped = "[finetune] expert LoRA: grouped GEMMs in 2 experts modules"  # finetune/models/expert_lora.py, not peft's W + BA
    assert grouped in run.output and grouped in reference.output, run.output[-3000:]
    untrained = [name for name, tensor in adapter.items() if "lora_B" in name and tensor.abs().max() == 0]
    assert not untrained, f"lora_B still zero (untrained) in {untrained[:4]}"
    weight_difference = max_relative_difference(adapter, expected)
    print(f"\n[{config} LoRA] max relative difference: losses {loss_difference:.1e}, adapter {weight_difference:.1e}")
    assert weight_difference <= WEIGHT_RTOL
    # what `finetune chat | generate | eval` load: the same answer as the single-process adapter, not the base model's
    trained = held_out_loss(run.output_dir)
    assert trained == pytest.approx(held_out_loss(reference.output_dir), rel=1e-3)
    base = json.loads((run.output_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert trained != pytest.approx(held_out_loss(base), rel=1e-3)


def held_out_loss(output_dir: Path | str) -> float:
    """A model or adapter folder as `finetune chat | generate | eval` load it, scored on two held-out sample rows."""
    from finetune.run import evaluation
    from finetune.run import generation as inference

    model, tokenizer = inference.load_trained(str(output_dir))
    rows = [json.loads(line)["messages"] for line in (ROOT / "data/sample/test.jsonl").read_text().splitlines()[:2]]
    return evaluation.assistant_loss(model, tokenizer, rows)


def test_expert_lora_resumes_from_its_checkpoint_to_the_uninterrupted_result(runs):
    uninterrupted, resumed = runs.gpt_oss_lora(None), runs.gpt_oss_lora_resumed()
    assert f"[finetune] resuming from {resumed.output_dir / f'checkpoint-{STEPS // 2}'}" in resumed.output
    assert "[finetune] expert LoRA: grouped GEMMs in 2 experts modules" in resumed.output
    assert resumed.losses[: STEPS // 2] == uninterrupted.losses[: STEPS // 2] and len(resumed.losses) == STEPS
    assert max_relative_loss_difference(resumed.losses, uninterrupted.losses) <= 1e-6
    adapter = reload_adapter(resumed.output_dir, "gpt-oss")
    assert max_relative_difference(adapter, reload_adapter(uninterrupted.output_dir, "gpt-oss")) <= 1e-6


@pytest.mark.parametrize("config", per_config(["zero2"]))
def test_a_payload_planted_in_a_zero_checkpoint_never_runs_on_resume(runs, config, tmp_path):
    """The issue-43 case: DeepSpeed's model states replaced by a pickle whose unpickling creates a file, the
    checkpoint's completeness marker rewritten so that it looks complete; the relaunch resumes it and is refused in
    one sentence naming the file (every rank says the same), and the file is never created. The other files:
    tests/test_checkpoint_payloads.py."""
    from tests.test_checkpoint_payloads import plant

    uninterrupted, _ = runs.full_resumed(config)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(uninterrupted.output_dir / "finetune_run.json", out)
    checkpoint = shutil.copytree(uninterrupted.output_dir / f"checkpoint-{STEPS // 2}", out / f"checkpoint-{STEPS // 2}")
    marker = tmp_path / "payload-ran"
    planted = plant(checkpoint / f"global_step{STEPS // 2}" / "mp_rank_00_model_states.pt", marker)
    flags = [*COMPARABLE, *batch_flags(2), "--max_steps", str(STEPS), "--save_strategy", "steps",
             "--save_steps", str(STEPS // 2)]
    command = accelerate_command(config, 2, free_port()) + sft_args("llama-3.2-1b/full", out, *flags)
    result = subprocess.run(command, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and not marker.exists(), result.stderr[-3000:]
    refusals = set(re.findall(r"error: [^\r\n]*", result.stderr))
    assert len(refusals) == 1, result.stderr[-3000:]
    assert refusals.pop().startswith(f"error: {planted}: it would build "), result.stderr[-3000:]
    assert not re.search(r'File "[^"]*(finetune/|scripts/sft\.py)', result.stderr), result.stderr[-3000:]


# --- Two machines on one host: one process each, rendezvous over 127.0.0.1.


def test_two_machines_give_the_single_process_answer(runs, tmp_path):
    reference = runs.full_single()
    port, output_dir = free_port(), tmp_path / "out"
    machines = [
        subprocess.Popen(
            accelerate_command("ddp", 2, port, "--num_machines", "2", "--machine_rank", str(rank),
                               "--main_process_ip", "127.0.0.1")
            + sft_args("llama-3.2-1b/full", output_dir, *COMPARABLE, *batch_flags(2), "--max_steps", str(STEPS)),
            cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [machine.communicate(timeout=600)[0] for machine in machines]
    for rank, (machine, output) in enumerate(zip(machines, outputs)):
        assert machine.returncode == 0, f"machine {rank} failed:\n{output[-5000:]}"
    run = Run(output_dir, outputs[0], 0.0)
    assert_setup(run, "ddp")
    assert max_relative_loss_difference(run.losses, reference.losses) <= LOSS_RTOL, (run.losses, reference.losses)
    assert max_relative_difference(reload_full_model(output_dir), reload_full_model(reference.output_dir)) <= WEIGHT_RTOL


# --- The setup check: a config asking for one strategy while another runs stops the run.


def test_fsdp_config_falling_back_to_ddp_stops_with_a_clear_error(tmp_path):
    """Without the CPU FSDP shim, accelerate runs an FSDP config as DDP; the run must refuse to train."""
    config_file = tmp_path / "fsdp_without_shim.yaml"
    shutil.copy(CONFIGS / "fsdp.yaml", config_file)
    command = [ACCELERATE, "launch", "--config_file", str(config_file), "--num_processes", "2",
               "--main_process_port", str(free_port())]
    command += sft_args("llama-3.2-1b/full", tmp_path / "out", *COMPARABLE, *batch_flags(2), "--max_steps", "2")
    result = subprocess.run(command, cwd=ROOT, env=launch_env(FINETUNE_CPU_FSDP="0"), capture_output=True,
                            text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert re.search(r"exitcode\s*:\s*2\b", output), output[-3000:]  # the training process exited with code 2
    assert "error: " in output and "asked for fsdp but ddp is running (DistributedDataParallel)" in output, output[-3000:]
    assert "'loss'" not in output  # stopped before the first step
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_processes_training_as_independent_runs_is_a_setup_problem():
    """A GPU-style config on a machine without GPU: N processes launched, each training alone at world size 1."""
    from finetune.run.trainer import setup_problem

    independent = {"world_size": 1, "strategy": "single", "wrapper": "LlamaForCausalLM"}
    assert "2 processes were launched but they train as 1 independent run" in setup_problem(independent, "ddp", 2)
    ddp = {"world_size": 2, "strategy": "ddp", "wrapper": "DistributedDataParallel"}
    assert setup_problem(ddp, "ddp", 2) is None
    assert "asked for zero3 but ddp is running" in setup_problem(ddp, "zero3", 2)


# --- QLoRA: runs where the strategy can take 4-bit weights, refused where it would shard them.


@pytest.mark.parametrize("use, values", [
    ("fsdp", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}),  # as accelerate launch sets them for fsdp.yaml
    ("zero3", {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/zero3.json"}),
])
def test_qlora_is_refused_under_sharding_strategies(monkeypatch, tmp_path, use, values):
    from finetune.checks import recipe as recipe_checks
    from finetune.errors import UserError
    from finetune.run import arguments

    monkeypatch.chdir(ROOT)
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    run = arguments.parse_args(["--config", "recipes/llama-3.2-3b/qlora.yaml", "--tiny", "--output_dir", str(tmp_path)])
    with pytest.raises(UserError, match=rf"QLoRA's 4-bit weights cannot be sharded by {use.upper()}"):
        recipe_checks.check(run)


@pytest.mark.parametrize("config", ["ddp"])  # zero2: verified by hand (2-3 min on CPU, too slow for this module)
def test_qlora_trains_with_ddp(tmp_path, config):
    run = run_sft(config, "llama-3.2-3b/qlora", tmp_path / "out", *COMPARABLE, *LORA, *batch_flags(2),
                  "--max_steps", str(STEPS))
    assert_setup(run, config)
    assert run.losses[-1] < run.losses[0], run.losses
    assert "find_unused_parameters=True" not in run.output  # the recipe turns DDP's search for unused weights off
    assert reload_adapter(run.output_dir, "llama")
