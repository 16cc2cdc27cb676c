"""One gate for every way in (issue 37, item 1): whatever starts the run and however the DeepSpeed JSON arrives (an
accelerate config under any of accelerate's three launchers, transformers' own `--deepspeed` flag, a recipe's
`deepspeed:` key as a path or as the JSON itself, `finetune.train(deepspeed=...)`), the same check refuses the same
contradiction in the same words, before loading; transformers' own strategy arguments are refused for the accelerate
config."""

import json
import re
import sys
from pathlib import Path

import pytest

from finetune.config.launch_request import arguments_after_accelerate_launch
from tests.helpers import ACCELERATE, ROOT, free_port, run_sft_in_process, write
from tests.test_bad_inputs import FINETUNE, FULL, TINY, accelerate_config, check_bad_input, check_refusal, recipe_with

# batch 4 against the recipe's 8, accumulation left out (1) against its 2
CONTRADICTING = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}
WORDS = ["`train_micro_batch_size_per_gpu: 4` contradicts the recipe's `per_device_train_batch_size: 8`",
         "`gradient_accumulation_steps: 1` (left out: accelerate sets it) contradicts the recipe's "
         "`gradient_accumulation_steps: 2`", "set them to \"auto\""]


@pytest.mark.parametrize("command", [
    [ACCELERATE, "launch", "--config_file", "a.yaml", "sft.py"],
    [sys.executable, str(Path(ACCELERATE).with_name("accelerate-launch")), "--config_file", "a.yaml", "sft.py"],
    [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "a.yaml", "sft.py"],
], ids=["accelerate launch", "accelerate-launch", "python -m accelerate.commands.launch"])
def test_every_accelerate_launcher_is_recognised(command):
    assert arguments_after_accelerate_launch(command) == ["--config_file", "a.yaml", "sft.py"]


def test_other_launchers_are_not_accelerates():
    assert arguments_after_accelerate_launch([sys.executable, "sft.py", "--config", "launch"]) is None
    assert arguments_after_accelerate_launch(["torchrun", "--nproc_per_node", "2", "sft.py"]) is None


def the_refusal(stderr: str) -> str:
    """The sentence after the file it names."""
    return re.findall(r"error: [^\r\n]*", stderr)[0].split(": ", 2)[2]


def test_transformers_deepspeed_argument_is_checked_as_the_accelerate_config_is(tmp_path, capfd, monkeypatch):
    ds = write(tmp_path / "ds.json", json.dumps(CONTRADICTING))
    key = recipe_with(tmp_path, FULL, f"deepspeed: {ds}")
    mapping = write(tmp_path / "mapping.yaml", FULL.read_text() + "deepspeed:\n  zero_optimization: {stage: 2}\n"
                                                                  "  train_micro_batch_size_per_gpu: 4\n")
    refusals = []
    for arguments in ([*TINY, "--deepspeed", str(ds)], ["--config", str(key), "--tiny"],
                      ["--config", str(mapping), "--tiny"]):
        result = run_sft_in_process([*arguments, "--output_dir", str(tmp_path / "out")], capfd, monkeypatch)
        check_refusal(result, WORDS, by_accelerate=False)
        refusals.append(the_refusal(result.stderr))
    with monkeypatch.context() as launched:  # as a training process of an accelerate DeepSpeed launch sees it
        launched.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        launched.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
        result = run_sft_in_process([*TINY, "--output_dir", str(tmp_path / "out")], capfd, monkeypatch)
    check_refusal(result, WORDS, by_accelerate=False)
    refusals.append(the_refusal(result.stderr))
    # finetune.train(...), a notebook's way in: the same sentence, raised
    import finetune
    from finetune.errors import UserError

    with pytest.raises(UserError) as raised:
        finetune.train(FULL, tiny=True, deepspeed=str(ds), output_dir=str(tmp_path / "out"))
    refusals.append(str(raised.value).split(": ", 1)[1])
    assert len(set(refusals)) == 1, refusals
    assert not (tmp_path / "out").exists()


def console_script(t: Path) -> list[str]:
    return [str(Path(ACCELERATE).with_name("accelerate-launch")), "-q", "--config_file",
            str(accelerate_config(t, CONTRADICTING)), "--main_process_port", str(free_port())]


def python_module(t: Path) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "-q", "--config_file",
            str(accelerate_config(t, CONTRADICTING)), "--main_process_port", str(free_port())]


