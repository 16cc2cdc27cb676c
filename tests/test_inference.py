"""After training: `finetune chat | generate | eval` on a tiny Llama full model and a tiny GPT-OSS LoRA adapter, and
the held-out scores printed before and after training. Two short trainings, shared by every test here."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from finetune import cli
from finetune.checks.model_folder import ADAPTER_CONFIG
from finetune.models.tiny import build_tiny_tokenizer
from finetune.run import evaluation
from finetune.run import generation as inference
from tests.helpers import ROOT, launch_sft

# one worker: its trainings are a module fixture
pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_inference")]

RUNS = {
    "llama-full": ["--config", str(ROOT / "recipes/llama-3.2-1b/full.yaml")],
    "gpt-oss-lora": ["--config", str(ROOT / "recipes/gpt-oss-20b/lora.yaml")],
}
FAMILIES = {"llama-full": "llama", "gpt-oss-lora": "gpt-oss"}
PROMPTS = ["Count from 3 to 7.", "Repeat: red fish", "Spell cat backwards."]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_cache) -> dict[str, tuple[Path, str]]:
    """Each run's output folder and what it printed: 3 steps at a large learning rate, 4 held-out rows scored."""
    runs = {}
    for name, recipe in RUNS.items():
        output_dir = tmp_path_factory.mktemp(name) / "out"
        result = launch_sft(*recipe, "--tiny", "--output_dir", str(output_dir), "--max_steps", "3",
                            "--learning_rate", "1e-2", "--save_strategy", "no", "--eval_samples_before_after", "4",
                            launcher=[sys.executable])
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = (output_dir, result.stdout)
    return runs


def base_model(tiny_model_cache: Path, run: str) -> str:
    """The tiny model folder a run started from."""
    return str(next(tiny_model_cache.glob(f"{FAMILIES[run]}-*")))


@pytest.mark.parametrize("run", RUNS)
def test_training_prints_and_records_held_out_scores_before_and_after(trained, run):
    output_dir, stdout = trained[run]
    assert "[finetune] held-out scores, 4 eval rows:" in stdout
    assert "before training:" in stdout and "after training:" in stdout
    record = json.loads((output_dir / evaluation.SCORES_FILE).read_text())
    for when in ("before", "after"):
        assert set(record[when]) == {"rows", "loss", "perplexity", "exact_match", "token_f1"}
        assert record[when]["rows"] == 4
    assert record["after"]["loss"] < record["before"]["loss"]
    assert len(record["examples"]) == 4 and {"before training", "after training"} <= set(record["examples"][0])


@pytest.mark.parametrize("run", RUNS)
def test_chat_answers_each_stdin_line_keeps_the_conversation_and_resets(trained, run, monkeypatch, capsys):
    output_dir, _ = trained[run]
    seen = []
    original = PreTrainedTokenizerBase.apply_chat_template

    def recording(self, conversation, *args, **kwargs):
        if kwargs.get("add_generation_prompt"):
            seen.append([turn["content"] for turn in conversation])
        return original(self, conversation, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "apply_chat_template", recording)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPTS[0]}\n{PROMPTS[1]}\n/reset\n{PROMPTS[2]}\n/exit\nignored\n"))
    assert cli.main(["chat", str(output_dir), "--system", "Be concise.", "--temperature", "0"]) == 0
    answers = capsys.readouterr().out.split("\n")[:-1]
    assert len(answers) == 3
    assert seen[0] == ["Be concise.", PROMPTS[0]]
    assert seen[1] == ["Be concise.", PROMPTS[0], answers[0], PROMPTS[1]]  # the conversation is kept
    assert seen[2] == ["Be concise.", PROMPTS[2]]  # and /reset starts over
    assert len(seen) == 3  # /exit stops reading


def test_chat_is_scriptable_through_a_pipe_with_the_console_command(trained):
    output_dir, _ = trained["gpt-oss-lora"]
    finetune = str(Path(sys.executable).parent / "finetune")
    result = subprocess.run([finetune, "chat", str(output_dir), "--temperature", "0", "--max_new_tokens", "8"],
                            input=f"{PROMPTS[0]}\n", capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(result.stdout.split("\n")[:-1]) == 1
    assert "<|" not in result.stdout  # no special tokens, no GPT-OSS channel header


@pytest.mark.parametrize("run", RUNS)
def test_generate_writes_one_answer_per_prompt_the_same_in_a_padded_batch_as_alone(trained, run, tmp_path, capsys):
    output_dir, _ = trained[run]
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": PROMPTS[0]}, {"messages": [{"role": "user", "content": PROMPTS[1]},
                                                  {"role": "assistant", "content": "dropped"}]},
            {"prompt": [{"role": "system", "content": "Answer briefly, in as few words as you can."},
                        {"role": "user", "content": PROMPTS[2]}], "id": 7}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    batched, alone = tmp_path / "batched.jsonl", tmp_path / "alone.jsonl"
    assert cli.main(["generate", str(output_dir), "--prompts", str(prompts), "--out", str(batched),
                     "--max_new_tokens", "12"]) == 0
    assert cli.main(["generate", str(output_dir), "--prompts", str(prompts), "--out", str(alone),
                     "--max_new_tokens", "12", "--batch_size", "1"]) == 0
    written = [json.loads(line) for line in batched.read_text().splitlines()]
    assert [{key: value for key, value in row.items() if key != "answer"} for row in written] == rows
    assert all(isinstance(row["answer"], str) and "<|" not in row["answer"] for row in written)
    assert written == [json.loads(line) for line in alone.read_text().splitlines()]  # left padding changes nothing


