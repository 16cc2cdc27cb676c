"""transformers' `--deepspeed FILE` as transformers and LLaMA-Factory users pass it (issue 44): the DeepSpeed JSONs
that transformers, LLaMA-Factory and DeepSpeed ship (tests/data/external/configs/README.md) train with DeepSpeed under
a launch that asked for no strategy of its own (torchrun, `accelerate launch` with a MULTI_GPU file), or are refused
in one sentence whose fix, applied literally, leaves nothing to refuse; an accelerate config asking for another
strategy is refused naming both. Every JSON is checked in this process with the environment its launcher exports (the
checks a run makes before loading); one real torchrun, one real `accelerate launch` and one real `deepspeed` launcher
train two CPU processes."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from finetune.commands.check import problems_before_loading, training_process_environment
from finetune.errors import UserError
from tests.helpers import ACCELERATE, ROOT, free_port, launch_sft, printed_setup, write
from tests.test_bad_inputs import FULL, LORA, TINY, with_keys

CONFIGS = ROOT / "tests" / "data" / "external" / "configs"
TRANSFORMERS = CONFIGS / "transformers" / "tests" / "deepspeed"
LLAMA_FACTORY = CONFIGS / "llama-factory" / "examples" / "deepspeed"
DEEPSPEED = CONFIGS / "deepspeed" / "tests" / "torch_compile"
SCRIPT = str(ROOT / "scripts" / "sft.py")
DDP = str(ROOT / "accelerate_configs" / "ddp.yaml")

# DeepSpeed's own test JSONs hard-code what the recipe decides (recipes/llama-3.2-1b/full.yaml on this machine: batch
# 8, accumulation 2, learning rate 2e-5, betas 0.9/0.999, no decay, float32, two processes)
HARD_CODED = ["`train_batch_size: 8` is not the recipe's per-device batch × accumulation × processes, 32",
              "`gradient_accumulation_steps: 1` (left out: accelerate sets it)",
              "`optimizer.params.lr: 0.001` contradicts the recipe's `learning_rate: 2e-05`",
              "`optimizer.params.betas: [0.8, 0.999]` contradicts", "`optimizer.params.weight_decay: 3e-07`",
              "`bf16.enabled: true` asks for bf16", "set them to \"auto\""]
# (JSON, words of the refusal, or None: it trains as it is)
SHIPPED_JSONS = [
    *[(TRANSFORMERS / name, None) for name in ("ds_config_zero2.json", "ds_config_zero3.json")],
    *[(LLAMA_FACTORY / f"ds_{name}_config.json", None) for name in ("z0", "z2", "z2_offload", "z3", "z3_offload")],
    *[(DEEPSPEED / name, HARD_CODED) for name in ("ds_config_z2.json", "ds_config_z3.json")],
]
LAUNCHERS = ["torchrun", "accelerate launch"]


def checked_as_launched(launcher: str, json_file: Path, tmp_path: Path, monkeypatch, extra=(),
                        arguments: list[str] | None = None) -> list[str]:
    """The problems a training process of this two-process launch finds before loading, in this process: `accelerate
    launch --config_file accelerate_configs/ddp.yaml --num_processes 2` exports what accelerate's own launcher code
    makes; torchrun exports only its ranks. By default the tiny recipe with `--deepspeed JSON_FILE`."""
    if launcher == "torchrun":
        environment = {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}
    else:
        environment, _ = training_process_environment(["--config_file", DDP, "--num_processes", "2", *extra, SCRIPT])
    for name, value in {**environment, "WORLD_SIZE": "1"}.items():  # parsed as one process: no process group
        monkeypatch.setenv(name, value)
    arguments = arguments or [*TINY, "--deepspeed", str(json_file), "--output_dir", str(tmp_path / "out")]
    return [str(problem) for problem in problems_before_loading(arguments, 2)]


def fixed_literally(json_file: Path, refusal: str, tmp_path: Path) -> Path:
    """The JSON with the refusal's fix applied as written: each key of the JSON it names set to "auto"."""
    values = json.loads(json_file.read_text())
    for key in re.findall(r"(?<!recipe's )`([\w.]+): ", refusal):
        *parents, last = key.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = "auto"
    return write(tmp_path / json_file.name, json.dumps(values))


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("json_file, refusal", SHIPPED_JSONS,
                         ids=[str(case[0].relative_to(CONFIGS)) for case in SHIPPED_JSONS])
def test_a_shipped_deepspeed_json_trains_as_the_flag_or_its_refusal_fixed_literally_does(json_file, refusal, launcher,
                                                                                      tmp_path, monkeypatch, capfd):
    found = checked_as_launched(launcher, json_file, tmp_path, monkeypatch)
    if refusal is None:
        assert found == [], found
        return
    assert len(found) == 1 and all(word in found[0] for word in refusal), found
    assert found[0].startswith(f"{json_file}: ") and found[0].count("; ") == 1, found[0]
    assert checked_as_launched(launcher, fixed_literally(json_file, found[0], tmp_path), tmp_path, monkeypatch) == []


def test_blocks_that_would_change_the_recipes_optimizer_or_schedule_give_way_and_say_so(tmp_path, monkeypatch, capfd):
    """transformers' own JSON: an AdamW block of "auto" values and a WarmupLR block; the training arguments are given
    the JSON without them (read once: the file is not named to them), and each gives way in one line."""
    from finetune.run import arguments

    monkeypatch.setenv("WORLD_SIZE", "1")
    capfd.readouterr()
    assert checked_as_launched("torchrun", TRANSFORMERS / "ds_config_zero2.json", tmp_path, monkeypatch) == []
    printed = capfd.readouterr().out
    assert "ds_config_zero2.json: its `optimizer` block (AdamW) gives way to the recipe's `optim: adamw_torch_fused` " \
           "at the recipe's learning rate, betas, epsilon and weight decay, as DeepSpeed CPU Adam under its optimizer " \
           "offload" in printed, printed
    assert "its `scheduler` block (WarmupLR) gives way to the recipe's `lr_scheduler_type: cosine`" in printed
    run = arguments.parse_args([*TINY, "--deepspeed", str(TRANSFORMERS / "ds_config_zero2.json"),
                                "--output_dir", str(tmp_path / "out")])
    assert isinstance(run.training.deepspeed, dict) and not {"optimizer", "scheduler"} & set(run.training.deepspeed)
    assert (run.launch.strategy, run.launch.asked_by) == (
        "zero2", f"--deepspeed {TRANSFORMERS / 'ds_config_zero2.json'}")