@pytest.mark.launches
@pytest.mark.parametrize("launcher", [console_script, python_module], ids=["accelerate-launch", "python -m"])
def test_the_other_accelerate_launchers_get_the_same_refusal(launcher, tmp_path, capfd, monkeypatch):
    """`accelerate-launch` was not recognised as a launcher, so every launch-file check was skipped without a word
    (the plain `accelerate launch` case is tests/test_bad_inputs.py's)."""
    check_bad_input(("", lambda t: TINY, ["ds.json", *WORDS], launcher), tmp_path, capfd, monkeypatch)


@pytest.mark.parametrize("deepspeed, words", [
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     ["`zero_optimization.overlap_com` extra inputs are not permitted", "fix its spelling"]),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, ["`zero_optimization.reduce_bucket_size`"]),
    ({"zero_optimization": {"stage": 2}, "bfloat16": {"enabled": "auto"}}, ["`bfloat16`", "rename it to `bf16`"]),
], ids=["misspelled zero key", "zero value of the wrong type", "old bfloat16 block"])
def test_deepspeed_json_is_read_by_deepspeeds_config_model_whichever_way_it_arrives(deepspeed, words, tmp_path, capfd,
                                                                                   monkeypatch):
    ds = write(tmp_path / "ds.json", json.dumps(deepspeed))
    result = run_sft_in_process([*TINY, "--deepspeed", str(ds), "--output_dir", str(tmp_path / "out")], capfd,
                                monkeypatch)
    check_refusal(result, ["ds.json", *words], by_accelerate=False)


def test_nvme_offload_is_refused_where_the_async_io_op_cannot_load(tmp_path, capfd, monkeypatch):
    from finetune.checks import launch

    monkeypatch.setattr(launch, "_async_io_loads", lambda: False)
    ds = write(tmp_path / "ds.json", json.dumps({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}))
    result = run_sft_in_process([*TINY, "--deepspeed", str(ds), "--output_dir", str(tmp_path / "out")], capfd,
                                monkeypatch)
    check_refusal(result, ["ds.json", "`zero_optimization.offload_param.device: nvme`", "async_io"],
                  by_accelerate=False)


# transformers' own ways to ask for a strategy or a process group, as a flag or a recipe key
TRANSFORMERS_STRATEGY = [("fsdp", "full_shard auto_wrap", ["`fsdp` asks transformers for FSDP version 1",
                                                           "accelerate_configs/fsdp.yaml"]),
                         ("fsdp_config", '{"fsdp_version": 2}', ["`fsdp_config` configures transformers' own FSDP",
                                                                 "accelerate_configs/fsdp.yaml"]),
                         ("ddp_backend", "gloo", ["`ddp_backend` sets the process group's backend", "remove it"])]


@pytest.mark.parametrize("given", ["flag", "recipe key"])
@pytest.mark.parametrize("name, value, words", TRANSFORMERS_STRATEGY, ids=[case[0] for case in TRANSFORMERS_STRATEGY])
def test_transformers_strategy_arguments_are_refused_for_the_accelerate_config(name, value, words, given, tmp_path,
                                                                                capfd, monkeypatch):
    if given == "flag":
        case = (name, lambda t: [*TINY, f"--{name}", value], ["command line", *words])
    else:
        recipe = recipe_with(tmp_path, FULL, f"{name}: '{value}'")
        case = (name, lambda t: ["--config", str(recipe), "--tiny"], [str(recipe), *words])
    check_bad_input(case, tmp_path, capfd, monkeypatch)


@pytest.mark.launches
@pytest.mark.parametrize("launcher", ["finetune launch", "torchrun"])
def test_finetune_launch_and_torchrun_meet_the_same_refusal_as_the_flag(launcher, tmp_path, capfd, monkeypatch):
    """The two launchers that start real processes here: `finetune launch` hands the accelerate config to accelerate
    unchanged, `torchrun` starts scripts/sft.py with transformers' --deepspeed flag; the training process refuses the
    contradiction in the sentence the flag gets in this process."""
    import subprocess

    ds = write(tmp_path / "ds.json", json.dumps(CONTRADICTING))
    flag = run_sft_in_process([*TINY, "--deepspeed", str(ds), "--output_dir", str(tmp_path / "flag")], capfd,
                              monkeypatch)
    output_dir = str(tmp_path / "out")
    if launcher == "finetune launch":
        command = [FINETUNE, "launch", "--config_file", str(accelerate_config(tmp_path, CONTRADICTING)),
                   "--main_process_port", str(free_port()), *TINY, "--output_dir", output_dir]
    else:
        command = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "1", "--master_port",
                   str(free_port()), str(ROOT / "scripts" / "sft.py"), *TINY, "--deepspeed", str(ds),
                   "--output_dir", output_dir]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    check_refusal(result, WORDS, by_accelerate=True)
    assert the_refusal(result.stderr) == the_refusal(flag.stderr)
    assert not Path(output_dir).exists()
