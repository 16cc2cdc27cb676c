"""Damaged model folders, unfinished runs and bad flags in `finetune chat | generate | eval | merge` and in training.

Each case ends in one sentence naming the file and the fix, exit 2, no traceback, before any weights load; the folders
that are whole keep working. The model folders are built once from the tiny Llama: an adapter is saved by peft
without training, and a run's output folder (its record, checkpoints and final marker) is written as a run writes it.
"""

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import cli
from finetune import run_folder as folder_files
from finetune.checks import model_folder
from finetune.errors import UserError
from finetune.models import tiny
from finetune.run import evaluation
from finetune.run import generation as inference
from finetune.run import model as model_loading
from finetune.run_folder import RUN_RECORD
from tests.helpers import ROOT, folder_digest, write
from tests.test_bad_inputs import FINETUNE, FULL, check_bad_input, rows_file, write_bytes

CONVERSATION = [{"role": "user", "content": "Repeat: red fish"}, {"role": "assistant", "content": "red fish"}]


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def copy_of(source: Path, folder: Path, change=None) -> Path:
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("checkpoint-*"))
    if change:
        change(folder)
    return folder


def with_base(base: str):
    def change(folder: Path) -> None:
        settings = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": base}))
    return change


def save_adapter(base: Path, folder: Path) -> Path:
    """A LoRA adapter of the tiny model as peft saves it (untrained: the weights are not what is tested here)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base)
    get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")).save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def with_tensors(change, weights: str = "model.safetensors"):
    """The folder's `weights` file rewritten whole by safetensors with `change` made to its tensors."""
    def rewrite(folder: Path) -> None:
        import safetensors.torch

        tensors = safetensors.torch.load_file(str(folder / weights))
        change(tensors)
        safetensors.torch.save_file(tensors, str(folder / weights), metadata={"format": "pt"})
    return rewrite


LORA_A = f"base_model.model.{Q_PROJ.removesuffix('.weight')}.lora_A.weight"


def with_adapter_tensors(change):
    """The adapter's adapter_model.safetensors rewritten whole with `change` made to its tensors."""
    return with_tensors(change, "adapter_model.safetensors")


def with_pickled_adapter(folder: Path) -> None:
    """adapter_model.bin (torch.save of its tensors) in place of adapter_model.safetensors, as older peft wrote it."""
    import safetensors.torch
    import torch

    weights = folder / "adapter_model.safetensors"
    torch.save(safetensors.torch.load_file(str(weights)), folder / "adapter_model.bin")
    weights.unlink()


def with_overlapping_tensors(folder: Path) -> None:
    """A header that lies: q_proj's data_offsets point at o_proj's bytes (same size), the file's length unchanged."""
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header[Q_PROJ]["data_offsets"] = header[Q_PROJ.replace("q_proj", "o_proj")]["data_offsets"]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    weights.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:])


