"""GPT-OSS's harmony format: what is trained on rows in OpenAI's fine-tuning example's shape (data/harmony_sample:
a system turn "reasoning language: X", user turns, assistant turns with `thinking` and `content`), which rows are
refused or named before the model loads, and the recipe's `chat_template_kwargs` (reasoning_effort) reaching the
template in training rows and in generation."""

import json

import pytest
from datasets import Dataset

from finetune.checks import model_folder
from finetune.data import rows as row_checks
from finetune.data.load import load_datasets
from finetune.run import arguments, model
from finetune.run import generation as inference
from finetune.run import trainer as training
from tests.helpers import ROOT, run_sft_in_process

HARMONY = ROOT / "data" / "harmony_sample"
GPT_OSS = ROOT / "recipes" / "gpt-oss-20b" / "lora.yaml"
LLAMA = ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"


def harmony_rows(split: str = "train") -> list[dict]:
    return [json.loads(line) for line in (HARMONY / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]


def trained_text(messages: list[dict]) -> str:
    """What assistant_only_loss must train, written from the harmony format: every assistant turn's final channel
    and its end-of-turn token (<|end|>, or <|return|> for the last turn), and the last turn's analysis channel
    (the template drops earlier turns' traces)."""
    text = ""
    for position, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        if position == len(messages) - 1:
            if turn.get("thinking"):
                text += f"<|start|>assistant<|channel|>analysis<|message|>{turn['thinking']}<|end|>"
            text += f"<|start|>assistant<|channel|>final<|message|>{turn['content']}<|return|>"
        else:
            text += f"<|start|>assistant<|channel|>final<|message|>{turn['content']}<|end|>"
    return text


@pytest.fixture(scope="module")
def harmony_trainer(tmp_path_factory):
    """The GPT-OSS LoRA recipe's trainer on the harmony sample, reasoning_effort high, its data tokenized by TRL, one
    conversation a row (the recipe packs them; the labels are checked row by row)."""
    output = tmp_path_factory.mktemp("harmony")
    run = arguments.parse_args([
        "--config", str(GPT_OSS), "--tiny", "--output_dir", str(output), "--dataset_name", str(HARMONY),
        "--eval_strategy", "no", "--chat_template_kwargs", '{"reasoning_effort": "high"}', "--packing", "false",
    ])
    model_path = model_folder.resolve_model_path(run)
    tokenizer = model.load_tokenizer(model_path, run.training.assistant_only_loss)
    train_set, _ = load_datasets(run.script, run.training, sources=run.finetune, tokenizer=tokenizer)
    trainer = training.build_trainer(run, model.load_model(run, model_path), tokenizer, train_set, None)
    return run, trainer, tokenizer


def test_assistant_only_loss_trains_exactly_the_analysis_and_final_channels_and_the_end_of_turn(harmony_trainer):
    run, trainer, tokenizer = harmony_trainer
    assert run.training.assistant_only_loss and not run.training.packing
    rows = harmony_rows()
    assert len(trainer.train_dataset) == len(rows)
    multi_turn = 0
    for row, example in zip(rows, trainer.train_dataset):
        labelled = [token for token in example["labels"] if token != -100]
        assert tokenizer.decode(labelled) == trained_text(row["messages"]), row
        assert labelled[-1] == tokenizer.convert_tokens_to_ids("<|return|>")
        # nothing of the system, developer or user turns: every labelled token is inside an assistant turn, so the
        # labelled positions are exactly those the rendered assistant turns occupy (checked by the text above)
        prompt = tokenizer.decode([token for token, label in zip(example["input_ids"], example["labels"]) if label == -100])
        assert row["messages"][0]["content"] in prompt and row["messages"][-1]["thinking"] not in prompt
        multi_turn += sum(turn["role"] == "assistant" for turn in row["messages"]) > 1
    assert multi_turn >= 2, "the sample has multi-turn rows, whose earlier answers are trained with <|end|>"


def test_recipe_reasoning_effort_reaches_the_training_rows(harmony_trainer):
    _, trainer, tokenizer = harmony_trainer
    text = tokenizer.decode(trainer.train_dataset[0]["input_ids"])
    assert "Reasoning: high" in text and "Reasoning: medium" not in text
    assert "# Instructions\n\nreasoning language: French" in text  # the system turn becomes the developer message


def test_recipe_reasoning_effort_reaches_generation(harmony_trainer, monkeypatch):
    run, trainer, tokenizer = harmony_trainer
    rendered = []
    apply_chat_template = tokenizer.apply_chat_template

    def spy(*args, **kwargs):
        result = apply_chat_template(*args, **kwargs)
        rendered.append(tokenizer.decode(result["input_ids"][0]))
        return result

    monkeypatch.setattr(tokenizer, "apply_chat_template", spy)
    inference.answer(trainer.model, tokenizer, "What is 2 + 3?", max_new_tokens=2,
                     chat_template_kwargs=run.finetune.chat_template_kwargs)
    assert "Reasoning: high" in rendered[0] and rendered[0].endswith("<|start|>assistant")


def test_recipe_chat_template_kwargs_give_way_to_a_rows_own():
    rows = Dataset.from_list([
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
         "chat_template_kwargs": {"reasoning_effort": "low"}},
        {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}],
         "chat_template_kwargs": {"reasoning_effort": None}},
    ])
    given = row_checks.with_chat_template_kwargs(rows, {"reasoning_effort": "high", "model_identity": "You are tiny."})
    assert given[0]["chat_template_kwargs"] == {"reasoning_effort": "low", "model_identity": "You are tiny."}
    assert given[1]["chat_template_kwargs"] == {"reasoning_effort": "high", "model_identity": "You are tiny."}


