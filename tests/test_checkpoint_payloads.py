"""No checkpoint file can run code: a pickle payload (whose unpickling would create a marker file) planted in each
kind of file a resume reads, with the checkpoint's completeness marker rewritten so that it looks complete, is refused
in one sentence naming the file and the checkpoint to resume from instead, and the marker is never created. Every
read goes through torch's weights-only unpickler with a fixed list of classes (finetune/checks/resume.py
`read_safely`, finetune/patches.py `weights_only_loads`). The Trainer's own files are resumed here in this process;
DeepSpeed's ZeRO files and torch DCP's `.metadata` are read through those libraries' own readers here, and
tests/test_distributed.py resumes a real ZeRO-2 checkpoint holding a payload."""

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest

from finetune import run_folder as folder_files
from finetune.checks import resume
from finetune.errors import UserError
from tests.helpers import ROOT

LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"


class Payload:
    """Unpickled, it creates `marker`: what a pickle planted in a checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def looks_complete(path: Path) -> None:
    """The completeness marker of the checkpoint holding `path` rewritten to its files' sizes now."""
    checkpoint = next(folder for folder in path.parents if folder_files.step_of(folder) is not None)
    marker_file = json.loads((checkpoint / folder_files.MARKER).read_text())
    folder_files.write_marker(checkpoint, marker_file["step"], marker_file["world_size"])


def plant(path: Path, marker: Path) -> Path:
    """A payload in place of a checkpoint file, pickled as its writer pickles it (torch.save, or plain pickle for
    DCP's .metadata); the checkpoint's completeness marker rewritten to its sizes, so that it looks complete, as a
    checkpoint copied from elsewhere would. The payload is live: plain unpickling runs it."""
    import torch

    if path.name == ".metadata":
        path.write_bytes(pickle.dumps(Payload(marker), protocol=4))
    else:
        torch.save({"state": Payload(marker)}, path)
    looks_complete(path)
    live = marker.with_name(marker.name + "-live")
    pickle.loads(pickle.dumps(Payload(live)))
    assert live.exists()
    return path


def assert_refused_without_running(refused: UserError, path: Path, marker: Path, fall_back: str) -> None:
    sentence = str(refused)
    assert not marker.exists(), f"the payload planted in {path} ran"
    assert sentence.startswith(f"{path}: it would build "), sentence
    assert f"{fall_back} instead" in sentence and "\n" not in sentence and "weights_only" not in sentence, sentence


LORA_ARGS = {"tiny": True, "save_steps": 1, "logging_steps": 1, "eval_strategy": "no", "report_to": "none",
             "eval_samples_before_after": 0}


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory) -> Path:
    """A LoRA run of two steps in this process, a checkpoint at each."""
    import finetune

    output_dir = tmp_path_factory.mktemp("checkpointed") / "out"
    finetune.train(config=LORA, max_steps=2, output_dir=str(output_dir), **LORA_ARGS)
    return output_dir


@pytest.mark.parametrize("name", ["rng_state.pth", "optimizer.pt", "scheduler.pt", "training_args.bin"])
def test_a_payload_in_a_trainer_file_is_refused_in_one_line_on_resume_and_never_runs(name, checkpointed_run, tmp_path):
    """Resumed in this process: the Trainer's own reads (rng state, optimizer, scheduler) and the relaunch check's
    (training_args.bin)."""
    import finetune

    output_dir = shutil.copytree(checkpointed_run, tmp_path / "out")
    marker = tmp_path / "payload-ran"
    planted = plant(output_dir / "checkpoint-2" / name, marker)
    with pytest.raises(UserError) as refused:
        finetune.train(config=LORA, max_steps=3, output_dir=str(output_dir), **LORA_ARGS)
    assert_refused_without_running(refused.value, planted, marker, str(output_dir / "checkpoint-1"))


def test_a_trainer_file_that_cannot_be_read_is_one_line_naming_it_and_the_checkpoint_before(checkpointed_run,
                                                                                          tmp_path):
    """optimizer.pt cut short with the marker rewritten (a checkpoint copied or damaged after its save): torch's
    `PytorchStreamReader failed` in one line, not a traceback."""
    import finetune

    output_dir = shutil.copytree(checkpointed_run, tmp_path / "out")
    optimizer = output_dir / "checkpoint-2" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    looks_complete(optimizer)
    with pytest.raises(UserError) as refused:
        finetune.train(config=LORA, max_steps=3, output_dir=str(output_dir), **LORA_ARGS)
    sentence = str(refused.value)
    assert sentence.startswith(f"{optimizer}: it cannot be read, cut short or damaged (PytorchStreamReader"), sentence
    assert f"resume from {output_dir / 'checkpoint-1'} instead" in sentence and "\n" not in sentence, sentence