def with_a_shard_left_out_of_the_index(folder: Path) -> None:
    """Two shards, the second (model.norm.weight) beside the first but not in the index: transformers reads only the
    shards the index lists."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    norm = {"model.norm.weight": tensors.pop("model.norm.weight")}
    safetensors.torch.save_file(tensors, str(folder / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    safetensors.torch.save_file(norm, str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    write(folder / "model.safetensors.index.json",
          json.dumps({"weight_map": {name: "model-00001-of-00002.safetensors" for name in tensors}}))


def needing_its_own_code(folder: Path) -> None:
    """config.json names a model type transformers lacks and an `auto_map` into the folder's own Python file, which
    creates the file `code-ran` beside the folder when it is imported."""
    settings = json.loads((folder / "config.json").read_text())
    settings.update(model_type="evilmodel", auto_map={"AutoConfig": "evil.EvilConfig",
                                                      "AutoModelForCausalLM": "evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(settings))
    (folder / "evil.py").write_text(
        f"open({str(folder.parent / 'code-ran')!r}, 'w').close()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    model_type = 'evilmodel'\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")


def run_folder(model: Path, folder: Path, final: bool, checkpoint_steps=(1, 2), complete_steps=(1,)) -> Path:
    """A training run's output folder: its record, its checkpoints (those of `complete_steps` with their marker), and
    the final model with its marker when `final`."""
    copy_of(model, folder)
    write(folder / RUN_RECORD, json.dumps({"model_name_or_path": str(model)}))
    for step in checkpoint_steps:
        checkpoint = copy_of(model, folder / f"checkpoint-{step}")
        write(checkpoint / "trainer_state.json", json.dumps({"global_step": step}))
        write(checkpoint / "optimizer.pt", "state")
        if step in complete_steps:
            folder_files.write_marker(checkpoint, step, 1)
    if final:
        folder_files.write_final_marker(folder, checkpoint_steps[-1], {"max_steps": checkpoint_steps[-1]})
    return folder


def zero3_run_saved_partitioned(model: Path, folder: Path) -> Path:
    """A ZeRO-3 run's output folder saved without the 16-bit gather, as transformers writes it then: no model weights,
    DeepSpeed's partitions under global_step2/ named in `latest`, in the folder and in its complete checkpoint-2; no
    final marker, as the run writes none then."""
    run_folder(model, folder, final=False, checkpoint_steps=(2,), complete_steps=())
    for saved in (folder, folder / "checkpoint-2"):
        (saved / "model.safetensors").unlink()
        write(saved / "latest", "global_step2\n")
        write(saved / "global_step2" / "zero_pp_rank_0_mp_rank_00_model_states.pt", "partitions")
    folder_files.write_marker(folder / "checkpoint-2", 2, 2)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_cache) -> dict[str, str]:
    import torch

    root = tmp_path_factory.mktemp("model-folders")
    base = copy_of(tiny.tiny_model_folder("llama"), root / "base")
    adapter = save_adapter(base, root / "adapter")
    built = {
        "base": base, "adapter": adapter,
        "truncated": copy_of(base, root / "truncated", lambda f: cut_in_half(f / "model.safetensors")),
        "empty config": copy_of(base, root / "empty-config", lambda f: write(f / "config.json", "")),
        "cut config": copy_of(base, root / "cut-config", lambda f: write(f / "config.json", '{"model_type": "lla')),
        "cut tokenizer": copy_of(base, root / "cut-tokenizer", lambda f: cut_in_half(f / "tokenizer.json")),
        "no weights": copy_of(base, root / "no-weights", lambda f: (f / "model.safetensors").unlink()),
        "lost shard": copy_of(base, root / "lost-shard", lambda f: write(
            f / "model.safetensors.index.json", json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))),
        "no template": copy_of(base, root / "no-template", lambda f: (f / "chat_template.jinja").unlink()),
        "own code": copy_of(base, root / "own-code" / "model", needing_its_own_code),
        "lost tensor": copy_of(base, root / "lost-tensor", with_tensors(lambda tensors: tensors.pop(Q_PROJ))),
        "wrong shape": copy_of(base, root / "wrong-shape", with_tensors(
            lambda tensors: tensors.update({Q_PROJ: tensors[Q_PROJ][:32].contiguous()}))),
        "integer weights": copy_of(base, root / "integer-weights", with_tensors(
            lambda tensors: tensors.update({Q_PROJ: (tensors[Q_PROJ] * 100).int()}))),
        "lying header": copy_of(base, root / "lying-header", with_overlapping_tensors),
        "index of pickles": copy_of(base, root / "index-of-pickles", lambda f: write(
            f / "model.safetensors.index.json", json.dumps({"weight_map": {Q_PROJ: "pytorch_model-00001.bin"}}))),
        "config of fewer layers": copy_of(base, root / "config-of-fewer-layers", lambda f: write(
            f / "config.json", json.dumps({**json.loads((f / "config.json").read_text()), "num_hidden_layers": 1}))),
        "shard left out": copy_of(base, root / "shard-left-out", with_a_shard_left_out_of_the_index),
        "pickled adapter": copy_of(adapter, root / "pickled-adapter", with_pickled_adapter),
        "nan weights": copy_of(base, root / "nan-weights", with_tensors(
            lambda tensors: tensors[Q_PROJ].view(-1)[7:9].copy_(torch.tensor([float("nan"), float("inf")])))),
        "adapter of nan weights": copy_of(adapter, root / "adapter-of-nan-weights", with_adapter_tensors(
            lambda tensors: tensors[LORA_A].fill_(float("nan")))),
        "adapter missing a tensor": copy_of(adapter, root / "adapter-missing-a-tensor", with_adapter_tensors(
            lambda tensors: tensors.pop(LORA_A.replace("lora_A", "lora_B")))),
        "adapter of another rank": copy_of(adapter, root / "adapter-of-another-rank", with_adapter_tensors(
            lambda tensors: tensors.update({LORA_A: tensors[LORA_A].repeat(2, 1)}))),
        "adapter of a deeper model": copy_of(adapter, root / "adapter-of-a-deeper-model", with_adapter_tensors(
            lambda tensors: tensors.update({LORA_A.replace("layers.0", "layers.7"): tensors[LORA_A].clone()}))),
        "adapter of other layers": copy_of(adapter, root / "adapter-of-other-layers", lambda f: write(
            f / "adapter_config.json", json.dumps({**json.loads((f / "adapter_config.json").read_text()),
                                                   "target_modules": ["query_key_value"]}))),
        "truncated adapter": copy_of(adapter, root / "truncated-adapter",
                                     lambda f: cut_in_half(f / "adapter_model.safetensors")),
        "adapter without base": copy_of(adapter, root / "adapter-without-base", with_base(str(root / "gone"))),
        "adapter on hub base": copy_of(adapter, root / "adapter-on-hub-base", with_base("nobody/not-downloaded")),
        "adapter on damaged base": copy_of(adapter, root / "adapter-on-damaged-base",
                                           with_base(str(root / "truncated"))),
        "stopped run": run_folder(base, root / "stopped-run", final=False),
        "stopped run, no checkpoint": run_folder(base, root / "stopped-run-2", final=False, complete_steps=()),
        "finished run": run_folder(base, root / "finished-run", final=True),
        "zero3 run saved partitioned": zero3_run_saved_partitioned(base, root / "zero3-run"),
        "finished LoRA run": run_folder(adapter, root / "finished-lora-run", final=True, checkpoint_steps=(2,)),
        "file": write(root / "a-file.txt", "not a model\n"),
        "prompts": write(root / "prompts.txt", "Repeat: red fish\n"),
        "prompts csv": write(root / "prompts.csv", "prompt\nRepeat: red fish\n"),
        "prompts of a human turn": write(root / "human.jsonl", json.dumps(
            {"messages": [{"role": "human", "content": "Repeat: red fish"}]}) + "\n"),
        "rows": rows_file(root, [{"messages": CONVERSATION}]),
        "read-only": root / "read-only",
    }
    built["read-only"].mkdir()
    return {name: str(path) for name, path in built.items()}


def refusal(arguments: list[str], capfd) -> str:
    """`finetune ARGUMENTS` in this process: exit 2, one `error: ` line and no traceback; that line."""
    capfd.readouterr()
    code = cli.main(arguments)
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, out[-2000:] + err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert "Loading weights" not in out + err, "the refusal must come before the model loads"
    return errors[0]


OUT = ["--out", "{tmp}/answers.jsonl"]
# (case, `finetune` arguments ({name} is a folder of the fixture, {tmp} the test's tmp_path), words the sentence holds)
COMMAND_CASES = [
    ("chat: truncated safetensors", ["chat", "{truncated}"], ["model.safetensors is truncated", "re-download"]),
    ("generate: empty config.json", ["generate", "{empty config}", "--prompts", "{prompts}", *OUT],
     ["config.json: empty", "re-download the model or re-save it"]),
    ("eval: config.json cut short", ["eval", "{cut config}", "--dataset_name", "{rows}"],
     ["config.json: not valid JSON", "re-download"]),
    ("chat: tokenizer.json cut short", ["chat", "{cut tokenizer}"], ["tokenizer.json: not valid JSON", "re-download"]),
    ("chat: a folder without weights", ["chat", "{no weights}"], ["holds no weights", "model.safetensors", "re-save"]),
    ("chat: a weight no shard holds (transformers initialised it at random with a warning)", ["chat", "{lost tensor}"],
     [f"lost-tensor/model.safetensors: holds no {Q_PROJ}", "random values", "re-download"]),
    ("generate: a weight of the wrong shape (a traceback at load)",
     ["generate", "{wrong shape}", "--prompts", "{prompts}", *OUT],
     [f"{Q_PROJ} is stored as F32 [32, 64], where config.json implies [64, 64]", "re-download"]),
    ("eval: a weight stored as integers (cast to float without a word)",
     ["eval", "{integer weights}", "--dataset_name", "{rows}"],
     [f"{Q_PROJ} is stored as I32 [64, 64], where config.json implies a floating type", "re-download"]),
    ("merge: a base whose weight is missing", ["merge", "{adapter}", "{tmp}/merged", "--base_model", "{lost tensor}"],
     [f"holds no {Q_PROJ}"]),
    ("chat: a header whose offsets overlap (the reader's traceback at load)", ["chat", "{lying header}"],
     ["model.safetensors has a header that does not fit its data", f"tensor {Q_PROJ} starts at byte"]),
    ("chat: an adapter missing a tensor (peft warned and left it untrained)", ["chat", "{adapter missing a tensor}"],
     [f"holds no {LORA_A.replace('lora_A', 'lora_B')}", "untrained initial value", "re-save the adapter"]),
    ("merge: an adapter missing a tensor (merged in untrained)", ["merge", "{adapter missing a tensor}", "{tmp}/merged"],
     [f"holds no {LORA_A.replace('lora_A', 'lora_B')}", "a merge would write it in"]),
    ("chat: an adapter of another rank than its adapter_config.json", ["chat", "{adapter of another rank}"],
     [f"{LORA_A} is [8, 64] in the adapter and [4, 64]", "another `r`", "--base"]),
    ("eval: an adapter holding a layer its base lacks (dropped without a word)",
     ["eval", "{adapter of a deeper model}", "--dataset_name", "{rows}"],
     [f"holds {LORA_A.replace('layers.0', 'layers.7')}, which no layer of", "trained on another model", "--base"]),
    ("merge: an adapter whose target_modules match no layer (peft's traceback)",
     ["merge", "{adapter of other layers}", "{tmp}/merged"],
     ["adapter_config.json: its `target_modules` ['query_key_value'] match no layer", "--base_model"]),
    ("chat: an index leaving out the shard of a weight (transformers initialised it at random)",
     ["chat", "{shard left out}"],
     ["model.safetensors.index.json: lists no shard holding model.norm.weight", "random values"]),
    ("chat: an index of pickled shards (read as a truncated safetensors)", ["chat", "{index of pickles}"],
     ["model.safetensors.index.json: lists pytorch_model-00001.bin, which is not a .safetensors file", "never unpickles"]),
    ("chat: a config.json of fewer layers than its weights (transformers dropped the rest with a warning)",
     ["chat", "{config of fewer layers}"],
     ["model.safetensors: holds model.layers.1.input_layernorm.weight, a weight the model of its config.json does not "
      "have", "re-download"]),
    ("chat: an index naming a missing shard", ["chat", "{lost shard}"],
     ["model.safetensors.index.json: lists model-00002.safetensors, which is missing"]),
    ("chat: an adapter whose adapter weights are cut", ["chat", "{truncated adapter}"],
     ["adapter_model.safetensors is truncated", "re-save the adapter"]),
    ("chat: an adapter whose base folder is gone", ["chat", "{adapter without base}"],
     ["adapter_config.json: its base model cannot be loaded", "gone: no such folder", "--base"]),
    ("generate: an adapter whose hub base is not cached offline",
     ["generate", "{adapter on hub base}", "--prompts", "{prompts}", *OUT],
     ["adapter_config.json: its base model", "nobody/not-downloaded", "HF_HUB_OFFLINE", "hf download"]),
    ("eval: an adapter whose base is damaged", ["eval", "{adapter on damaged base}", "--dataset_name", "{rows}"],
     ["its base model cannot be loaded", "model.safetensors is truncated"]),
    ("chat: --base that is a file", ["chat", "{adapter}", "--base", "{file}"],
     ["a-file.txt: a file, not a model folder", "--base"]),
    ("generate: --base a folder that is gone", ["generate", "{adapter}", "--base", "{tmp}/gone", "--prompts", "{prompts}",
                                                *OUT], ["gone: no such folder", "--base"]),
    ("chat: a stopped run names its newest complete checkpoint", ["chat", "{stopped run}"],
     ["no complete final model", "finetune_final.json", "stopped-run/checkpoint-1 instead", "relaunch"]),
    ("generate: a stopped run without a complete checkpoint",
     ["generate", "{stopped run, no checkpoint}", "--prompts", "{prompts}", *OUT],
     ["no complete final model", "relaunch the training command"]),
    ("eval: a stopped run", ["eval", "{stopped run}", "--dataset_name", "{rows}"], ["checkpoint-1 instead"]),
    ("chat: a ZeRO-3 run saved without the 16-bit gather (its partitions read as a folder without weights)",
     ["chat", "{zero3 run saved partitioned}"],
     ["zero3-run: holds DeepSpeed's partitioned ZeRO-3 checkpoint (global_step2) and no model weights",
      "`stage3_gather_16bit_weights_on_model_save`", "--zero3_save_16bit_model true", "relaunch the training command",
      "zero3-run/model.safetensors from the run's newest complete checkpoint."]),
    ("generate: the checkpoint of a ZeRO-3 run saved without the 16-bit gather",
     ["generate", "{zero3 run saved partitioned}/checkpoint-2", "--prompts", "{prompts}", *OUT],
     ["checkpoint-2: holds DeepSpeed's partitioned ZeRO-3 checkpoint (global_step2)", "relaunch the training command",
      "zero3-run/model.safetensors", "then pass", "zero3-run to OUTPUT_DIR."]),
    ("eval: a ZeRO-3 run saved without the 16-bit gather", ["eval", "{zero3 run saved partitioned}", "--dataset_name",
                                                            "{rows}"], ["partitioned ZeRO-3 checkpoint"]),
    ("merge: a ZeRO-3 run saved without the 16-bit gather", ["merge", "{zero3 run saved partitioned}", "{tmp}/merged"],
     ["partitioned ZeRO-3 checkpoint"]),
    ("chat: a model without a chat template", ["chat", "{no template}"], ["no chat template", "instruct model"]),
    ("chat: a hub id not cached offline", ["chat", "nobody/not-downloaded"],
     ["nobody/not-downloaded", "local cache", "OUTPUT_DIR"]),
    ("chat: --device cuda on a machine without one", ["chat", "{base}", "--device", "cuda:99"], ["--device cuda:99"]),
    ("chat: --device that is no device", ["chat", "{base}", "--device", "gpu0"], ["--device gpu0: not a device"]),
    ("generate: --prompts that is a folder", ["generate", "{base}", "--prompts", "{tmp}", *OUT],
     ["a folder, not a prompts file"]),
    ("generate: a .csv of prompts (its header and cells were answered as prompts)",
     ["generate", "{base}", "--prompts", "{prompts csv}", *OUT], ["prompts.csv: a .csv file", ".jsonl"]),
    ("generate: a role the chat template does not know (rendered as it is)",
     ["generate", "{base}", "--prompts", "{prompts of a human turn}", *OUT],
     ["human.jsonl: line 1 turn 1 of `messages` has role 'human'", "use one of"]),
    ("chat: --base that is itself an adapter (two adapters on one model)", ["chat", "{adapter}", "--base", "{adapter}"],
     ["adapter: a LoRA adapter, not the base model", "two adapters", "--base"]),
    ("merge: --base_model a LoRA run", ["merge", "{adapter}", "{tmp}/merged", "--base_model", "{finished LoRA run}"],
     ["finished-lora-run: a LoRA adapter", "--base_model the model it was trained on"]),
    ("generate: --out that is a folder", ["generate", "{base}", "--prompts", "{prompts}", "--out", "{tmp}"],
     ["a folder, not a file", "--out"]),
    ("eval: --report into a missing folder", ["eval", "{base}", "--dataset_name", "{rows}", "--report", "{tmp}/no/r.json"],
     ["its folder", "does not exist", "--report"]),
    ("eval: a missing dataset file", ["eval", "{base}", "--dataset_name", "{tmp}/gone.jsonl"], ["gone.jsonl", "not found"]),
    ("eval: --compare a damaged folder (checked before the first model is scored)",
     ["eval", "{base}", "--dataset_name", "{rows}", "--compare", "{truncated}", "--report", "{tmp}/r.json"],
     ["truncated/model.safetensors is truncated"]),
    ("eval: a hub model has no default report place", ["eval", "nobody/not-downloaded", "--dataset_name", "{rows}"],
     ["not a local folder", "--report FILE"]),
    ("merge: an adapter whose base folder is gone", ["merge", "{adapter without base}", "{tmp}/merged"],
     ["its base model cannot be loaded", "no such folder", "--base_model"]),
    ("merge: an adapter whose hub base is not cached offline", ["merge", "{adapter on hub base}", "{tmp}/merged"],
     ["nobody/not-downloaded", "hf download", "--base_model"]),
    ("merge: --base_model that is a file", ["merge", "{adapter}", "{tmp}/merged", "--base_model", "{file}"],
     ["a file, not a model folder", "--base_model"]),
    ("merge: a truncated adapter", ["merge", "{truncated adapter}", "{tmp}/merged"], ["adapter_model.safetensors is truncated"]),
    ("merge: a stopped run", ["merge", "{stopped run}", "{tmp}/merged"], ["no complete final model"]),
    ("merge: a full model", ["merge", "{base}", "{tmp}/merged"], ["no adapter_config.json", "LoRA"]),
    ("merge: an output folder under a file", ["merge", "{adapter}", "{file}/merged"],
     ["cannot be created because", "a-file.txt is a file"]),
    ("merge: an output path that is a file", ["merge", "{adapter}", "{file}"], ["a file, not a folder"]),
    ("merge: an output folder that holds files", ["merge", "{adapter}", "{base}"], ["already holds files"]),
    ("generate: --out an existing file, without --overwrite",
     ["generate", "{base}", "--prompts", "{prompts}", "--out", "{file}"], ["a-file.txt: already exists", "--overwrite"]),
    ("generate: --out the prompts file", ["generate", "{base}", "--prompts", "{prompts}", "--out", "{prompts}"],
     ["prompts.txt: already exists", "--overwrite"]),
    ("generate: --out the adapter's own weights, even with --overwrite",
     ["generate", "{adapter}", "--prompts", "{prompts}", "--out", "{adapter}/adapter_model.safetensors", "--overwrite"],
     ["adapter_model.safetensors: already exists in the model folder", "outside it"]),
    ("eval: --report an existing file, without --overwrite",
     ["eval", "{base}", "--dataset_name", "{rows}", "--report", "{file}"], ["a-file.txt: already exists", "--overwrite"]),
    ("eval: --report a run's record, even with --overwrite",
     ["eval", "{finished run}", "--dataset_name", "{rows}", "--report", "{finished run}/finetune_run.json",
      "--overwrite"], ["finetune_run.json: already exists in the model folder"]),
]


@pytest.mark.parametrize("case", COMMAND_CASES, ids=[case[0] for case in COMMAND_CASES])
def test_a_command_given_a_bad_model_folder_or_flag_says_one_sentence_before_loading(case, folders, tmp_path, capfd):
    _, arguments, expected_words = case
    before = folder_digest(Path(folders["base"]).parent)
    sentence = refusal([argument.format(tmp=tmp_path, **folders) for argument in arguments], capfd)
    for word in expected_words:
        assert word in sentence, f"{word!r} missing from: {sentence}"
    assert folder_digest(Path(folders["base"]).parent) == before, "a refused command changed a model folder"
    assert not (tmp_path / "merged").exists() and not (tmp_path / "answers.jsonl").exists()


@pytest.mark.parametrize("command", ["generate --out", "eval --report", "merge"])
def test_an_output_in_a_read_only_folder_is_refused_before_loading(command, folders, tmp_path, capfd, monkeypatch):
    """Root can write anywhere (as the tests may run): `os.access` answers as it would for a user on a read-only disk."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(folders["read-only"]) and
                        real_access(path, mode))
    target = f"{folders['read-only']}/out"
    arguments = {"generate --out": ["generate", folders["base"], "--prompts", folders["prompts"], "--out", target],
                 "eval --report": ["eval", folders["base"], "--dataset_name", folders["rows"], "--report", target],
                 "merge": ["merge", folders["adapter"], target]}[command]
    sentence = refusal(arguments, capfd)
    assert "cannot be written" in sentence and "read-only" in sentence, sentence