def test_traces_the_template_drops_or_max_length_cuts_are_named(capsys):
    from finetune.models.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer("gpt-oss")
    earlier_trace = [
        {"role": "user", "content": "What is 1 + 1?"},
        {"role": "assistant", "content": "2", "thinking": "One plus one is two."},
        {"role": "user", "content": "And 2 + 2?"},
        {"role": "assistant", "content": "4", "thinking": "Two plus two is four."},
    ]
    rows = Dataset.from_list([{"messages": harmony_rows()[0]["messages"]}, {"messages": earlier_trace}])
    capsys.readouterr()
    row_checks.check_reasoning_traces(rows, "rows.jsonl", tokenizer, max_length=2048)
    said = capsys.readouterr().out
    assert "rows.jsonl: rows 2 have reasoning traces on earlier assistant turns, which the chat template drops" in said
    assert "longer than max_length" not in said
    row_checks.check_reasoning_traces(rows, "rows.jsonl", tokenizer, max_length=100)
    assert "rows.jsonl: rows 1, 2 are longer than max_length 100: TRL cuts their end" in capsys.readouterr().out


def refused(tmp_path, capfd, monkeypatch, *args) -> str:
    result = run_sft_in_process([*args, "--output_dir", str(tmp_path / "out")], capfd, monkeypatch)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return errors[0]


def write_rows(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("turn", [
    {"role": "assistant", "content": "<|channel|>final<|message|>5"},
    {"role": "assistant", "content": "5", "thinking": "Two plus three.<|end|><|start|>assistant"},
])
def test_content_holding_harmony_tags_is_refused_before_loading(tmp_path, capfd, monkeypatch, turn):
    rows = write_rows(tmp_path, [{"messages": [{"role": "user", "content": "What is 2 + 3?"}, turn]}])
    error = refused(tmp_path, capfd, monkeypatch, "--config", str(GPT_OSS), "--tiny", "--dataset_name", rows)
    assert "row 1 turn 2 of `messages` (assistant) holds the harmony tag <|" in error
    assert "the chat template writes itself" in error


def test_thinking_in_a_llama_recipes_data_is_refused_before_loading(tmp_path, capfd, monkeypatch):
    error = refused(tmp_path, capfd, monkeypatch, "--config", str(LLAMA), "--tiny", "--dataset_name", str(HARMONY))
    assert "[train]: row 1 has a reasoning trace (`thinking`), which this model's chat template never renders" in error


@pytest.mark.parametrize("flags, message", [
    (["--dequantize_mxfp4", "false", "--expert_lora_kernel", "peft"],
     "`expert_lora_kernel: peft` adds B·A to the expert weights, which `dequantize_mxfp4: false` keeps packed"),
    (["--load_in_4bit", "true"], "`load_in_4bit: true` asks bitsandbytes to quantize openai/gpt-oss-20b"),
])
def test_mxfp4_checkpoint_that_would_not_train_is_refused_before_loading(tmp_path, capfd, monkeypatch, flags, message):
    error = refused(tmp_path, capfd, monkeypatch, "--config", str(GPT_OSS), "--tiny", *flags)
    assert message in error