def checkpoint_copy(checkpointed_run: Path, tmp_path: Path) -> Path:
    """checkpoint-2 of a copy of the run: checkpoint-1 beside it is the one to resume from instead."""
    return shutil.copytree(checkpointed_run, tmp_path / "out") / "checkpoint-2"


@pytest.mark.parametrize("name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_payload_in_a_zero_checkpoint_file_never_runs_through_deepspeeds_own_reader(name, checkpointed_run, tmp_path,
                                                                                      monkeypatch):
    """DeepSpeed's engine reads both with torch.load(weights_only=False) (TorchCheckpointEngine.load)."""
    if "deepspeed" in sys.modules and sys.modules["deepspeed"] is None:  # an in-process run without DeepSpeed hid it
        monkeypatch.delitem(sys.modules, "deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    checkpoint = checkpoint_copy(checkpointed_run, tmp_path)
    (checkpoint / "global_step2").mkdir()
    marker = tmp_path / "payload-ran"
    planted = plant(checkpoint / "global_step2" / name, marker)
    with pytest.raises(UserError) as refused, resume.read_safely(checkpoint):
        TorchCheckpointEngine().load(str(planted), map_location="cpu")
    assert_refused_without_running(refused.value, planted, marker, str(checkpoint.parent / "checkpoint-1"))


def test_a_payload_in_a_dcp_metadata_file_never_runs_through_torchs_own_loader(checkpointed_run, tmp_path):
    """A sharded FSDP2 state (accelerate's SHARDED_STATE_DICT) is read by torch DCP, which unpickles `.metadata` with
    plain pickle; a real one (tensors and a non-tensor entry) still loads."""
    import torch
    import torch.distributed.checkpoint as dcp

    checkpoint = checkpoint_copy(checkpointed_run, tmp_path)
    sharded = checkpoint / "pytorch_model_fsdp_0"
    dcp.save({"weight": torch.arange(4.0), "settings": {"lr": 0.5}}, checkpoint_id=sharded, no_dist=True)
    loaded = {"weight": torch.zeros(4), "settings": {"lr": 0.0}}
    with resume.read_safely(checkpoint):
        dcp.load(loaded, checkpoint_id=sharded, no_dist=True)
    assert loaded["weight"].tolist() == [0.0, 1.0, 2.0, 3.0] and loaded["settings"] == {"lr": 0.5}
    marker = tmp_path / "payload-ran"
    planted = plant(sharded / ".metadata", marker)
    with pytest.raises(UserError) as refused, resume.read_safely(checkpoint):
        dcp.load(loaded, checkpoint_id=sharded, no_dist=True)
    assert_refused_without_running(refused.value, planted, marker, str(checkpoint.parent / "checkpoint-1"))


def test_a_checkpoint_adapter_missing_a_tensor_is_one_line_naming_it_and_the_checkpoint_before(checkpointed_run,
                                                                                               tmp_path):
    """The Trainer loads a checkpoint's adapter with strict=False: a lora_B tensor missing (the marker rewritten, as a
    checkpoint copied or damaged after its save arrives) resumed with its untrained zeros and a warning. Checked from
    the safetensors header against the base, as every model folder is, before loading."""
    import safetensors.torch

    import finetune

    output_dir = shutil.copytree(checkpointed_run, tmp_path / "out")
    weights = output_dir / "checkpoint-2" / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    lost = next(name for name in sorted(tensors) if ".lora_B." in name)
    del tensors[lost]
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    looks_complete(weights)
    with pytest.raises(UserError) as refused:
        finetune.train(config=LORA, max_steps=3, output_dir=str(output_dir), **LORA_ARGS)
    sentence = str(refused.value)
    assert sentence.startswith(f"{weights}: holds no {lost}, which peft would leave at its untrained"), sentence
    assert sentence.endswith(f"resume from {output_dir / 'checkpoint-1'} instead (--resume_from_checkpoint "
                             f"{output_dir / 'checkpoint-1'}).") and "\n" not in sentence, sentence


def test_a_checkpoint_adapter_holding_nan_is_one_line_naming_it_and_the_checkpoint_before(checkpointed_run, tmp_path):
    """Loaded by the Trainer after the model's own check: a resumed run trained on NaN and logged its loss as 0."""
    import safetensors.torch

    import finetune

    output_dir = shutil.copytree(checkpointed_run, tmp_path / "out")
    weights = output_dir / "checkpoint-2" / "adapter_model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    damaged = sorted(tensors)[0]
    tensors[damaged].view(-1)[3] = float("nan")
    safetensors.torch.save_file(tensors, str(weights), metadata={"format": "pt"})
    looks_complete(weights)
    with pytest.raises(UserError) as refused:
        finetune.train(config=LORA, max_steps=3, output_dir=str(output_dir), **LORA_ARGS)
    assert str(refused.value) == (f"{weights}: {damaged} holds NaN or infinite values, so the resumed run would train "
                                  f"on NaN (its loss logged as 0); resume from {output_dir / 'checkpoint-1'} instead "
                                  f"(--resume_from_checkpoint {output_dir / 'checkpoint-1'}).")


def test_a_checkpoint_optimizer_state_holding_nan_is_one_line_naming_it_and_the_checkpoint_before(checkpointed_run,
                                                                                                   tmp_path, capfd):
    """The Trainer loads optimizer.pt as it is: a resume from Adam moments holding NaN trained on NaN, logged its loss
    as 0 and saved NaN weights, exit 0. Refused before loading, by the run and by `finetune check` alike."""
    import torch

    import finetune
    from finetune import cli

    output_dir = shutil.copytree(checkpointed_run, tmp_path / "out")
    optimizer = output_dir / "checkpoint-2" / "optimizer.pt"
    state = torch.load(optimizer, weights_only=True)
    state["state"][1]["exp_avg"].view(-1)[4] = float("nan")
    torch.save(state, optimizer)
    looks_complete(optimizer)
    expected = (f"{optimizer}: state[1].exp_avg holds NaN or infinite values, which the resumed run would carry into "
                f"the weights it updates from its first step (its loss logged as 0 once they are NaN); resume from "
                f"{output_dir / 'checkpoint-1'} instead (--resume_from_checkpoint {output_dir / 'checkpoint-1'}).")
    with pytest.raises(UserError) as refused:
        finetune.train(config=LORA, max_steps=3, output_dir=str(output_dir), **LORA_ARGS)
    assert str(refused.value) == expected
    capfd.readouterr()
    assert cli.main(["check", "--config", str(LORA), "--max_steps", "3", "--output_dir", str(output_dir),
                     *(f"--{key}={value}" for key, value in LORA_ARGS.items())]) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == f"error: {expected}"


class CallsAllowedClass:
    """Unpickled, it calls an allowed class with arguments of its own (REDUCE), as no checkpoint file does."""

    def __init__(self, cls, *args):
        self.cls, self.args = cls, args

    def __reduce__(self):
        return (self.cls, self.args)


def test_a_file_calling_an_allowed_class_never_runs_its_init(checkpointed_run, tmp_path, monkeypatch):
    """The classes a checkpoint may build (SFTConfig, TrainingArguments, PartialState, DeepSpeed's configs) are rebuilt
    from their state, as their pickles do; a file that calls one with arguments of its own gets an instance made
    without its `__init__` (TrainingArguments' reads DeepSpeed files and sets the environment). The Trainer's own
    training_args.bin still reads whole."""
    import torch
    from transformers import TrainingArguments

    marker = tmp_path / "init-ran"
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: marker.write_text(str(self.output_dir)))
    planted = tmp_path / "training_args.bin"
    torch.save(CallsAllowedClass(TrainingArguments, "chosen-by-the-file"), planted)
    checkpoint = checkpointed_run / "checkpoint-2"
    with resume.read_safely(checkpoint):
        built = torch.load(planted)
        saved = torch.load(checkpoint / "training_args.bin")
    assert type(built) is TrainingArguments and built.output_dir != "chosen-by-the-file"
    assert not marker.exists(), "the allowed class's __init__ ran with the file's arguments"
    assert saved.output_dir == str(checkpointed_run) and saved.max_steps == 2