def test_a_prompts_file_that_cannot_be_read_is_one_sentence(folders, tmp_path, capfd, monkeypatch):
    """Root reads any file (as the tests may run): reading the prompts file fails as it does for a user without
    read permission."""
    real_read_text = Path.read_text

    def read_text(path, *args, **kwargs):
        if str(path) == folders["prompts"]:
            raise PermissionError(13, "Permission denied")
        return real_read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    sentence = refusal(["generate", folders["base"], "--prompts", folders["prompts"], "--out", str(tmp_path / "a.jsonl")],
                       capfd)
    assert sentence == (f"error: {folders['prompts']}: the prompts file cannot be read (Permission denied); fix its "
                        f"permissions or pass another --prompts.")


def test_chat_names_the_stdin_line_that_is_not_utf8(folders, monkeypatch, capfd):
    """The first line is answered; the second, a Latin-1 byte, ends the chat in one sentence naming line 2."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Repeat: red fish\nRepeat: caf\xe9\n")))
    sentence = refusal_after_loading(["chat", folders["base"], "--max_new_tokens", "2"], capfd)
    assert sentence == ("error: stdin: line 2 is not UTF-8 text; send UTF-8 (convert with iconv -t UTF-8, or set the "
                        "terminal's encoding to UTF-8).")


def test_overwrite_replaces_an_existing_answers_file_outside_a_model_folder(folders, tmp_path, capfd):
    out = write(tmp_path / "answers.jsonl", "earlier answers\n")
    arguments = ["generate", folders["base"], "--prompts", folders["prompts"], "--out", str(out), "--max_new_tokens", "2"]
    assert cli.main([*arguments, "--overwrite"]) == 0, capfd.readouterr().err[-3000:]
    assert json.loads(out.read_text())["prompt"] == "Repeat: red fish"


def prompt_tokens(tokenizer, conversation: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])


def test_prompts_and_new_tokens_are_held_to_the_models_context(folders, capsys):
    model, tokenizer = inference.load_trained(folders["base"], device="cpu")
    prompt = [{"role": "user", "content": "Repeat: red fish"}]
    length = prompt_tokens(tokenizer, prompt)
    model.config.max_position_embeddings = length + 3
    assert len(inference.generate_answers(model, tokenizer, [prompt], max_new_tokens=10)) == 1
    assert "prompts: --max_new_tokens 10 cut to 3 where a prompt leaves less" in capsys.readouterr().out
    model.config.max_position_embeddings = length
    with pytest.raises(UserError) as refused:
        inference.generate_answers(model, tokenizer, [prompt, prompt], source="p.jsonl")
    assert str(refused.value).startswith(f"p.jsonl: prompt 1 is {length} tokens through the chat template and the "
                                         f"model reads at most {length}")
    assert inference.generate_answers(model, tokenizer, [prompt], skip_too_long=True) == [""]
    assert "1 prompt(s) longer than the model's" in capsys.readouterr().out
    out = io.StringIO()
    inference.chat(model, tokenizer, generation={"max_new_tokens": 2}, lines=io.StringIO("Repeat: red fish\n"), out=out)
    assert "send a shorter one, or /reset" in capsys.readouterr().err and out.getvalue() == ""


def test_eval_cuts_rows_as_training_does_and_scores_a_prompt_past_the_context_as_a_miss(folders, capsys):
    model, tokenizer = inference.load_trained(folders["base"], device="cpu")
    long_row = [{"role": "user", "content": "Repeat: " + "red fish " * 40},
                {"role": "assistant", "content": "red fish " * 40}]
    model.config.max_position_embeddings = 24  # shorter than the prompt: no answer, and rows cut to 24 tokens
    scores = evaluation.score(model, tokenizer, [long_row, CONVERSATION], max_new_tokens=2)
    assert scores["answers"][0] == "" and scores["rows"] == 2
    assert scores["loss"] == round(evaluation.assistant_loss(model, tokenizer, [long_row, CONVERSATION],
                                                             max_length=24), 4)
    model.config.max_position_embeddings = 4096
    assert evaluation.assistant_loss(model, tokenizer, [long_row], max_length=24) != \
        evaluation.assistant_loss(model, tokenizer, [long_row])


def test_merge_of_a_plain_peft_adapter_takes_the_tokenizer_of_its_base(folders, tmp_path, capfd):
    adapter = copy_of(Path(folders["adapter"]), tmp_path / "plain-adapter")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (adapter / name).unlink(missing_ok=True)
    assert cli.main(["merge", str(adapter), str(tmp_path / "merged")]) == 0, capfd.readouterr().err[-3000:]
    assert "holds no tokenizer files (a plain peft adapter)" in capfd.readouterr().out
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def refusal_after_loading(arguments: list[str], capfd) -> str:
    capfd.readouterr()
    code = cli.main(arguments)
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    return errors[0]


NAN_CASES = {  # `finetune` arguments, the folder named and the tensor
    "chat": (["chat", "{nan weights}"], "nan weights", Q_PROJ),
    "generate": (["generate", "{nan weights}", "--prompts", "{prompts}", *OUT], "nan weights", Q_PROJ),
    "eval: an adapter's tensor": (["eval", "{adapter of nan weights}", "--dataset_name", "{rows}"],
                                  "adapter of nan weights", "lora_A"),
    "merge: an adapter's tensor": (["merge", "{adapter of nan weights}", "{tmp}/merged"], "adapter of nan weights",
                                   "lora_A"),
}


@pytest.mark.parametrize("case", NAN_CASES)
def test_weights_holding_nan_or_inf_are_one_sentence_once_loaded_by_every_command(case, folders, tmp_path, capfd):
    """The headers do not tell them: read once loaded, one float32 sum per tensor. A run trained on them logged its
    loss as 0 and saved, exit 0."""
    arguments, folder, tensor = NAN_CASES[case]
    sentence = refusal_after_loading([argument.format(tmp=tmp_path, **folders) for argument in arguments], capfd)
    assert sentence.startswith(f"error: {folders[folder]}: ") and "holds NaN or infinite values" in sentence, sentence
    assert tensor in sentence and ("re-save the adapter" if "adapter" in case else "re-download") in sentence, sentence
    assert not (tmp_path / "merged").exists() and not (tmp_path / "answers.jsonl").exists()


def test_training_on_weights_holding_nan_is_one_sentence_and_saves_nothing(folders, tmp_path):
    import finetune

    with pytest.raises(UserError, match=f"nan-weights: {Q_PROJ} holds NaN or infinite values"):
        finetune.train(config=str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"),
                       model_name_or_path=folders["nan weights"], dataset_name=str(ROOT / "data" / "sample"),
                       max_steps=1, output_dir=str(tmp_path / "out"), report_to="none", eval_strategy="no",
                       eval_samples_before_after=0)
    assert not (tmp_path / "out" / "finetune_final.json").exists()


@pytest.mark.parametrize("name", ["finished run", "finished LoRA run", "base", "pickled adapter"])
def test_a_finished_run_and_a_plain_model_folder_keep_working(name, folders, monkeypatch, capfd):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Repeat: red fish\n"))
    assert cli.main(["chat", folders[name], "--max_new_tokens", "2"]) == 0, capfd.readouterr().err[-3000:]


def test_merge_writes_the_merged_model_aside_then_in_place_and_it_loads_without_peft(folders, tmp_path, capfd):
    merged = tmp_path / "merged"
    assert cli.main(["merge", folders["finished LoRA run"], str(merged)]) == 0, capfd.readouterr().err[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in merged.iterdir()}
    assert [path.name for path in tmp_path.iterdir()] == ["merged"], "the folder written aside is left behind"
    model_folder.check_model(str(merged), "OUTPUT_DIR")


def test_held_out_scores_work_with_the_plain_llama_template_of_assistant_only_loss_false(folders):
    """Issue 27, item 5: with `--assistant_only_loss false` the tokenizer keeps Llama 3.2's plain template, which TRL
    cannot patch (get_training_chat_template raised); the scores count the same tokens as with the marked one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folders["base"])
    plain = model_loading.load_tokenizer(folders["base"], assistant_only_loss=False)
    marked = model_loading.load_tokenizer(folders["base"], assistant_only_loss=True)
    assert plain.chat_template != marked.chat_template
    scores = evaluation.score(model, plain, [CONVERSATION], max_new_tokens=2)
    assert scores["rows"] == 1
    assert evaluation.assistant_loss(model, plain, [CONVERSATION]) == evaluation.assistant_loss(model, marked, [CONVERSATION])
    plain.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert evaluation._training_chat_template(plain) is None  # unknown to TRL: the loss of the last turn instead


