"""Datasets: every source and format TRL trains on loads, splits are found or carved, and bad rows are named."""

import json

import pytest
from datasets import Dataset
from trl import ScriptArguments, SFTConfig

from finetune.data.load import load_datasets
from finetune.data.rows import check_rows
from finetune.errors import UserError
from tests.helpers import ROOT, launch_sft, printed_losses

CONVERSATION = [{"role": "user", "content": "Spell cat backwards."}, {"role": "assistant", "content": "tac"}]
ROWS = {
    "messages": [{"messages": CONVERSATION}] * 4,
    "prompt-completion": [{"prompt": "Spell cat backwards.", "completion": "tac"}] * 4,
    "conversational prompt-completion": [{"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:]}] * 4,
    "text": [{"text": "The cat sat."}] * 4,
}


def load(dataset_name: str, eval_strategy: str = "no"):
    training = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, eval_strategy=eval_strategy)
    return load_datasets(ScriptArguments(dataset_name=dataset_name), training)


def write_rows(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        Dataset.from_list(rows).to_csv(str(path), index=False)
    return path


@pytest.mark.parametrize("data_format", sorted(ROWS))
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_local_files_of_every_trl_format_load(tmp_path, data_format, suffix):
    train, evaluation = load(str(write_rows(tmp_path / f"rows{suffix}", ROWS[data_format])))
    assert len(train) == 4 and evaluation is None
    assert train[0] == ROWS[data_format][0]


def test_csv_file_of_text_rows_loads(tmp_path):
    train, _ = load(str(write_rows(tmp_path / "rows.csv", ROWS["text"])))
    assert train["text"][:] == ["The cat sat."] * 4


def test_folder_with_train_and_test_files_gives_both_splits():
    train, evaluation = load(str(ROOT / "data" / "sample"), eval_strategy="steps")
    assert (len(train), len(evaluation)) == (400, 42)


def test_eval_without_a_test_split_is_carved_from_train(tmp_path):
    rows = [{"messages": [CONVERSATION[0], {"role": "assistant", "content": f"answer {i}"}]} for i in range(40)]
    train, evaluation = load(str(write_rows(tmp_path / "rows.jsonl", rows)), eval_strategy="steps")
    assert (len(train), len(evaluation)) == (38, 2)
    assert {m[1]["content"] for m in train["messages"]}.isdisjoint({m[1]["content"] for m in evaluation["messages"]})


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"messages": []}, "empty `messages` list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ({"messages": [CONVERSATION[0], {"role": "assistant", "content": ""}]}, "turn 2 of `messages` (assistant) has empty content"),
        ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "hi"}]}, "assistant turn after 'system'"),
        ({"messages": CONVERSATION[:1]}, "no assistant turn"),
    ],
)
def test_bad_conversation_rows_are_named_with_their_number(row, problem):
    dataset = Dataset.from_list([{"messages": CONVERSATION}, row])
    with pytest.raises(UserError, match="row 2") as error:
        check_rows(dataset, "rows.jsonl")
    assert problem in str(error.value)


def test_empty_completion_is_refused():
    with pytest.raises(UserError, match="row 1 has an empty `completion`"):
        check_rows(Dataset.from_list([{"prompt": "Spell cat backwards.", "completion": " "}]), "rows.jsonl")


@pytest.mark.launches
def test_prompt_completion_rows_train_end_to_end(tmp_path):
    data_file = write_rows(tmp_path / "rows.jsonl", [
        {"prompt": [{"role": "user", "content": f"Count from {n} to {n + 3}."}],
         "completion": [{"role": "assistant", "content": " ".join(str(i) for i in range(n, n + 4))}]}
        for n in range(1, 60)
    ])
    result = launch_sft(
        "--config", str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml"), "--tiny", "--dataset_name", str(data_file),
        "--assistant_only_loss", "false", "--output_dir", str(tmp_path / "out"), "--max_steps", "20",
        "--learning_rate", "1e-2", "--eval_strategy", "no",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = printed_losses(result.stdout)
    assert losses[-1] < losses[0]
