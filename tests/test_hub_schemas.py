"""Datasets as the hub serves them (tests/data/external/datasets/, rows written in each dataset's published schema)
train the conversation they hold (preference rows: their chosen side) or are refused naming their columns and the
mapping to write; alignment-handbook's `dataset_mixture` reads as the handbook writes it; rows whose answer truncation
cuts away are counted before any model loads; and the columns TRL sees do not depend on the hash seed. No test here
loads a model."""

import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from trl import ScriptArguments, SFTConfig

from finetune.data.load import load_datasets
from finetune.errors import UserError
from finetune.models.tiny import build_tiny_tokenizer
from finetune.run.arguments import FinetuneArguments
from tests.helpers import ROOT, write
from tests.test_bad_inputs import TINY, check_bad_input, data, good_turns, rows_file

DATASETS = ROOT / "tests" / "data" / "external" / "datasets"
ZEPHYR = ROOT / "tests" / "data" / "external" / "recipes" / "alignment-handbook" / "zephyr-7b-beta" / "sft" / (
    "config_full.yaml")
FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


LONG_PROMPT = {"messages": [user("count " * 80), assistant("done")]}  # a prompt of over 64 tiny-tokenizer tokens


def load(name, split="train", eval_strategy="no", record=None, tokenizer=None, max_length=1024, **sources):
    training = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, eval_strategy=eval_strategy, seed=3,
                         max_length=max_length)
    script = ScriptArguments(dataset_name=str(name) if name else None, dataset_train_split=split)
    return load_datasets(script, training, sources=FinetuneArguments(**sources), record=record, tokenizer=tokenizer)


# (file, split, rows it yields, the row checked, that row as TRL gets it: only its format's columns)
HUB_ROWS = [
    ("ultrachat_200k", "train_sft", 3, 0, {"messages": [
        user("How do bees find their way back to the hive?"),
        assistant("Bees use the sun's position, landmarks and the smell of the hive to find their way home."),
        user("Do they get lost on cloudy days?"),
        assistant("Rarely: they sense polarized light through the clouds and still read the sun's position.")]}),
    ("tatsu-lab_alpaca.jsonl", "train", 3, 1, {"messages": [
        user("Translate the sentence into French.\n\nThe cat is black."), assistant("Le chat est noir.")]}),
    ("yahma_alpaca-cleaned.jsonl", "train", 3, 1, {"messages": [
        user("Square each number in the list.\n\n2, 3, 4"), assistant("4, 9, 16")]}),
    ("LDJnr_Capybara.jsonl", "train", 3, 0, {"messages": [
        user("Which planet is known as the Red Planet?"), assistant("Mars, for the iron oxide on its surface."),
        user("How long is a day there?"), assistant("About 24 hours and 37 minutes.")]}),
    ("teknium_OpenHermes-2.5.jsonl", "train", 3, 1, {"messages": [
        system("You are an AI assistant. Answer briefly."), user("Is water wet?"),
        assistant("Water makes other things wet.")]}),
    ("sharegpt_vicuna_unfiltered.jsonl", "train", 3, 2, {"messages": [
        system("Reply in French."), user("Good morning"), assistant("Bonjour")]}),
    ("sharegpt_items.jsonl", "train", 3, 0, {"messages": [
        user("What does HTTP stand for?"), assistant("HyperText Transfer Protocol.")]}),
    ("sharegpt_conversation.jsonl", "train", 3, 0, {"messages": [
        system("Be terse."), user("Largest ocean?"), assistant("The Pacific.")]}),
    # each tree's top-ranked path; the rank-1 and the deleted replies are left out
    ("OpenAssistant_oasst1.jsonl", "train", 2, 0, {"messages": [
        user("Can you explain what a black hole is?"),
        assistant("A black hole is a place where gravity pulls so hard that not even light can get out."),
        user("How do they form?"), assistant("Most form when a massive star collapses at the end of its life.")]}),
    ("databricks_databricks-dolly-15k.jsonl", "train", 3, 0, {"messages": [
        user("When did the Eiffel Tower open?\n\nThe Eiffel Tower opened on 31 March 1889 for the World's Fair in "
             "Paris."),
        assistant("It opened on 31 March 1889.")]}),
    ("trl-lib_tldr.jsonl", "train", 3, 2, {
        "prompt": "SUBREDDIT: r/gardening\n\nTITLE: Tomatoes split\n\nPOST: After a week of rain half my tomatoes "
                  "cracked open.\n\nTL;DR:", "completion": " Heavy rain split my tomatoes."}),
    ("trl-internal-testing_zen_conversational_prompt_completion.jsonl", "train", 3, 0, {
        "prompt": [user("What is better than ugly?")], "completion": [assistant("Beautiful.")]}),
    # preference rows train their chosen side, as alignment-handbook's SFT recipes do
    ("trl-lib_ultrafeedback_binarized.jsonl", "train", 3, 1, {"messages": [
        user("What is 7 times 6?"), assistant("7 times 6 is 42.")]}),
    ("trl-internal-testing_zen_standard_preference.jsonl", "train", 3, 0, {
        "prompt": "Beautiful is better than", "completion": " ugly."}),
    ("trl-internal-testing_zen_conversational_preference.jsonl", "train", 3, 2, {
        "prompt": [user("What is better than complex?")], "completion": [assistant("Simple.")]}),
    ("Anthropic_hh-rlhf.jsonl", "train", 3, 1, {
        "text": "\n\nHuman: What is the capital of Italy?\n\nAssistant: Rome."}),
]