# Training from a damaged folder: refused in model.resolve_model_path, before the tokenizer and the model load
TRAINING_CASES = [
    ("training from a truncated safetensors", "truncated", ["model.safetensors is truncated", "re-download"]),
    ("training from an empty config.json", "empty config", ["config.json: empty", "re-download"]),
    ("training from a folder without weights", "no weights", ["holds no weights", "re-save"]),
    ("training from a folder missing a weight", "lost tensor", [f"holds no {Q_PROJ}", "random values"]),
    ("training from a weight of the wrong shape", "wrong shape", [f"{Q_PROJ} is stored as F32 [32, 64]"]),
    ("training from a weight stored as integers", "integer weights", [f"{Q_PROJ} is stored as I32"]),
    ("training from a header whose offsets overlap", "lying header", ["a header that does not fit its data"]),
    ("training from an adapter missing a tensor", "adapter missing a tensor", ["untrained initial value"]),
    ("training from an adapter in adapter_model.bin (`check` passed it, the load failed)", "pickled adapter",
     ["pickled-adapter: holds its adapter as adapter_model.bin only", "re-save the adapter"]),
    ("training from an adapter whose base is gone", "adapter without base",
     ["adapter_config.json: its base model cannot be loaded", "no such folder", "base_model_name_or_path"]),
    ("training from a stopped run", "stopped run", ["no complete final model", "checkpoint-1 instead"]),
    ("training from a ZeRO-3 run saved without the 16-bit gather", "zero3 run saved partitioned",
     ["holds DeepSpeed's partitioned ZeRO-3 checkpoint (global_step2) and no model weights", "relaunch"]),
    ("training from a hub id not cached offline", None, ["nobody/not-downloaded", "local cache", "--model_name_or_path"]),
]