def test_generate_reads_plain_text_prompts_one_per_line(trained, tmp_path):
    output_dir, _ = trained["llama-full"]
    prompts, out = tmp_path / "prompts.txt", tmp_path / "answers.jsonl"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    assert cli.main(["generate", str(output_dir), "--prompts", str(prompts), "--out", str(out),
                     "--max_new_tokens", "4"]) == 0
    assert [json.loads(line)["prompt"] for line in out.read_text().splitlines()] == PROMPTS[:2]


@pytest.mark.parametrize("run", RUNS)
def test_eval_compare_scores_the_trained_and_the_base_model_on_the_same_rows(trained, run, tmp_path, capsys,
                                                                            tiny_model_cache):
    output_dir, _ = trained[run]
    report = tmp_path / "report.json"
    base = base_model(tiny_model_cache, run)
    assert cli.main(["eval", str(output_dir), "--dataset_name", str(ROOT / "data/sample"), "--limit", "6",
                     "--compare", base, "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert f"[finetune] eval {output_dir}" in printed and "exact match" in printed
    scores = json.loads(report.read_text())["scores"]
    assert scores[str(output_dir)]["rows"] == scores[base]["rows"] == 6
    assert scores[str(output_dir)]["loss"] < scores[base]["loss"]
    examples = json.loads(report.read_text())["examples"]
    assert len(examples) == 6 and {"prompt", "reference", str(output_dir), base} == set(examples[0])


@pytest.mark.parametrize("run", RUNS)
def test_eval_loss_counts_the_tokens_sft_trains_on_and_nothing_else(trained, run):
    output_dir, _ = trained[run]
    _, tokenizer = inference.load_trained(str(output_dir))
    turns = [{"role": "user", "content": PROMPTS[1]}, {"role": "assistant", "content": "red fish"}]
    _, labels = evaluation._labelled(tokenizer, turns, evaluation._training_chat_template(tokenizer))
    trained_on = tokenizer.decode([token for token in labels if token != -100])
    assert trained_on.startswith(("red fish", "<|start|>assistant<|channel|>final<|message|>red fish"))
    assert trained_on.endswith(tokenizer.eos_token) and PROMPTS[1] not in trained_on


def test_answer_text_shows_only_gpt_oss_final_channel_and_no_special_tokens():
    tokenizer = build_tiny_tokenizer("gpt-oss")
    generated = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>3 4 5<|return|>"
    ids = tokenizer(generated + "<|endoftext|><|endoftext|>", add_special_tokens=False)["input_ids"]
    assert inference.answer_text(tokenizer, ids) == "3 4 5"
    assert inference.answer_text(tokenizer, generated.split("<|start|>")[0], complete=False) == ""


def test_token_f1_and_exact_match_against_the_reference():
    assert evaluation.token_f1("3 4 5", "3 4 5") == 1.0
    assert evaluation.token_f1("3 4", "3 4 5 6") == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert evaluation.token_f1("", "3") == 0.0


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["chat", "no/such/folder"], "no/such/folder: no such folder"),
        (["generate", "{empty}", "--prompts", "{prompts}", "--out", "x.jsonl"], "holds neither a model"),
        (["chat", "{adapter}"], "names no base model (base_model_name_or_path); pass --base MODEL."),
        (["generate", "{adapter}", "--prompts", "{bad}", "--out", "x.jsonl"], "line 2 has no `messages` or `prompt`"),
        (["generate", "{adapter}", "--prompts", "missing.jsonl", "--out", "x.jsonl"], "prompts file not found"),
        (["eval", "{adapter}", "--base", "x", "--dataset_name", "{prompts}"], "map yours onto one of them with `columns:`"),
    ],
)
def test_user_mistakes_are_one_error_line_and_exit_2(arguments, message, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    paths = {name: str(tmp_path / file) for name, file in
             {"empty": "empty", "adapter": "adapter", "prompts": "prompts.jsonl", "bad": "bad.jsonl"}.items()}
    assert cli.main([argument.format(**paths) for argument in arguments]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("name, text", [
    ("prompts.json", json.dumps([{"prompt": "Repeat: red fish"}, {"messages": [{"role": "user", "content": "Hi"}]}])),
    ("prompts.JSONL", '{"prompt": "Repeat: red fish"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n'),
    ("bom.jsonl", '\ufeff{"prompt": "Repeat: red fish"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n'),
])
def test_prompts_in_json_of_any_spelling_are_read_as_rows_not_as_lines_of_text(name, text, tmp_path):
    """A .json list (or .JSONL, or a file with a BOM) was read as lines of text, each line answered as a prompt."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    conversations = [turns for _, turns in inference.read_prompts(str(path))]
    assert conversations == [[{"role": "user", "content": "Repeat: red fish"}], [{"role": "user", "content": "Hi"}]]


def test_a_model_trained_with_flex_attention_generates_with_eager_and_gets_its_attention_back():
    """inductor has no flex-attention decoding kernel for GPT-OSS's sinks (torch 2.11, H200): the held-out scores
    stopped the GPT-OSS recipe before step 1. Generation runs eager; training continues with flex."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from finetune.models.tiny import build_tiny_tokenizer, tiny_config
    from finetune.run.generation import attention_for_generation

    model = AutoModelForCausalLM.from_config(tiny_config("gpt-oss", build_tiny_tokenizer("gpt-oss")),
                                             attn_implementation="flex_attention")
    adapted = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    with attention_for_generation(adapted):
        assert model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == "flex_attention"
