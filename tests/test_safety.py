import pytest

"""Safe by default: no remote code unless asked, safetensors only (no pickle is ever unpickled from a model folder), and
no access token in logs, saved arguments, run record, checkpoints or model cards."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from finetune.run.arguments import parse_args
from finetune.run.model import model_init_kwargs
from tests.helpers import ROOT, launch_sft

pytestmark = pytest.mark.launches  # its tests start training processes

LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
FAKE_TOKEN = "hf_FinetuneLeakCanary0123456789abcdefXYZ"


def test_trust_remote_code_is_off_unless_turned_on():
    run = parse_args(["--config", str(LORA), "--tiny", "--output_dir", "unused"])
    assert run.training.trust_remote_code is False
    assert model_init_kwargs(run, "meta-llama/Llama-3.2-1B-Instruct")["trust_remote_code"] is False
    on = parse_args(["--config", str(LORA), "--tiny", "--output_dir", "unused", "--trust_remote_code", "true"])
    assert model_init_kwargs(on, "meta-llama/Llama-3.2-1B-Instruct")["trust_remote_code"] is True


def test_weights_are_loaded_from_safetensors_only():
    run = parse_args(["--config", str(LORA), "--tiny", "--output_dir", "unused"])
    assert model_init_kwargs(run, "meta-llama/Llama-3.2-1B-Instruct")["use_safetensors"] is True


def tiny_model(tiny_model_cache: Path) -> Path:
    folders = list(tiny_model_cache.glob("llama-*"))
    if not folders:  # built by the first run that needs it
        result = launch_sft("--config", str(LORA), "--tiny", "--output_dir", str(tiny_model_cache / "warmup"), "--max_steps", "1")
        assert result.returncode == 0, result.stderr[-3000:]
        folders = list(tiny_model_cache.glob("llama-*"))
    return folders[0]


PICKLE_BOMB = r"""
import os, pickle, sys
class Bomb:
    def __reduce__(self):
        return (open, (sys.argv[2], "w"))
with open(sys.argv[1], "wb") as handle:
    pickle.dump({"model.embed_tokens.weight": Bomb()}, handle)
"""


def test_a_pickled_checkpoint_is_never_unpickled_and_remote_code_never_runs(tmp_path, tiny_model_cache):
    """A model folder holding only pytorch_model.bin (a pickle that writes a file when unpickled) and a config whose
    auto_map points at custom code (which writes a file when imported): loading it runs neither."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model(tiny_model_cache), folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    pickled_ran, code_ran = tmp_path / "pickle-ran", tmp_path / "code-ran"
    subprocess.run([sys.executable, "-c", PICKLE_BOMB, str(folder / "pytorch_model.bin"), str(pickled_ran)], check=True)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "evil.EvilModel", "AutoConfig": "evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(code_ran)!r}, 'w').write('ran')\n")
    result = launch_sft("--config", str(LORA), "--model_name_or_path", str(folder), "--dataset_name",
                        str(ROOT / "data" / "sample"), "--output_dir", str(tmp_path / "out"), "--max_steps", "1")
    assert result.returncode != 0
    assert not pickled_ran.exists(), "a pickle from the model folder was unpickled"
    assert not code_ran.exists(), "the model folder's own code ran without trust_remote_code"
    assert "error: " in result.stderr


def test_no_access_token_in_logs_saved_arguments_run_record_checkpoints_or_model_cards(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", FAKE_TOKEN)
    output_dir = tmp_path / "out"
    result = launch_sft("--config", str(LORA), "--tiny", "--output_dir", str(output_dir), "--max_steps", "2",
                        "--save_steps", "1", "--logging_steps", "1", "--report_to", "tensorboard",
                        "--hub_token", FAKE_TOKEN)  # the Trainer pickles its arguments, hub_token included
    assert result.returncode == 0, result.stderr[-3000:]
    assert FAKE_TOKEN not in result.stdout + result.stderr
    scanned = [path for path in output_dir.rglob("*") if path.is_file()]
    names = {path.name for path in scanned}
    assert {"training_args.bin", "trainer_state.json", "finetune_run.json", "README.md"} <= names, names
    for path in scanned:  # binary files too: a pickled TrainingArguments holds its strings as plain bytes
        assert FAKE_TOKEN.encode() not in path.read_bytes(), f"the access token leaked into {path}"