@pytest.mark.parametrize("case", TRAINING_CASES, ids=[case[0] for case in TRAINING_CASES])
def test_training_from_a_bad_model_folder_is_one_sentence_before_loading(case, folders, tmp_path, capfd, monkeypatch):
    name, folder, expected_words = case
    model = folders[folder] if folder else "nobody/not-downloaded"
    arguments = ["--config", str(FULL), "--model_name_or_path", model, "--dataset_name", str(ROOT / "data" / "sample")]
    check_bad_input((name, lambda tmp: arguments, expected_words), tmp_path, capfd, monkeypatch)


# An MXFP4 checkpoint (the tiny GPT-OSS as the hub ships it) with one packed expert tensor stored wrong: each would load
# without a word or fail in a traceback (scales of one column broadcast by copy_, float blocks cast to uint8 zeros,
# transposed scales a RuntimeError); each is named from the safetensors headers on every path, before loading.
PACKED = "model.layers.0.mlp.experts.gate_up_proj"
MXFP4_DAMAGE = {
    "scales of one column": (f"{PACKED}_scales", lambda scales: scales[..., :1].contiguous()),
    "blocks stored as float32": (f"{PACKED}_blocks", lambda blocks: blocks.float()),
    "scales transposed": (f"{PACKED}_scales", lambda scales: scales.transpose(1, 2).contiguous()),
}