@pytest.mark.parametrize("name, split, count, index, expected", HUB_ROWS, ids=[case[0] for case in HUB_ROWS])
def test_a_hub_dataset_trains_the_conversation_it_holds(name, split, count, index, expected):
    train, _ = load(DATASETS / name, split)
    assert len(train) == count
    assert train.column_names == list(expected)
    assert train[index] == expected


PREFERENCE_DATASETS = ["trl-lib_ultrafeedback_binarized.jsonl", "trl-internal-testing_zen_standard_preference.jsonl",
                       "trl-internal-testing_zen_conversational_preference.jsonl", "Anthropic_hh-rlhf.jsonl"]


def strings(value) -> list[str]:
    """Every text a row holds, however nested."""
    if isinstance(value, str):
        return [value]
    values = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [text for item in values for text in strings(item)]


def answer(side) -> str:
    """A preference row's answer on one side: its last turn's content, or the text."""
    return side[-1]["content"] if isinstance(side, list) else side


@pytest.mark.parametrize("name", PREFERENCE_DATASETS)
def test_preference_rows_train_every_chosen_answer_and_no_rejected_one_and_say_so(name, capsys):
    path = DATASETS / name
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    train, _ = load(path)
    trained = strings(train.to_list())
    assert all(any(answer(row["chosen"]) in text for text in trained) for row in rows)
    assert not any(answer(row["rejected"]) in text for row in rows for text in trained)
    said = [line for line in capsys.readouterr().out.splitlines() if "preference rows" in line]
    assert len(said) == 1 and said[0].startswith(f"[finetune] {path} [train]: preference rows (`chosen` and "
                                                 f"`rejected`) found; training on ")
    assert "`rejected` dropped" in said[0]


def emptied(side):
    """A preference row's side with its answer emptied."""
    return [*side[:-1], {**side[-1], "content": ""}] if isinstance(side, list) else ""


@pytest.mark.parametrize("name", PREFERENCE_DATASETS)
def test_a_bad_preference_row_is_named_by_its_chosen_column_and_removed_as_told_the_rest_trains(name, tmp_path):
    """The chosen side reaches TRL renamed (`messages`, `completion` or `text`), but the refusal names the column the
    file has, and its fix, followed literally, loads."""
    rows = [json.loads(line) for line in (DATASETS / name).read_text().splitlines()]
    rows[1]["chosen"] = emptied(rows[1]["chosen"])
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(UserError) as refused:
        load(path)
    said = str(refused.value)
    assert "row 2" in said and "`chosen`" in said and "remove the row" in said, said
    assert not any(f"`{column}`" in said for column in ("messages", "prompt", "completion", "text")), said
    path.write_text("".join(json.dumps(row) + "\n" for number, row in enumerate(rows, start=1) if number != 2))
    train, _ = load(path)
    assert len(train) == len(rows) - 1


def test_preference_rows_mapped_as_their_refusal_says_train_each_chosen_answer_after_its_question():
    """Intel/orca_dpo_pairs holds its prompt as `question`: the refusal names the mapping, which, written as told,
    trains the chosen answers."""
    path = DATASETS / "Intel_orca_dpo_pairs.jsonl"
    with pytest.raises(UserError) as refused:
        load(path)
    columns = yaml.safe_load(re.search(r"e\.g\. columns: (\{[^}]*\})", str(refused.value)).group(1))
    train, _ = load(path, columns=columns)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert train.to_list() == [{"prompt": row["question"], "completion": row["chosen"]} for row in rows]