def test_every_problem_of_a_deepspeed_json_is_named_at_once_each_with_its_fix(tmp_path, monkeypatch):
    broken = write(tmp_path / "ds.json", json.dumps({
        "zero_optimization": {"stage": "3", "overlap_com": True}, "bfloat16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}))
    found = checked_as_launched("torchrun", broken, tmp_path, monkeypatch)
    assert len(found) == 1, found
    for words in ("4 problems, each with its fix", "`zero_optimization.stage: \"3\"` is text",
                  "write the number 3 without quotes", "`zero_optimization.overlap_com` extra inputs are not permitted",
                  "remove it or fix its spelling", "`bfloat16` is DeepSpeed's old name", "rename it to `bf16`",
                  "`train_micro_batch_size_per_gpu: 4` contradicts the recipe's `per_device_train_batch_size: 8`",
                  "its `optimizer` block (Lamb) would replace the recipe's `optim: adamw_torch_fused`",
                  "delete that block"):
        assert words in found[0], (words, found[0])


# An accelerate config asking for a strategy of its own, beside --deepspeed: (name, accelerate launch flags, what the
# file asks for in the refusal's words)
CONTRADICTIONS = [
    ("FSDP file", ["--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml")], "fsdp.yaml: asks for FSDP"),
    ("DeepSpeed file with another JSON", ["--config_file", str(ROOT / "accelerate_configs" / "zero2.yaml")],
     "zero2.yaml: asks for `deepspeed_config_file: ds_configs/zero2.json`"),
]


def asking_for_deepspeed(given: str, json_file: Path, tmp_path: Path) -> tuple[list[str], str, str]:
    """The tiny recipe's arguments asking for DeepSpeed with `json_file` as the flag or as the recipe key holding its
    path (LLaMA-Factory's `deepspeed:`), how a refusal names it, and the line that asks for it."""
    if given == "flag":
        return [*TINY, "--deepspeed", str(json_file)], f"--deepspeed {json_file}", "--deepspeed"
    recipe = write(tmp_path / "recipe.yaml", with_keys(FULL, f"deepspeed: {json_file}"))
    return ["--config", str(recipe), "--tiny"], f"{recipe}: `deepspeed: {json_file}`", f"deepspeed: {json_file}"


def without(arguments: list[str], asking: str) -> list[str]:
    """The fix "remove --deepspeed" or "remove `deepspeed` from RECIPE", followed literally."""
    if asking == "--deepspeed":
        return arguments[:arguments.index(asking)] + arguments[arguments.index(asking) + 2:]
    recipe = Path(arguments[arguments.index("--config") + 1])
    recipe.write_text("".join(line for line in recipe.read_text().splitlines(keepends=True) if line.strip() != asking))
    return arguments


@pytest.mark.parametrize("given", ["flag", "recipe key"])
@pytest.mark.parametrize("name, flags, ours", CONTRADICTIONS, ids=[case[0] for case in CONTRADICTIONS])
def test_an_accelerate_config_asking_for_another_strategy_than_the_flag_is_refused_naming_both(name, flags, ours, given,
                                                                                             tmp_path, monkeypatch):
    json_file = LLAMA_FACTORY / "ds_z3_config.json"
    arguments, named, asking = asking_for_deepspeed(given, json_file, tmp_path)
    arguments += ["--output_dir", str(tmp_path / "out")]
    environment, _ = training_process_environment([*flags, "--num_processes", "2", SCRIPT])
    for variable, value in {**environment, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(variable, value)
    refused = [str(problem) for problem in problems_before_loading(arguments, 2)]
    assert len(refused) == 1 and f"{ours} while {named} asks for ZeRO-3" in refused[0], refused
    removal = "--deepspeed" if given == "flag" else f"`deepspeed` from {arguments[1]}"
    assert "launch without --config_file" in refused[0] and f"or remove {removal} to train" in refused[0], refused
    # either fix, followed literally, leaves nothing to refuse: the flag (key) without the file, the file without it
    for variable in environment:
        monkeypatch.delenv(variable)
    assert checked_as_launched("torchrun", json_file, tmp_path, monkeypatch, arguments=arguments) == []
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    assert problems_before_loading(without(arguments, asking), 2) == []


def trained(launcher: list[str], json_file: Path, output_dir: Path) -> str:
    """A two-step run of the tiny recipe started by `launcher` with `--deepspeed JSON_FILE`: what it printed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "finetune" / "torch_extensions"))
    result = subprocess.run([*launcher, SCRIPT, *TINY, "--deepspeed", str(json_file), "--max_steps", "2",
                             "--eval_strategy", "no", "--report_to", "none", "--eval_samples_before_after", "0",
                             "--output_dir", str(output_dir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=560, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (output_dir / "model.safetensors").is_file()
    return result.stdout


@pytest.mark.launches
def test_torchrun_trains_llama_factorys_zero3_offload_json_as_the_flag_asks(tmp_path):
    """The JSON that died in DeepSpeed's batch assertion: ZeRO-3, parameters and optimizer offloaded, under a launcher
    that asks for no strategy; the setup line says zero3 and that --deepspeed asked for it."""
    json_file = LLAMA_FACTORY / "ds_z3_offload_config.json"
    torchrun = str(Path(ACCELERATE).with_name("torchrun"))
    setup = printed_setup(trained([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port())], json_file,
                                  tmp_path / "out"))
    assert (setup["world_size"], setup["strategy"], setup["strategy_from"]) == (2, "zero3", f"--deepspeed {json_file}")
    assert setup["offload"] == {"optimizer": "cpu", "parameters": "cpu"}, setup


@pytest.mark.launches
def test_accelerate_launch_with_a_multi_gpu_file_trains_transformers_zero2_json_as_the_flag_asks(tmp_path):
    """transformers' own ZeRO-2 JSON (optimizer offloaded, an AdamW and a WarmupLR block of "auto" values) under
    `accelerate launch` with the DDP file, which asks for no strategy beyond data parallelism: the flag decides, the
    two blocks give way to the recipe's in one line each, and the optimizer is DeepSpeed's CPU Adam."""
    json_file = TRANSFORMERS / "ds_config_zero2.json"
    printed = trained([ACCELERATE, "launch", "-q", "--config_file", DDP, "--num_processes", "2", "--main_process_port",
                       str(free_port())], json_file, tmp_path / "out")
    setup = printed_setup(printed)
    assert (setup["world_size"], setup["strategy"], setup["strategy_from"]) == (2, "zero2", f"--deepspeed {json_file}")
    assert (setup["optimizer"], setup["lr_schedule"], setup["offload"]) == (
        "DeepSpeedCPUAdam", "cosine", {"optimizer": "cpu"}), setup
    assert printed.count("gives way to the recipe's") == 2, printed


@pytest.mark.launches
def test_deepspeeds_own_launcher_starts_two_cpu_processes_that_train_as_the_flag_asks(tmp_path):
    """`deepspeed --num_gpus 2 scripts/sft.py ... --deepspeed ds.json`, DeepSpeed's accelerator set to the CPU: its
    launcher starts two processes, each given `--local_rank`, which the parse takes as transformers' own argument."""
    json_file = ROOT / "ds_configs" / "zero2.json"
    deepspeed = str(Path(ACCELERATE).with_name("deepspeed"))
    setup = printed_setup(trained(["env", "DS_ACCELERATOR=cpu", deepspeed, "--num_gpus", "2", "--master_port",
                                   str(free_port())], json_file, tmp_path / "out"))
    assert (setup["world_size"], setup["strategy"], setup["strategy_from"]) == (2, "zero2", f"--deepspeed {json_file}")


DEEPSPEED_EXAMPLES = CONFIGS / "deepspeedexamples"


def fixed_as_written(json_file: Path, refusal: str, tmp_path: Path) -> Path:
    """The JSON with each fix of the refusal applied as written, problem by problem ("(1) ...: FIX; (2) ..."): the keys
    a problem names (not the recipe's) set to "auto" or removed, a block renamed or removed, a value set."""
    values = json.loads(json_file.read_text())

    def node_of(key: str, create: bool = False):
        *parents, last = key.split(".")
        node = values
        for parent in parents:
            node = node.setdefault(parent, {}) if create else node[parent]
        return node, last

    for problem in re.split(r"; \(\d+\) ", refusal.split(": ", 1)[1]):
        keys = re.findall(r"(?<!recipe's )`([\w.]+): ", problem)
        if "to \"auto\"" in problem:
            for key in keys:
                node, last = node_of(key, create=True)
                node[last] = "auto"
        elif re.search(r"remove (it|them) \(DeepSpeed's default", problem):
            for key in keys:
                node, last = node_of(key)
                del node[last]
        elif "rename it to `bf16`" in problem:
            values["bf16"] = values.pop("bfloat16")
        elif "remove the zenflow block" in problem:
            del values["zero_optimization"]["zenflow"]
        for key, value in re.findall(r"set `([\w.]+)` to `(\w+)`", problem):
            node, last = node_of(key)
            node[last] = value
    return write(tmp_path / f"fixed_{json_file.name}", json.dumps(values))


# DeepSpeed JSONs of transformers' tests and DeepSpeed's examples that hard-code what the recipe decides or ask for
# what fails after loading: (JSON, words of the one sentence naming every problem at once)
REFUSED_EXAMPLES = [
    *[(TRANSFORMERS / name, ["`bfloat16` is DeepSpeed's old name of the `bf16` block", "rename it to `bf16`"])
      for name in ("ds_config_zero2_bf16.json", "ds_config_zero3_bf16.json")],
    (DEEPSPEED_EXAMPLES / "training" / "autotuning" / "hf" / "dsconfigs" / "ds_config_z1.json",
     ["`gradient_accumulation_steps: 1` (left out: accelerate sets it)", "set it to \"auto\""]),
    (DEEPSPEED_EXAMPLES / "inference" / "sglang" / "ds_offload_nvme_aio.json",
     ["3 problems, each with its fix", "`zero_optimization.offload_param.device: nvme` needs a folder for its swap "
      "files at `nvme_path` (/local_nvme/sglang is not a folder on this machine)",
      "set `zero_optimization.offload_param.device` to `cpu`",
      "`zero_optimization.stage3_max_live_parameters: \"auto\"`, `zero_optimization.offload_param.buffer_size: "
      "\"auto\"` are values that neither transformers nor accelerate fill from the run", "remove them",
      "`train_batch_size: 1` is not the recipe's"]),
    (DEEPSPEED_EXAMPLES / "training" / "bf16_master_weight" / "configs" / "bf16_full.json",
     ["`train_micro_batch_size_per_gpu: 4` contradicts", "`optimizer.params.lr: 0.0001` contradicts"]),
    (DEEPSPEED_EXAMPLES / "training" / "DeepSpeed-ZenFlow" / "finetuning" / "zf_config.json",
     ["`zero_optimization.zenflow` asks for DeepSpeed's ZenFlow", "remove the zenflow block",
      "`train_batch_size: 8` is not the recipe's"]),
    (DEEPSPEED_EXAMPLES / "training" / "imagenet" / "config" / "ds_fp16_z1_config.json",
     ["`gradient_clipping: 0` contradicts the recipe's `max_grad_norm: 1.0`", "`fp16.enabled: true`",
      "`optimizer.params.betas: [0.8, 0.999]` contradicts"]),
]


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("json_file, words", REFUSED_EXAMPLES,
                         ids=[str(case[0].relative_to(CONFIGS)) for case in REFUSED_EXAMPLES])
def test_an_example_json_is_refused_naming_every_problem_at_once_and_trains_with_its_fixes_applied(
        json_file, words, launcher, tmp_path, monkeypatch):
    found = checked_as_launched(launcher, json_file, tmp_path, monkeypatch)
    assert len(found) == 1 and found[0].startswith(f"{json_file}: "), found
    assert all(word in found[0] for word in words), found[0]
    fixed = fixed_as_written(json_file, found[0], tmp_path)
    assert checked_as_launched(launcher, fixed, tmp_path, monkeypatch) == []


COMMENTED = """{
  // ZeRO-2, the rest as the recipe says
  "zero_optimization": {"stage": 2, "overlap_comm": true,},
  /* transformers fills these */
  "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto",
}
"""


@pytest.mark.parametrize("given", ["flag", "recipe key", "in place"])
def test_a_json_with_comments_and_trailing_commas_trains_as_deepspeed_reads_it(given, tmp_path, monkeypatch):
    """DeepSpeed reads its config file with hjson (DeepSpeedExamples' annotated configs carry `//` comments);
    transformers and accelerate read JSON only, and the run hands them what it read: such a file trains."""
    from finetune.run import arguments

    json_file = write(tmp_path / "ds.json", COMMENTED)
    if given == "in place":
        asked = [*TINY, "--deepspeed", COMMENTED]
    else:
        asked, _, _ = asking_for_deepspeed(given, json_file, tmp_path)
    asked += ["--output_dir", str(tmp_path / "out")]
    assert checked_as_launched("torchrun", json_file, tmp_path, monkeypatch, arguments=asked) == []
    run = arguments.parse_args(asked)
    assert run.training.deepspeed["zero_optimization"] == {"stage": 2, "overlap_comm": True}
    assert run.launch.strategy == "zero2"


@pytest.mark.parametrize("content, words", [
    ('{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}',
     "`zero_optimization` is set twice in one object (DeepSpeed refuses that"),
    ('{"zero_optimization": {"stage": 2, "stage": 3}, "gradient_accumulation_steps": "auto"}',
     "`zero_optimization.stage` is set twice in one object (DeepSpeed refuses that"),
    ('{"zero_optimization": {"offload_param": {"device": "cpu", "device": "none"}, "stage": 3},}',
     "`zero_optimization.offload_param.device` is set twice in one object (DeepSpeed refuses that"),
    ('{"zero_optimization": {"stage": 2 "overlap_comm": true}}',
     "not valid JSON at line 1, column 35 (Expecting ',' delimiter)"),
], ids=["key set twice", "key set twice inside an object", "key set twice inside an object, read by hjson",
        "broken"])
def test_a_json_deepspeed_would_not_read_either_is_refused_naming_where(content, words, tmp_path, monkeypatch):
    found = checked_as_launched("torchrun", write(tmp_path / "ds.json", content), tmp_path, monkeypatch)
    assert len(found) == 1 and found[0].startswith(f"{tmp_path / 'ds.json'}: ") and words in found[0], found


def test_a_lone_value_where_deepspeed_reads_an_object_is_refused_with_the_object_to_write(tmp_path, monkeypatch):
    """`"bf16": "auto"` failed inside transformers' parse with an AttributeError: every such block at once."""
    lone = {"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}, "gradient_accumulation_steps": "auto",
            "bf16": "auto", "fp16": False}
    found = checked_as_launched("torchrun", write(tmp_path / "ds.json", json.dumps(lone)), tmp_path, monkeypatch)
    assert len(found) == 1 and "3 problems, each with its fix" in found[0], found
    written = re.findall(r"write it as `(\"[\w]+\": \{.*?\})`", found[0])
    assert written == ['"bf16": {"enabled": "auto"}', '"fp16": {"enabled": false}',
                       '"offload_optimizer": {"device": "cpu"}'], found[0]
    fixed = {**lone, "bf16": {"enabled": "auto"}, "fp16": {"enabled": False},
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert checked_as_launched("torchrun", write(tmp_path / "ds.json", json.dumps(fixed)), tmp_path, monkeypatch) == []


def test_nvme_offload_is_refused_until_its_folder_exists_on_this_machine(tmp_path, monkeypatch):
    """DeepSpeed creates a missing nvme_path wherever it points, or fails after loading; libaio aside (it may be
    installed), the folder is asked for before loading."""
    from finetune.checks import launch as accelerate_checks

    monkeypatch.setattr(accelerate_checks, "_async_io_loads", lambda: True)
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}},
            "gradient_accumulation_steps": "auto"}
    found = checked_as_launched("torchrun", write(tmp_path / "ds.json", json.dumps(nvme)), tmp_path, monkeypatch)
    assert len(found) == 1 and f"`nvme_path` ({tmp_path / 'nvme'} is not a folder on this machine)" in found[0], found
    assert "(or create that folder on a local NVMe drive)" in found[0]
    (tmp_path / "nvme").mkdir()
    assert checked_as_launched("torchrun", tmp_path / "ds.json", tmp_path, monkeypatch) == []


def test_a_path_relative_to_the_recipe_is_refused_naming_the_path_that_works(tmp_path, monkeypatch):
    """transformers reads `deepspeed` from the folder launched in; a path written relative to the recipe's folder is
    refused with the path to write instead."""
    json_file = write(tmp_path / "recipes" / "ds" / "z2.json", json.dumps(
        {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}))
    recipe = write(tmp_path / "recipes" / "recipe.yaml", with_keys(FULL, "deepspeed: ds/z2.json"))
    monkeypatch.chdir(tmp_path)
    arguments = ["--config", str(recipe), "--tiny", "--output_dir", str(tmp_path / "out")]
    found = checked_as_launched("torchrun", json_file, tmp_path, monkeypatch, arguments=arguments)
    assert len(found) == 1 and f"{recipe}: `deepspeed` ds/z2.json not found (from {tmp_path}" in found[0], found
    assert f"write it as {json_file}, the file of that name beside {recipe}" in found[0], found
    recipe.write_text(with_keys(FULL, f"deepspeed: {json_file}"))
    assert checked_as_launched("torchrun", json_file, tmp_path, monkeypatch, arguments=arguments) == []


def use_deepspeed_launch(monkeypatch, flags: list[str]) -> None:
    """This process as a training process of `accelerate launch --use_deepspeed FLAGS --num_processes 2 sft.py`."""
    launched_by(monkeypatch, ["--use_deepspeed", *flags])


def launched_by(monkeypatch, flags: list[str]) -> None:
    """This process as a training process of `accelerate launch FLAGS --num_processes 2 sft.py`."""
    from finetune.config import launch_request

    arguments = [*flags, "--num_processes", "2", SCRIPT]
    environment, _ = training_process_environment(arguments)
    for name, value in {**environment, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launch_request, "accelerate_launch_arguments", lambda: arguments)


def test_accelerate_launch_use_deepspeed_trains_the_flags_json_or_refuses_a_stage_that_contradicts_it(tmp_path,
                                                                                                    monkeypatch):
    """`accelerate launch --use_deepspeed` asks for DeepSpeed without a JSON (ZeRO-2 unless --zero_stage says, as
    accelerate's plugin defaults): alone it trains ZeRO-2 (it stopped after loading on "asked for zeroNone"); with
    --deepspeed the JSON decides, as transformers lets it, unless --zero_stage asks for another stage."""
    from finetune.run import arguments

    json_file = LLAMA_FACTORY / "ds_z3_config.json"
    use_deepspeed_launch(monkeypatch, [])
    assert arguments.parse_args([*TINY, "--output_dir", str(tmp_path / "out")]).launch.strategy == "zero2"
    run = arguments.parse_args([*TINY, "--deepspeed", str(json_file), "--output_dir", str(tmp_path / "out")])
    assert (run.launch.strategy, run.launch.asked_by) == ("zero3", f"--deepspeed {json_file}")
    use_deepspeed_launch(monkeypatch, ["--zero_stage", "3"])
    assert problems_before_loading([*TINY, "--deepspeed", str(json_file), "--output_dir", str(tmp_path / "out")],
                                   2) == []
    use_deepspeed_launch(monkeypatch, ["--zero_stage", "2"])
    found = [str(problem) for problem in problems_before_loading(
        [*TINY, "--deepspeed", str(json_file), "--output_dir", str(tmp_path / "out")], 2)]
    assert found == [f"the accelerate launch command line: `--zero_stage 2` asks for ZeRO-2 while --deepspeed "
                     f"{json_file} asks for ZeRO-3, and one launch trains with one of them; remove --zero_stage 2 "
                     f"from the accelerate launch command to train with --deepspeed {json_file}."], found


ZERO2_YAML = str(ROOT / "accelerate_configs" / "zero2.yaml")
ZERO3_JSON = str(ROOT / "ds_configs" / "zero3.json")
LLAMA_FACTORY_ZERO3 = str(LLAMA_FACTORY / "ds_z3_config.json")
# A DeepSpeed flag of accelerate's launcher beside a JSON that sets the same key otherwise, which accelerate ignores
# without a word (it fills only "auto" values from the flags): (name, launcher flags, the flag, --deepspeed or None,
# the JSON as the refusal names it, what the JSON asks for in its words)
FLAGS_BESIDE_A_JSON = [
    ("accelerate config's JSON", ["--config_file", ZERO2_YAML, "--offload_optimizer_device", "cpu"],
     ["--offload_optimizer_device", "cpu"], None, "ds_configs/zero2.json",
     "sets no `zero_optimization.offload_optimizer.device`"),
    ("--deepspeed_config_file", ["--use_deepspeed", "--deepspeed_config_file", ZERO3_JSON, "--zero3_save_16bit_model",
                                 "false"], ["--zero3_save_16bit_model", "false"], None, ZERO3_JSON,
     "asks for `zero_optimization.stage3_gather_16bit_weights_on_model_save: true`"),
    ("--deepspeed", ["--use_deepspeed", "--zero_stage", "3", "--offload_param_device", "cpu"],
     ["--offload_param_device", "cpu"], LLAMA_FACTORY_ZERO3, f"--deepspeed {LLAMA_FACTORY_ZERO3}",
     "sets no `zero_optimization.offload_param.device`"),
]


@pytest.mark.parametrize("name, flags, flag, deepspeed, named, theirs", FLAGS_BESIDE_A_JSON,
                         ids=[case[0] for case in FLAGS_BESIDE_A_JSON])
def test_a_launcher_deepspeed_flag_the_json_would_override_is_refused_naming_both(name, flags, flag, deepspeed, named,
                                                                                 theirs, tmp_path, monkeypatch):
    """`accelerate launch --config_file accelerate_configs/zero2.yaml --offload_optimizer_device cpu` trained ZeRO-2
    without offload: accelerate takes the JSON's settings and a flag only where the JSON says "auto". Refused before
    loading, naming the flag, its key and the JSON; removing the flag, as the refusal says, trains."""
    arguments = [*TINY, *(["--deepspeed", deepspeed] if deepspeed else []), "--output_dir", str(tmp_path / "out")]
    launched_by(monkeypatch, flags)
    found = [str(problem) for problem in problems_before_loading(arguments, 2)]
    key = {"--offload_optimizer_device": "zero_optimization.offload_optimizer.device",
           "--zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
           "--offload_param_device": "zero_optimization.offload_param.device"}[flag[0]]
    assert len(found) == 1 and f"`{' '.join(flag)}` asks for `{key}: {flag[1]}` while {named} {theirs}" in found[0], \
        found
    assert found[0].endswith(f"; remove {' '.join(flag)} from the accelerate launch command to train with {named}.")
    launched_by(monkeypatch, [arg for arg in flags if arg not in flag])
    assert problems_before_loading(arguments, 2) == []


def test_a_launcher_deepspeed_flag_fills_the_jsons_auto_value(tmp_path, monkeypatch):
    """Where the JSON says "auto", accelerate fills the value from the launcher's flag: it trains as the flag says."""
    from finetune.run import arguments

    json_file = write(tmp_path / "ds.json", json.dumps({
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "auto"}},
        "gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}))
    launched_by(monkeypatch, ["--use_deepspeed", "--deepspeed_config_file", str(json_file),
                              "--offload_optimizer_device", "cpu"])
    asked = [*TINY, "--output_dir", str(tmp_path / "out")]
    assert problems_before_loading(asked, 2) == []
    zero = arguments.parse_args(asked).training.deepspeed_plugin.deepspeed_config["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu", zero


# ZeRO-3 launches whose final save gathers no model, by each way of leaving DeepSpeed's 16-bit gather off: (name,
# the DeepSpeed JSON's zero_optimization entries for it or None for a launch without a JSON, the accelerate launch's
# flags after --num_processes 2, or an accelerate config file's deepspeed_config fields)
GATHER_OFF = [
    ("JSON leaving it out", {}, []),
    ("JSON false", {"stage3_gather_16bit_weights_on_model_save": False}, []),
    ("JSON \"auto\" without the launcher's flag", {"stage3_gather_16bit_weights_on_model_save": "auto"}, []),
    ("JSON's old fp16 name", {"stage3_gather_fp16_weights_on_model_save": False}, []),
    ("JSON's field name of DeepSpeed's config model", {"gather_16bit_weights_on_model_save": False}, []),
    ("--use_deepspeed --zero_stage 3", None, ["--use_deepspeed", "--zero_stage", "3"]),
    ("accelerate config's deepspeed_config", None, {"zero_stage": 3, "zero3_init_flag": True}),
]
SAVED_PARTITIONED = "ZeRO-3 then saves the final model as DeepSpeed's partitioned checkpoint"


@pytest.mark.parametrize("name, entries, launch", GATHER_OFF, ids=[case[0] for case in GATHER_OFF])
def test_a_full_zero3_run_that_will_save_deepspeed_shards_says_so_before_loading_and_its_fix_gathers_the_model(
        name, entries, launch, tmp_path, monkeypatch, capfd):
    """transformers saves DeepSpeed's partitioned checkpoint (global_stepN/) in place of model.safetensors when
    ZeRO-3's 16-bit gather is off, and the run said `saved to`: said before loading, naming the key as it is written;
    the fix applied as written (that key set to true: DeepSpeed refuses the old name beside the new one, and "auto"
    follows the launcher) makes DeepSpeed gather, and nothing is said. A LoRA run's adapter is gathered either way."""
    from finetune.checks.launch import saves_partitioned_model
    from finetune.run import arguments

    zero3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    del zero3["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    key = next(iter(entries or {}), "stage3_gather_16bit_weights_on_model_save")

    def launch_with(fixed: bool) -> None:
        """This process as a training process of the case's launch, or of that launch fixed as the notice says."""
        if entries is not None:
            zero = {**zero3["zero_optimization"], **entries, **({key: True} if fixed else {})}
            json_file = write(tmp_path / "ds.json", json.dumps({**zero3, "zero_optimization": zero}))
            launched_by(monkeypatch, ["--use_deepspeed", "--deepspeed_config_file", str(json_file)])
        elif isinstance(launch, dict):  # an accelerate config file asking for DeepSpeed without a JSON
            fields = {**launch, **({"zero3_save_16bit_model": True} if fixed else {})}
            launched_by(monkeypatch, ["--config_file", str(write(tmp_path / "zero3.yaml", json.dumps(
                {"distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": fields})))])
        else:
            launched_by(monkeypatch, [*launch, *(["--zero3_save_16bit_model", "true"] if fixed else [])])

    def notices(asked: list[str]) -> list[str]:
        capfd.readouterr()
        assert problems_before_loading(asked, 2) == []
        return [line for line in capfd.readouterr().out.splitlines() if SAVED_PARTITIONED in line]

    full = [*TINY, "--output_dir", str(tmp_path / "out")]
    launch_with(fixed=False)
    said = notices(full)
    assert len(said) == 1, said
    if entries is not None:
        assert said[0].startswith(f"[finetune] {tmp_path / 'ds.json'} sets ") and \
            f'set "{key}": true under zero_optimization there to save the model itself.' in said[0], said
    elif isinstance(launch, dict):
        assert "sets no `zero3_save_16bit_model`" in said[0] and \
            "set `zero3_save_16bit_model: true` under deepspeed_config there" in said[0], said
    else:
        assert "passes no `--zero3_save_16bit_model`" in said[0] and \
            "pass --zero3_save_16bit_model true to the accelerate launch command" in said[0], said
    assert notices(["--config", str(LORA), "--tiny", "--output_dir", str(tmp_path / "out")]) == []
    launch_with(fixed=True)
    assert notices(full) == []
    assert not saves_partitioned_model(arguments.parse_args(full))


# A DeepSpeed launch without a JSON whose offload DeepSpeed would ignore or fail on after loading: (name, launcher
# flags after --use_deepspeed, words of the refusal, the flags with its fix applied as written)
OFFLOAD_REFUSED = [
    ("parameters below ZeRO-3", ["--offload_param_device", "cpu"],
     "`--offload_param_device cpu` offloads the parameters only from ZeRO-3 on, and this launch trains ZeRO-2 "
     "(accelerate's default), where DeepSpeed would ignore it; add --zero_stage 3 to the accelerate launch command",
     ["--offload_param_device", "cpu", "--zero_stage", "3"]),
    ("optimizer under ZeRO-0", ["--zero_stage", "0", "--offload_optimizer_device", "cpu"],
     "`--offload_optimizer_device cpu` offloads the optimizer states only from ZeRO-1 on, and this launch trains "
     "ZeRO-0 (`--zero_stage 0`), where DeepSpeed would ignore it; add --zero_stage 2 to the accelerate launch command",
     ["--zero_stage", "0", "--offload_optimizer_device", "cpu", "--zero_stage", "2"]),
    ("no such device", ["--offload_optimizer_device", "cpus"],
     "`--offload_optimizer_device cpus` is not a device DeepSpeed offloads to (it fails on it once the model is "
     "loaded); set `--offload_optimizer_device` to cpu, nvme or none.", ["--offload_optimizer_device", "cpu"]),
]


@pytest.mark.parametrize("name, flags, words, fixed", OFFLOAD_REFUSED, ids=[case[0] for case in OFFLOAD_REFUSED])
def test_an_offload_flag_deepspeed_would_ignore_or_fail_on_is_refused_before_loading(name, flags, words, fixed,
                                                                                      tmp_path, monkeypatch):
    """The setup line read `"offload": {"parameters": "cpu"}` from the config of a ZeRO-2 run that offloaded nothing."""
    arguments = [*TINY, "--output_dir", str(tmp_path / "out")]
    use_deepspeed_launch(monkeypatch, flags)
    found = [str(problem) for problem in problems_before_loading(arguments, 2)]
    assert len(found) == 1 and found[0].startswith(f"the accelerate launch command line: {words}"), found
    use_deepspeed_launch(monkeypatch, fixed)
    assert problems_before_loading(arguments, 2) == []


def test_an_accelerate_config_deepspeed_block_is_refused_by_check_as_by_the_launch(tmp_path, monkeypatch, capfd):
    """The same fields in a config file's deepspeed_config block (no deepspeed_config_file): `finetune check` and the
    training process give the same one sentence."""
    from tests.test_check import check_finds, launch_refuses

    config_file = write(tmp_path / "zero2_offload.yaml", "compute_environment: LOCAL_MACHINE\ndistributed_type: "
                        "DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\nnum_machines: 1"
                        "\nnum_processes: 2\n")
    arguments = [*TINY, "--output_dir", str(tmp_path / "out")]
    checked = check_finds(capfd, ["--config_file", str(config_file), *arguments])
    assert checked == [f"error: {config_file}: `offload_param_device: cpu` offloads the parameters only from ZeRO-3 "
                       f"on, and this launch trains ZeRO-2 (`zero_stage: 2`), where DeepSpeed would ignore it; add "
                       f"--zero_stage 3 to the accelerate launch command or remove `offload_param_device: cpu`."]
    launched_by(monkeypatch, ["--config_file", str(config_file)])
    assert launch_refuses(arguments, capfd, monkeypatch) == checked[0]


def test_nvme_offload_flags_reach_deepspeed_or_are_refused_before_loading(tmp_path, monkeypatch):
    """accelerate's launcher exports every DeepSpeed flag but the NVMe folders, so DeepSpeed swapped to a folder
    named `none`: the folder reaches DeepSpeed's config, and a folder missing here is refused before loading (libaio
    aside: DeepSpeed's async_io op, which may be installed)."""
    from finetune.checks import launch as accelerate_checks
    from finetune.run import arguments

    monkeypatch.setattr(accelerate_checks, "_async_io_loads", lambda: True)
    nvme = tmp_path / "nvme"
    use_deepspeed_launch(monkeypatch, ["--zero_stage", "3", "--offload_param_device", "nvme",
                                       "--offload_param_nvme_path", str(nvme)])
    asked = [*TINY, "--output_dir", str(tmp_path / "out")]
    found = [str(problem) for problem in problems_before_loading(asked, 2)]
    assert found == [f"the accelerate launch command line: `--offload_param_device nvme` needs a folder for its swap "
                     f"files at `--offload_param_nvme_path` ({nvme} is not a folder on this machine); set "
                     f"`--offload_param_device` to `cpu` (or create that folder on a local NVMe drive)."], found
    nvme.mkdir()
    assert problems_before_loading(asked, 2) == []
    zero = arguments.parse_args(asked).training.deepspeed_plugin.deepspeed_config["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": str(nvme)}, zero


@pytest.mark.parametrize("flag, whole", [([], False), (["--zero3_init_flag", "true"], False),
                                         (["--zero3_init_flag", "false"], True)], ids=["default", "true", "false"])
def test_zero3_init_flag_false_loads_the_model_whole(flag, whole, tmp_path, monkeypatch):
    """accelerate marks every ZeRO-3 launch for transformers, which then loaded under deepspeed.zero.Init whatever
    `--zero3_init_flag` said: `false` now loads the whole model in each process, as accelerate documents it."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from finetune.run import arguments, model

    class Loaded(Exception):
        pass

    def from_pretrained(*_, **__):
        raise Loaded(is_deepspeed_zero3_enabled())

    use_deepspeed_launch(monkeypatch, ["--zero_stage", "3", *flag])
    run = arguments.parse_args([*TINY, "--output_dir", str(tmp_path / "out")])
    monkeypatch.setattr(model.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(Loaded) as loaded:
        model.load_model(run, "tiny")
    assert loaded.value.args == (not whole,)


@pytest.mark.launches
def test_accelerate_launch_use_deepspeed_flags_reach_the_engine_and_a_save_without_the_gather_is_fixed_as_it_says(
        tmp_path, monkeypatch):
    """`accelerate launch --use_deepspeed` without a JSON, every DeepSpeed flag of its launcher given: ZeRO-3 with the
    parameters and optimizer states in CPU memory (DeepSpeed's CPU Adam), the model loaded whole in each process
    (transformers says when it loads under zero.Init). Without --zero3_save_16bit_model true transformers saves
    DeepSpeed's partitioned checkpoint and the run said `saved to`: said before loading and in the closing line, no
    final marker, and `finetune chat` refuses the folder and its checkpoint in one sentence. Relaunched with the flag
    as both lines say, it writes the gathered 16-bit model from checkpoint-2 without training, which chat loads."""
    from finetune.checks import model_folder
    from finetune.run import generation

    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    output_dir = tmp_path / "out"
    launcher = [ACCELERATE, "launch", "-q", "--use_deepspeed", "--num_processes", "2", "--main_process_port",
                str(free_port()), "--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device",
                "cpu", "--zero3_init_flag", "false", "--gradient_accumulation_steps", "2", "--gradient_clipping", "1.0"]
    arguments = [*TINY, "--max_steps", "2", "--eval_strategy", "no", "--report_to", "none",
                 "--eval_samples_before_after", "0", "--output_dir", str(output_dir)]
    result = launch_sft(*arguments, launcher=launcher)
    assert result.returncode == 0, result.stderr[-3000:]
    setup = printed_setup(result.stdout)
    assert (setup["world_size"], setup["strategy"], setup["optimizer"], setup["offload"]) == (
        2, "zero3", "DeepSpeedCPUAdam", {"optimizer": "cpu", "parameters": "cpu"}), setup
    assert "activating zero.init()" not in result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if line.startswith("[finetune] ")]
    fix = "pass --zero3_save_16bit_model true to the accelerate launch command"
    notice = next(index for index, line in enumerate(said) if SAVED_PARTITIONED in line)
    assert notice < next(index for index, line in enumerate(said) if "setup:" in line) and fix in said[notice]
    assert f"[finetune] saved DeepSpeed's partitioned ZeRO-3 checkpoint {output_dir / 'global_step2'}, not a model " \
           f"(the accelerate launch command line passes no `--zero3_save_16bit_model`), and chat, generate, eval and " \
           f"merge cannot load it; {fix} and relaunch: it writes model.safetensors from checkpoint-2 without " \
           f"training." in said, said
    assert not any(line.startswith("[finetune] saved to") for line in said), said
    assert not (output_dir / "model.safetensors").exists() and not (output_dir / "finetune_final.json").exists()
    for folder in (output_dir, output_dir / "checkpoint-2"):
        with pytest.raises(UserError, match=r"holds DeepSpeed's partitioned ZeRO-3 checkpoint \(global_step2\)"):
            generation.load_trained(str(folder))
    relaunched = launch_sft(*arguments, launcher=[*launcher, *fix.split()[1:3]])
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]
    assert "nothing left to train; writing the final model from it" in relaunched.stdout, relaunched.stdout
    assert f"[finetune] saved to {output_dir}" in relaunched.stdout.splitlines()
    generation.load_trained(str(output_dir))
    assert model_folder.partitioned_checkpoint(output_dir) is None and (output_dir / "model.safetensors").is_file()


def test_an_auto_value_nothing_fills_is_refused_unless_its_block_gives_way_to_the_recipe(tmp_path, monkeypatch):
    """accelerate raises after loading on an "auto" that neither transformers nor accelerate fill; an AdamW or a
    scheduler block is left out of the run (it gives way), its "auto" values with it."""
    giving_way = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto",
                  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": "auto"}},
                  "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "auto"}}}
    assert checked_as_launched("torchrun", write(tmp_path / "ds.json", json.dumps(giving_way)), tmp_path,
                               monkeypatch) == []
    unfilled = {**giving_way, "zero_optimization": {"stage": 2, "sub_group_size": "auto"}}
    found = checked_as_launched("torchrun", write(tmp_path / "ds.json", json.dumps(unfilled)), tmp_path, monkeypatch)
    assert found == [f"{tmp_path / 'ds.json'}: `zero_optimization.sub_group_size: \"auto\"` is a value that neither "
                     f"transformers nor accelerate fill from the run (accelerate stops on an \"auto\" it cannot fill, "
                     f"after loading); remove it (DeepSpeed's default then holds) or write a number."], found


def test_bf16_in_the_json_against_bf16_false_on_the_command_line_names_the_flags_value(tmp_path, monkeypatch):
    """On a machine without a GPU the recipe's precision as written is compared, unless the command line set it."""
    json_file = write(tmp_path / "ds.json", json.dumps({"zero_optimization": {"stage": 1},
                                                         "gradient_accumulation_steps": "auto", "bf16": {"enabled": True}}))
    found = checked_as_launched("torchrun", json_file, tmp_path, monkeypatch, arguments=[
        *TINY, "--bf16", "false", "--deepspeed", str(json_file), "--output_dir", str(tmp_path / "out")])
    assert found == [f"{json_file}: `bf16.enabled: true` contradicts the recipe's `bf16: false`; set it to \"auto\" so "
                     f"that the recipe decides."], found


@pytest.mark.parametrize("given", ["flag", "recipe key"])
def test_finetune_launch_on_gpus_lets_the_deepspeed_json_decide_instead_of_planning_a_strategy(given, tmp_path,
                                                                                               monkeypatch, capsys):
    """`finetune launch` without a config file plans one for the GPUs it sees (zero3.yaml for a full recipe, whose own
    JSON the training process then refused beside --deepspeed, naming a --config_file the user never gave); asked for
    a DeepSpeed JSON it launches accelerate_configs/ddp.yaml, which lets the JSON decide (the check above)."""
    import torch

    from finetune.commands import launch as launcher

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: pytest.fail("planned for the GPUs"))
    arguments, _, _ = asking_for_deepspeed(given, LLAMA_FACTORY / "ds_z3_config.json", tmp_path)
    assert launcher.planned_config(arguments, 1) == (str(ROOT / "accelerate_configs" / "ddp.yaml"), 2)
    asked = "--deepspeed" if given == "flag" else f"`deepspeed` in {arguments[1]}"
    assert f"launch: {asked} decides the strategy: accelerate_configs/ddp.yaml on 2 GPU(s)" in capsys.readouterr().out


def test_a_number_written_as_text_is_refused_as_text_before_transformers_finds_it_unequal(tmp_path, monkeypatch):
    """transformers compares `"gradient_accumulation_steps": "2"` with the recipe's 2 as a mismatch and stops once the
    model is loaded ("ds gradient_accumulation_steps=2 vs hf gradient_accumulation_steps=2")."""
    text = {"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "2", "train_micro_batch_size_per_gpu": 8}
    json_file = write(tmp_path / "ds.json", json.dumps(text))
    found = checked_as_launched("torchrun", json_file, tmp_path, monkeypatch)
    assert found == [f"{json_file}: `gradient_accumulation_steps: \"2\"` is text, which transformers compares as "
                     f"unequal to the recipe's `gradient_accumulation_steps: 2`; set it to \"auto\" so that the recipe "
                     f"decides."], found
    assert checked_as_launched("torchrun", fixed_literally(json_file, found[0], tmp_path), tmp_path, monkeypatch) == []