@pytest.fixture(scope="module")
def damaged_mxfp4(tmp_path_factory, tiny_model_cache) -> dict[str, tuple[str, str]]:
    """Per damage: the damaged checkpoint folder and the words its refusal names (the tensor, as stored, and the
    shape config.json implies)."""
    import safetensors.torch

    from benchmarks import mxfp4_checkpoints

    root = tmp_path_factory.mktemp("damaged-mxfp4")
    source = mxfp4_checkpoints.tiny_checkpoint()
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    built = {}
    for damage, (name, change) in MXFP4_DAMAGE.items():
        folder = copy_of(source, root / damage.replace(" ", "-"))
        shard = folder / index[name]
        tensors = safetensors.torch.load_file(str(shard))
        expected = list(tensors[name].shape)
        tensors[name] = change(tensors[name])
        safetensors.torch.save_file(tensors, str(shard), metadata={"format": "pt"})
        stored = f"{str(tensors[name].dtype).removeprefix('torch.').replace('float32', 'F32').replace('uint8', 'U8')}"
        built[damage] = (str(folder), [f"{name} is stored as {stored} {list(tensors[name].shape)}",
                                       f"implies U8 {expected}", "re-download"])
    return built


MXFP4_PATHS = {  # (the damaged folder, the module's folders, the test's tmp_path) -> `finetune` arguments
    "chat": lambda folder, folders, tmp: ["chat", folder],
    "generate": lambda folder, folders, tmp: ["generate", folder, "--prompts", folders["prompts"], "--out",
                                              str(tmp / "answers.jsonl")],
    "eval": lambda folder, folders, tmp: ["eval", folder, "--dataset_name", folders["rows"], "--report",
                                          str(tmp / "report.json")],
    "merge": lambda folder, folders, tmp: ["merge", folders["adapter"], str(tmp / "merged"), "--base_model", folder],
    "check": lambda folder, folders, tmp: ["check", "--config", str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"),
                                           "--model_name_or_path", folder],
}