@pytest.mark.launches
def test_the_columns_trl_sees_are_the_same_whatever_the_hash_seed():
    """TRL tells a row's format apart with `set.pop()` over its columns (trl.data_utils.is_conversational):
    ultrachat_200k's `prompt` beside `messages` made a run's outcome depend on PYTHONHASHSEED, so only the
    conversation reaches TRL, under any seed (the conversion alone, without torch or trl, keeps this quick)."""
    probe = ("from datasets import load_dataset\nfrom finetune.data.formats import to_trl_format\n"
             f"rows = load_dataset({str(DATASETS / 'ultrachat_200k')!r})['train_sft']\n"
             "print('columns', to_trl_format(rows, 'ultrachat_200k')[0].column_names)\n")
    runs = [subprocess.Popen([sys.executable, "-c", probe], cwd=ROOT, env={**os.environ, "PYTHONHASHSEED": seed},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for seed in ("1", "2")]
    seen = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
        seen.append(next(line for line in out.splitlines() if line.startswith("columns")))
    assert seen == ["columns ['messages']"] * 2


def test_alignment_handbook_dataset_mixture_is_read_as_written_there(capsys):
    """zephyr-7b-beta's mixture as published (ids, `config: default`, `split`, `columns: [messages]`, `weight`,
    `seed`, a test set counted in rows), its ids pointed at the local ultrachat_200k rows and 2 test rows asked."""
    mixture = yaml.safe_load(ZEPHYR.read_text())["dataset_mixture"]
    for entry in mixture["datasets"]:
        entry["id"] = str(DATASETS / "ultrachat_200k")
    mixture["test_split_size"] = 2
    record = {}
    train, test = load(None, eval_strategy="steps", record=record, dataset_mixture=mixture)
    source = str(DATASETS / "ultrachat_200k")
    # train_sft's 3 rows and test_sft's 2 both train; the 2 test rows are shared between them in proportion
    assert record == {"train": {f"{source} [train_sft]": 2, f"{source} [test_sft]": 1},
                      "test": {f"{source} [train_sft]": 1, f"{source} [test_sft]": 1}, "seed": 0}
    assert (len(train), len(test)) == (3, 2)
    assert train.column_names == ["messages"] == test.column_names
    assert "alignment-handbook's schema" in capsys.readouterr().out


def test_alignment_handbook_weight_keeps_that_share_of_each_dataset(tmp_path):
    rows = [{"messages": good_turns(f"answer {index}"), "id": index} for index in range(10)]
    ten, two = rows_file(tmp_path, rows, "ten.jsonl"), rows_file(tmp_path, rows[:2], "two.jsonl")
    record = {}
    train, _ = load(None, record=record, dataset_mixture={"seed": 7, "datasets": [
        {"id": str(ten), "columns": ["messages"], "weight": 0.3}, {"id": str(two), "split": "train"}]})
    assert record["train"] == {f"{ten} [train]": 3, f"{two} [train]": 2}
    assert train.column_names == ["messages"]


@pytest.mark.parametrize("mixture, named", [
    ({"datasets": [{"id": "a.jsonl", "weight": 1.5}]}, "`weight: 1.5`; give a number above 0 and at most 1"),
    ({"datasets": [{"id": "a.jsonl"}, {"path": "b.jsonl"}]}, "mixes TRL's entries (`path:`, `fraction:`) with"),
    ({"datasets": [{"id": "a.jsonl", "fraction": 0.5}]}, "`fraction` is TRL's, whose entries start with `path:`"),
    ({"datasets": [{"id": "a.jsonl", "columns": "messages"}]}, "`columns` must be a mapping"),
    ({"datasets": [{"id": "a.jsonl"}], "test_split_size": 0}, "`test_split_size: 0`"),
])
def test_a_malformed_handbook_mixture_is_refused_before_anything_loads(mixture, named):
    with pytest.raises(UserError, match=re.escape(named)):
        load(None, dataset_mixture=mixture)


def test_rows_whose_answer_truncation_cuts_away_are_counted_before_loading(tmp_path, capsys):
    rows = rows_file(tmp_path, [{"messages": good_turns()}, LONG_PROMPT, {"messages": good_turns()}, LONG_PROMPT])
    tokenizer = build_tiny_tokenizer("llama")
    capsys.readouterr()
    train, _ = load(rows, tokenizer=tokenizer, max_length=64)
    assert len(train) == 4
    warnings = [line for line in capsys.readouterr().out.splitlines() if "lose their whole answer" in line]
    assert warnings == [(f"[finetune] {rows} [train]: 2 of 4 rows lose their whole answer to truncation at max_length "
                         f"64 (rows 2, 4): their prompt alone fills it, so they teach no answer; raise max_length or "
                         f"shorten those rows.")]
    load(rows, tokenizer=tokenizer, max_length=4096)
    assert "lose their whole answer" not in capsys.readouterr().out


OASST_ROOT = json.loads((DATASETS / "OpenAssistant_oasst1.jsonl").read_text().splitlines()[0])
# (name, arguments (a function of tmp_path), words the one error sentence must hold): through scripts/sft.py
HUB_REFUSALS = [
    ("hub rows in no format (gsm8k) name the columns and the mapping to write",
     lambda t: data(t, [{"question": "2 + 2?", "answer": "4"}]),
     ["rows.jsonl", "['question', 'answer']", "columns: {question: prompt, answer: completion}"]),
    ("an Alpaca row among conversations",
     lambda t: data(t, [{"messages": good_turns()}, {"instruction": "a", "output": "b"}]),
     ["row 2 has no `messages`", "an Alpaca row", "give each format its own file"]),
    ("a row of another shape among ShareGPT rows", lambda t: data(t, [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}, {"question": "q"}]),
     ["row 2 has columns ['question']", "not the conversations rows", "fix the row"]),
    ("a row without its messages", lambda t: data(t, [{"messages": good_turns()}, {"messages": None}]),
     ["row 2 has no `messages` (it is empty)"]),
    ("content that is a list of strings", lambda t: data(t, [{"messages": [{"role": "user", "content": ["a", "b"]},
                                                                           assistant("c")]}]),
     ["row 1", "turn 1", "`content` of type list", "make it a string"]),
    ("content that is null", lambda t: data(t, [{"messages": [{"role": "user", "content": None}, assistant("c")]}]),
     ["row 1", "turn 1", "has no `content`"]),
    ("Alpaca output that is a number", lambda t: data(t, [{"instruction": "2 + 2?", "input": "", "output": 4}]),
     ["row 1", "`output` of type int", "make it a string"]),
    ("an empty JSON list", lambda t: [*TINY, "--dataset_name", str(write(t / "rows.json", "[]"))],
     ["rows.json", "holds no rows"]),
    ("ShareGPT answer marked not to be trained on", lambda t: data(t, [{"conversations": [
        {"from": "human", "value": "hi", "weight": 0}, {"from": "gpt", "value": "yo", "weight": 0}]}]),
     ["row 1 turn 2", "`weight: 0`", "remove that turn or its weight"]),
    ("every answer cut away by truncation", lambda t: [*data(t, [LONG_PROMPT, LONG_PROMPT]), "--max_length", "64"],
     ["every row's prompt fills `max_length: 64`", "raise max_length above"]),
    ("oasst message of another role", lambda t: data(t, [OASST_ROOT | {"role": "moderator"}]),
     ["row 1", "`role: moderator`", "prompter and assistant"]),
    ("preference rows whose prompt is in another column (Intel/orca_dpo_pairs)",
     lambda t: [*TINY, "--dataset_name", str(DATASETS / "Intel_orca_dpo_pairs.jsonl")],
     ["Intel_orca_dpo_pairs.jsonl [train]: preference rows whose `chosen` holds the answer alone",
      "e.g. columns: {question: prompt}"]),
    ("alignment-handbook weight above 1", lambda t: ["--config", str(write(t / "recipe.yaml", FULL.read_text() + (
        f"dataset_mixture:\n  datasets:\n    - id: {rows_file(t, [{'messages': good_turns()}])}\n      weight: 1.5\n"
    ))), "--tiny"],
     ["`dataset_mixture` entry 1", "`weight: 1.5`", "at most 1"]),
]


@pytest.mark.parametrize("case", HUB_REFUSALS, ids=[case[0] for case in HUB_REFUSALS])
def test_hub_schema_refusal_is_one_sentence_before_loading(case, tmp_path, capfd, monkeypatch):
    check_bad_input(case, tmp_path, capfd, monkeypatch)
