"""Bad input ends in one sentence naming the file, the field and the fix, before any model is loaded, with exit code 2,
no traceback, and nothing already in the output folder touched."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ACCELERATE, ROOT, free_port, run_sft_in_process

LLAMA_FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"
LLAMA_LORA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"
QLORA = ROOT / "recipes" / "llama-3.2-3b" / "qlora.yaml"


def run_sft(*args: str, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*launcher, str(ROOT / "scripts" / "sft.py"), *args],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ.copy(),
    )


def folder_digest(folder: Path) -> dict:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.rglob("*") if path.is_file()}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def recipe_with(tmp_path: Path, base: Path, extra: str) -> Path:
    return write(tmp_path / "recipe.yaml", base.read_text() + "\n" + extra + "\n")


def dataset_file(tmp_path: Path, rows: list) -> Path:
    return write(tmp_path / "rows.jsonl", "".join(json.dumps(row) + "\n" for row in rows))


def good_turns(answer: str = "cold") -> list:
    return [{"role": "user", "content": "What is the opposite of hot?"}, {"role": "assistant", "content": answer}]


# Each case: (name, function of tmp_path giving the arguments, the words the error sentence must hold).
BAD_INPUTS = [
    ("unknown recipe key", lambda tmp: ["--config", str(recipe_with(tmp, LLAMA_FULL, "lerning_rate: 0.1"))],
     ["recipe.yaml", "unknown key `lerning_rate`", "spelling"]),
    ("wrong value type in recipe", lambda tmp: ["--config", str(recipe_with(tmp, LLAMA_LORA, "lora_r: sixteen"))],
     ["recipe.yaml", "`lora_r: sixteen`", "not a valid int"]),
    ("missing recipe file", lambda tmp: ["--config", str(tmp / "nope.yaml")],
     ["nope.yaml", "not found", "--config"]),
    ("broken recipe YAML", lambda tmp: ["--config", str(write(tmp / "broken.yaml", "model_name_or_path: [a, b\n"))],
     ["broken.yaml", "not valid YAML", "line"]),
    ("unknown command-line flag", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--learning_rat", "1"],
     ["command line", "--learning_rat", "spelling"]),
    ("missing dataset file", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--dataset_name", str(tmp / "gone.jsonl")],
     ["gone.jsonl", "not found", "--dataset_name"]),
    ("dataset with no usable column", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--dataset_name",
                                                   str(dataset_file(tmp, [{"question": "a", "answer": "b"}]))],
     ["rows.jsonl", "['question', 'answer']", "`messages`"]),
    ("empty assistant turn", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--dataset_name",
                                          str(dataset_file(tmp, [{"messages": good_turns()}, {"messages": good_turns("  ")}]))],
     ["rows.jsonl", "row 2", "turn 2", "assistant", "empty content"]),
    ("conversation without an assistant turn", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--dataset_name",
                                                            str(dataset_file(tmp, [{"messages": good_turns()[:1]}]))],
     ["rows.jsonl", "row 1", "no assistant turn"]),
    ("LoRA flag on a full fine-tuning recipe", lambda tmp: ["--config", str(LLAMA_FULL), "--tiny", "--lora_r", "8"],
     ["full.yaml", "`lora_r`", "use_peft"]),
    ("expert LoRA on a model without experts",
     lambda tmp: ["--config", str(LLAMA_LORA), "--tiny", "--lora_target_parameters", "mlp.experts.gate_up_proj"],
     ["lora.yaml", "lora_target_parameters", "mixture-of-experts"]),
    ("QLoRA without LoRA", lambda tmp: ["--config", str(QLORA), "--tiny", "--use_peft", "false"],
     ["qlora.yaml", "load_in_4bit", "use_peft: true"]),
    ("missing local model folder", lambda tmp: ["--config", str(LLAMA_FULL), "--model_name_or_path", str(tmp / "no-model")],
     ["no-model", "not found", "--model_name_or_path"]),
]


@pytest.mark.parametrize("build_args, expected_words", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_clear_sentence_before_any_model_loads(tmp_path, build_args, expected_words, capfd, monkeypatch):
    output_dir = tmp_path / "out"
    result = run_sft_in_process([*build_args(tmp_path), "--output_dir", str(output_dir)], capfd, monkeypatch)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ")
    for word in expected_words:
        assert word in last_line, f"{word!r} missing from: {last_line}"
    assert "Loading weights" not in result.stderr + result.stdout
    assert not output_dir.exists(), "a refused run writes nothing"


def test_a_refusal_in_a_real_process_is_one_line_and_exit_code_2(tmp_path):
    result = run_sft("--config", str(LLAMA_FULL), "--tiny", "--learning_rat", "1", "--output_dir", str(tmp_path / "out"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: command line: unknown flag --learning_rat; check its spelling with `scripts/sft.py --help`.")


def test_output_dir_holding_foreign_files_is_refused_and_left_untouched(tmp_path, capfd, monkeypatch):
    output_dir = tmp_path / "out"
    write(output_dir / "model.safetensors", "someone else's weights")
    write(output_dir / "notes" / "readme.txt", "keep me")
    before = folder_digest(output_dir)
    result = run_sft_in_process(["--config", str(LLAMA_FULL), "--tiny", "--output_dir", str(output_dir)], capfd, monkeypatch)
    assert result.returncode == 2
    assert str(output_dir) in result.stderr and "no finetune run wrote" in result.stderr and "--output_dir" in result.stderr
    assert folder_digest(output_dir) == before


def test_output_dir_of_another_run_is_refused_and_left_untouched(tmp_path, capfd, monkeypatch):
    output_dir = tmp_path / "out"
    first = run_sft("--config", str(LLAMA_LORA), "--tiny", "--output_dir", str(output_dir), "--max_steps", "1",
                    "--eval_strategy", "no", "--report_to", "none")
    assert first.returncode == 0, first.stderr[-2000:]
    before = folder_digest(output_dir)
    second = run_sft_in_process(["--config", str(LLAMA_FULL), "--tiny", "--output_dir", str(output_dir)], capfd, monkeypatch)
    assert second.returncode == 2
    assert "holds another run (use_peft was True, now False)" in second.stderr
    assert folder_digest(output_dir) == before


def test_qlora_under_a_sharding_config_is_refused_by_the_real_launcher(tmp_path):
    result = run_sft(
        "--config", str(QLORA), "--tiny", "--output_dir", str(tmp_path / "out"),
        launcher=(ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / "fsdp.yaml"),
                  "--num_processes", "2", "--main_process_port", str(free_port())),
    )
    assert result.returncode != 0
    assert "error: " in result.stderr and "fsdp.yaml: QLoRA's 4-bit weights cannot be sharded by FSDP" in result.stderr
    assert "accelerate_configs/ddp.yaml" in result.stderr
    assert "Loading weights" not in result.stderr + result.stdout


def test_on_cpu_the_recipe_compiles_nothing_unless_the_command_line_asks_and_the_warning_says_which(caplog):
    from finetune.config import parse_args

    recipe = str(ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml")
    with caplog.at_level("WARNING", logger="finetune.cpu"):
        assert not parse_args(["--config", recipe, "--tiny"]).training.torch_compile
    assert "'torch_compile': False" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="finetune.cpu"):
        assert parse_args(["--config", recipe, "--tiny", "--torch_compile", "true"]).training.torch_compile
    assert "No GPU" in caplog.text and "torch_compile" not in caplog.text