@pytest.mark.parametrize("path", MXFP4_PATHS)
@pytest.mark.parametrize("damage", MXFP4_DAMAGE)
def test_a_packed_expert_tensor_stored_wrong_is_named_before_loading_by_every_command(damage, path, damaged_mxfp4,
                                                                                       folders, tmp_path, capfd):
    folder, expected_words = damaged_mxfp4[damage]
    line = refusal(MXFP4_PATHS[path](folder, folders, tmp_path), capfd)
    assert all(word in line for word in expected_words), (line, expected_words)


@pytest.mark.parametrize("dequantize", ["true", "false"])
@pytest.mark.parametrize("damage", MXFP4_DAMAGE)
def test_training_on_a_packed_expert_tensor_stored_wrong_is_one_sentence_before_loading(damage, dequantize,
                                                                                       damaged_mxfp4, tmp_path, capfd,
                                                                                       monkeypatch):
    folder, expected_words = damaged_mxfp4[damage]
    arguments = ["--config", str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"), "--model_name_or_path", folder,
                 "--dataset_name", str(ROOT / "data" / "sample"), "--dequantize_mxfp4", dequantize]
    check_bad_input((damage, lambda tmp: arguments, expected_words), tmp_path, capfd, monkeypatch)


# A scale byte whose block dequantizes to NaN or infinity: each trained without a word with the experts kept packed
# (uint8: the check after loading skips them; loss logged as 0, exit 0), was answered with "!!!" on a GPU, and merged
# into NaN weights; each is named from the file on every path, before loading.
NONFINITE_SCALES = {"scale byte 255 (NaN in MXFP4)": 255, "scale byte 254 (times 2 to 6 past bf16's range)": 254}


@pytest.fixture(scope="module")
def nonfinite_scales(tmp_path_factory, tiny_model_cache) -> dict[str, tuple[str, str]]:
    """Per case: the tiny MXFP4 checkpoint in shards of 16 kB (an expert weight's blocks and scales in two files) with
    the byte as one scale of layer 0's gate_up_proj, and the start of its refusal."""
    from benchmarks import mxfp4_checkpoints

    root = tmp_path_factory.mktemp("nonfinite-scales")
    built = {}
    for case, byte in NONFINITE_SCALES.items():
        folder = mxfp4_checkpoints.resharded(mxfp4_checkpoints.tiny_checkpoint(), root / str(byte), 16 << 10)
        index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
        assert index[f"{PACKED}_scales"] != index[f"{PACKED}_blocks"]
        with_tensors(lambda tensors: tensors[f"{PACKED}_scales"].view(-1)[5].fill_(byte),
                     index[f"{PACKED}_scales"])(folder)
        built[case] = (str(folder), f"{folder / index[f'{PACKED}_scales']}: {PACKED}_scales holds the scale byte {byte} (")
    return built


@pytest.mark.parametrize("path", MXFP4_PATHS)
@pytest.mark.parametrize("case", NONFINITE_SCALES)
def test_a_scale_byte_that_dequantizes_to_nan_or_infinity_is_named_before_loading_by_every_command(
        case, path, nonfinite_scales, folders, tmp_path, capfd):
    folder, named = nonfinite_scales[case]
    line = refusal(MXFP4_PATHS[path](folder, folders, tmp_path), capfd)
    assert named in line and "NaN or infinite values once dequantized" in line and "re-download" in line, line


@pytest.mark.parametrize("dequantize", ["true", "false"])
@pytest.mark.parametrize("case", NONFINITE_SCALES)
def test_training_on_a_scale_byte_that_dequantizes_to_nan_or_infinity_is_one_sentence_before_loading(
        case, dequantize, nonfinite_scales, tmp_path, capfd, monkeypatch):
    folder, named = nonfinite_scales[case]
    arguments = ["--config", str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"), "--model_name_or_path", folder,
                 "--dataset_name", str(ROOT / "data" / "sample"), "--dequantize_mxfp4", dequantize]
    check_bad_input((case, lambda tmp: arguments, [named, "re-download"]), tmp_path, capfd, monkeypatch)


OWN_CODE_PATHS = {**MXFP4_PATHS, "check": lambda folder, folders, tmp: [
    "check", "--config", str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"), "--model_name_or_path", folder]}


@pytest.mark.parametrize("path", OWN_CODE_PATHS)
def test_a_model_folder_that_needs_its_own_code_is_refused_and_its_code_never_runs(path, folders, tmp_path, capfd,
                                                                                     monkeypatch):
    """With trust_remote_code unset, transformers asked on stdin whether to run a folder's own code: a chat whose first
    line was "y" (`echo y | finetune chat FOLDER`) imported it. Every command refuses the folder in one sentence, and a
    load past the check (a config, a tokenizer) refuses instead of asking (patches.never_ask_to_run_remote_code)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, ran = folders["own code"], Path(folders["own code"]).parent / "code-ran"
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    line = refusal(OWN_CODE_PATHS[path](folder, folders, tmp_path), capfd)
    assert "config.json: `model_type: evilmodel` is unknown to transformers" in line, line
    assert "evil.EvilModel" in line and "finetune never runs" in line, line
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoConfig.from_pretrained(folder)
    AutoTokenizer.from_pretrained(folder)  # its own tokenizer class, read without the config it cannot build
    assert not ran.exists(), "the model folder's own code ran"


MXFP4_LOST = {  # the tensors taken out of the tiny MXFP4 checkpoint, and the one the sentence names
    "router": (["model.layers.0.mlp.router.weight"], "model.layers.0.mlp.router.weight"),
    "packed experts": (["model.layers.1.mlp.experts.down_proj_blocks", "model.layers.1.mlp.experts.down_proj_scales"],
                       "model.layers.1.mlp.experts.down_proj_blocks"),
}


@pytest.mark.parametrize("lost", MXFP4_LOST)
def test_an_mxfp4_checkpoint_missing_a_weight_is_named_before_loading(lost, folders, tmp_path, capfd):
    """GPT-OSS as it ships: a weight no shard holds (the packed experts with both their blocks and scales) is named
    as for any model, from the headers against config.json."""
    import safetensors.torch

    from benchmarks import mxfp4_checkpoints

    source = mxfp4_checkpoints.tiny_checkpoint()
    folder = copy_of(source, tmp_path / "mxfp4")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    names, named = MXFP4_LOST[lost]
    for name in names:
        tensors = safetensors.torch.load_file(str(folder / index[name]))
        del tensors[name]
        safetensors.torch.save_file(tensors, str(folder / index[name]), metadata={"format": "pt"})
    line = refusal(MXFP4_PATHS["check"](str(folder), folders, tmp_path), capfd)
    assert f"model.safetensors.index.json: lists no shard holding {named}, which transformers would fill" in line, line


@pytest.mark.launches
def test_the_console_command_reads_a_pipe_that_is_not_utf8_as_one_sentence(folders, tmp_path):
    """The real `finetune chat` with a byte that is not UTF-8 on its stdin, as `printf 'hi\\xff\\n' |` gives it."""
    with open(write_bytes(tmp_path / "latin1.txt", b"hi\xff\n"), "rb") as stdin:
        result = subprocess.run([FINETUNE, "chat", folders["base"], "--max_new_tokens", "2"], stdin=stdin,
                                capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.rstrip().endswith("error: stdin: line 1 is not UTF-8 text; send UTF-8 (convert with iconv -t "
                                           "UTF-8, or set the terminal's encoding to UTF-8).")
