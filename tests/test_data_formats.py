"""Data as users have it: Alpaca and ShareGPT rows become `messages`, other column names are mapped, several sources
mix in chosen shares with a per-source count, and a mixed or unknown file is named with its row and columns."""

import json
import re

import pytest
import yaml
from trl import ScriptArguments, SFTConfig

from finetune.data.load import load_datasets
from finetune.errors import UserError
from finetune.run.arguments import FinetuneArguments

ALPACA = [{"instruction": "Spell cat backwards.", "input": "", "output": "tac"},
          {"instruction": "Translate to French.", "input": "dog", "output": "chien"}]
SHAREGPT = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello."}]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def load(dataset_name=None, eval_strategy="no", record=None, **sources):
    training = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, eval_strategy=eval_strategy, seed=3)
    return load_datasets(ScriptArguments(dataset_name=dataset_name), training, sources=FinetuneArguments(**sources),
                         record=record)


def test_alpaca_rows_become_a_user_and_an_assistant_turn_and_say_so(tmp_path, capsys):
    train, _ = load(write_jsonl(tmp_path / "alpaca.jsonl", ALPACA))
    assert train["messages"] == [
        [{"role": "user", "content": "Spell cat backwards."}, {"role": "assistant", "content": "tac"}],
        [{"role": "user", "content": "Translate to French.\n\ndog"}, {"role": "assistant", "content": "chien"}],
    ]
    assert "Alpaca rows found; 2 rows converted to `messages`" in capsys.readouterr().out


def test_sharegpt_conversations_become_messages_with_chat_roles(tmp_path, capsys):
    train, _ = load(write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT))
    assert train["messages"] == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello."}]]
    assert "ShareGPT rows found; 1 rows converted" in capsys.readouterr().out


@pytest.mark.parametrize("columns", [{"dialog": "messages"}, '{"dialog": "messages"}'])
def test_a_column_mapping_from_the_recipe_or_the_command_line_renames_onto_messages(tmp_path, columns):
    rows = [{"dialog": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], "id": 7}]
    train, _ = load(write_jsonl(tmp_path / "dialogs.jsonl", rows), columns=columns)
    assert train[0]["messages"][1]["content"] == "Hello."


def test_a_column_mapping_onto_alpaca_names_converts_too(tmp_path):
    rows = [{"question": "2+2?", "answer": "4"}]
    train, _ = load(write_jsonl(tmp_path / "qa.jsonl", rows), columns={"question": "instruction", "answer": "output"})
    assert train["messages"] == [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]]


@pytest.mark.parametrize("rows, columns, named", [
    ([ALPACA[0], *SHAREGPT], None, r"row 2 has columns \['conversations'\], not the Alpaca rows"),
    ([{"question": "2+2?", "reply": "4"}], None, r"row 1 has columns \['question', 'reply'\], which match no format"),
    ([{"question": "2+2?"}], {"query": "prompt"}, r"`columns` maps `query`, which the data does not have"),
    ([{"conversations": [{"from": "bot", "value": "hi"}]}], None, r"row 1 turn 1 has `from: bot`"),
    ([{"conversation": [{"input": "2+2?", "output": None}]}], None,
     r"row 1 has no `output` in turn 1 of `conversation`"),
])
def test_mixed_unknown_or_misnamed_rows_are_one_sentence_naming_file_row_and_columns(tmp_path, rows, columns, named):
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(UserError, match=named) as error:
        load(path, columns=columns)
    assert str(error.value).startswith(path)


PAIR = {"question": "2+2?", "response_chosen": "4", "response_rejected": "5"}


@pytest.mark.parametrize("columns", [list(PAIR), ["question", "response_rejected", "response_chosen"]])
def test_the_mapping_a_refusal_suggests_never_trains_a_rejected_answer_and_written_as_told_trains_the_chosen(
        tmp_path, columns):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{column: PAIR[column] for column in columns}])
    with pytest.raises(UserError) as refused:
        load(path)
    suggested = yaml.safe_load(re.search(r"e\.g\. columns: (\{[^}]*\})", str(refused.value)).group(1))
    train, _ = load(path, columns=suggested)
    assert train.to_list() == [{"prompt": "2+2?", "completion": "4"}]


def test_three_sources_mix_in_their_fractions_with_rows_per_source_recorded_and_a_mixed_test_split(tmp_path):
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(40)])
    sharegpt = write_jsonl(tmp_path / "sharegpt.jsonl", [{"conversations": [
        {"from": "human", "value": f"h{i}"}, {"from": "gpt", "value": f"g{i}"}]} for i in range(100)])
    renamed = write_jsonl(tmp_path / "dialogs.jsonl", [{"dialog": [
        {"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"d{i}"}]} for i in range(60)])
    mixture = {"seed": 5, "test_split_size": 0.1, "datasets": [
        {"path": alpaca, "fraction": 0.2},
        {"path": sharegpt, "fraction": 0.5},
        {"path": renamed, "columns": {"dialog": "messages"}, "fraction": 0.3},
    ]}
    record = {}
    train, test = load(eval_strategy="steps", record=record, dataset_mixture=mixture)
    # 36 alpaca rows remain after the 10% test share; at 20% they cap the mixture at 180 rows: 36 + 90 + 54
    assert record["train"] == {f"{alpaca} [train]": 36, f"{sharegpt} [train]": 90, f"{renamed} [train]": 54}
    assert record["test"] == {f"{alpaca} [train]": 4, f"{sharegpt} [train]": 10, f"{renamed} [train]": 6}
    assert (len(train), len(test)) == (180, 20)
    answers = [messages[-1]["content"] for messages in train["messages"]]
    assert sum(answer.startswith("a") for answer in answers) == 36 and sum(a.startswith("g") for a in answers) == 90
    assert answers[:36] != [f"a{i}" for i in range(36)], "the sources are shuffled together, not stacked"
    test_answers = {messages[-1]["content"] for messages in test["messages"]}
    assert test_answers.isdisjoint(answers)
    again, _ = load(eval_strategy="steps", dataset_mixture=mixture)
    assert again["messages"] == train["messages"]  # the seed decides, not the run


def test_a_source_cut_to_its_share_gives_a_sample_not_its_head(tmp_path):
    sorted_rows = write_jsonl(tmp_path / "sorted.jsonl", [{"instruction": f"q{i}", "output": f"a{i:02d}"} for i in range(40)])
    small = write_jsonl(tmp_path / "small.jsonl", [{"instruction": "q", "output": "b"}] * 4)
    record = {}
    train, _ = load(record=record, dataset_mixture={"datasets": [{"path": sorted_rows, "fraction": 0.5},
                                                                  {"path": small, "fraction": 0.5}]})
    assert record["train"] == {f"{sorted_rows} [train]": 4, f"{small} [train]": 4}
    taken = sorted(answer for answer in (m[-1]["content"] for m in train["messages"]) if answer != "b")
    assert taken != ["a00", "a01", "a02", "a03"]


@pytest.mark.parametrize("mixture, named", [
    ({"datasets": [{"path": "a.jsonl", "fraction": 1}, {"path": "b.jsonl"}]}, "sets `fraction` on some entries only"),
    ({"datasets": [{"path": "a.jsonl", "weight": 1}]}, "unknown key `weight`"),
    ({"sources": []}, "unknown key `sources`"),
])
def test_a_malformed_mixture_is_refused_before_anything_loads(mixture, named):
    with pytest.raises(UserError, match=named):
        load(dataset_mixture=mixture)


def write_files(folder, files: dict):
    folder.mkdir()
    for name, content in files.items():
        (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(folder)


CHAT_ROW = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]})


@pytest.mark.parametrize("files, named", [
    ({"a.jsonl": CHAT_ROW + "\n", "b.csv": "prompt,completion\nHi,Hello.\n"},
     r"data files of several types \(json \(a.jsonl\), csv \(b.csv\)\).*reads only its most common type"),
    ({"a.jsonl": CHAT_ROW + "\n", "b.jsonl": b'{"text": "caf\xe9"}\n'}, r"b.jsonl: line 1 is not UTF-8"),
    ({"a.jsonl": CHAT_ROW + "\n", "b.jsonl": "{oops\n"}, r"b.jsonl: line 1 is not valid JSON"),
    ({"a.jsonl": ""}, r"a.jsonl: the file holds no rows"),
    ({"notes.md": "rows to come\n"}, r"the folder holds no data files"),
], ids=["two file types", "a line not UTF-8", "a line not JSON", "an empty file", "no data file"])
def test_a_folder_is_checked_file_by_file_and_one_of_several_file_types_is_refused(tmp_path, files, named):
    """`datasets` reads a folder's most common file type and leaves the others out without a word, and fails on a
    bad line with a traceback or without naming the file."""
    with pytest.raises(UserError, match=named):
        load(write_files(tmp_path / "data", files))


def test_a_validation_split_left_unused_is_named_with_the_setting_that_uses_it(tmp_path, capsys):
    folder = write_files(tmp_path / "data", {"train.jsonl": (CHAT_ROW + "\n") * 2, "validation.jsonl": CHAT_ROW + "\n"})
    load(folder, eval_strategy="steps")
    assert (f"{folder} has no `test` split (it has ['validation']: set dataset_test_split to evaluate on one of them): "
            f"evaluating on 5% of the train split") in capsys.readouterr().out


def test_a_bom_and_a_folder_saved_by_save_to_disk_load_as_they_are(tmp_path):
    from datasets import Dataset

    bom = tmp_path / "bom.jsonl"
    bom.write_text(CHAT_ROW + "\n", encoding="utf-8-sig")
    assert load(str(bom))[0][0]["messages"][1]["content"] == "Hello."
    Dataset.from_list([json.loads(CHAT_ROW)]).save_to_disk(tmp_path / "saved")
    assert load(str(tmp_path / "saved"))[0][0]["messages"][1]["content"] == "Hello."


def tool_call(name="get_weather", arguments=None):
    return {"type": "function", "function": {"name": name, "arguments": arguments or {"city": "Paris"}}}


USER, TOOL, ANSWER = ({"role": "user", "content": "Weather in Paris?"}, {"role": "tool", "content": "sunny"},
                      {"role": "assistant", "content": "It is sunny."})


def calling(*calls, content=""):
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


@pytest.mark.parametrize("row, named", [
    ({"messages": [USER, {**ANSWER, "weight": 0}]}, r"row 1 turn 2 of `messages` \(assistant\) has `weight: 0`"),
    ({"prompt": [USER], "completion": [{"role": "user", "content": "And Rome?"}, ANSWER]},
     r"row 1 turn 1 of `completion` is a 'user' turn, which would be trained as the answer"),
    ({"prompt": [USER, ANSWER], "completion": [ANSWER]},
     r"row 1 turn 1 of `completion` is an assistant turn after 'assistant'"),
    ({"prompt": [USER], "completion": "It is sunny."}, r"one is a list of turns and the other text"),
    ({"messages": [USER, ANSWER], "tools": "get_weather(city)"}, r"row 1 has `tools` text that is not JSON"),
    ({"messages": [USER, ANSWER], "chat_template_kwargs": "high"}, r"row 1 has a `chat_template_kwargs` that is str"),
], ids=["weight 0", "user turn in completion", "two assistant turns across prompt and completion",
        "turns and text (a traceback in TRL)", "tools not JSON",
        "chat_template_kwargs not a mapping"])
def test_a_turn_trl_would_train_otherwise_than_written_is_refused(tmp_path, row, named):
    with pytest.raises(UserError, match=named):
        load(write_jsonl(tmp_path / "rows.jsonl", [row]))


def load_with_template(tmp_path, rows):
    from finetune.models import tiny

    training = SFTConfig(output_dir="unused", use_cpu=True, bf16=False, eval_strategy="no", max_length=None)
    return load_datasets(ScriptArguments(dataset_name=write_jsonl(tmp_path / "rows.jsonl", rows)), training,
                         tokenizer=tiny.build_tiny_tokenizer("llama"))


@pytest.mark.parametrize("messages, named", [
    ([USER, {**ANSWER, "reasoning_content": "Paris is often sunny."}],
     r"turn 2 \(assistant\) has a `reasoning_content` that the model's chat template leaves out.*renders no reasoning"),
    ([USER, calling(tool_call(), content="Let me look."), TOOL, ANSWER],
     r"turn 2 \(assistant\) has a `content` that the model's chat template leaves out.*an assistant turn of its own"),
    ([USER, calling(tool_call(), tool_call("get_time")), TOOL, ANSWER],
     r"row 1 cannot be rendered by the model's chat template \(This model only supports single tool-calls"),
    ([USER, calling(tool_call(arguments='{"city": "Paris"}')), TOOL, ANSWER],
     r"tool call arguments given as JSON text.*give `arguments` as a mapping"),
], ids=["reasoning_content", "text beside a tool call", "two tool calls in one turn (Llama)", "arguments as text"])
def test_what_the_chat_template_leaves_out_of_an_answer_or_cannot_render_is_refused(tmp_path, messages, named):
    with pytest.raises(UserError, match=named):
        load_with_template(tmp_path, [{"messages": messages}])


def test_tool_calls_train_as_written_and_fields_no_turn_renders_are_named(tmp_path, capsys):
    """An assistant turn that only calls a tool has no content (OpenAI's format); a tool turn's `tool_call_id` is
    left out by Llama's template, which is said."""
    conversation = [USER, {"role": "assistant", "tool_calls": [tool_call()]},
                    {**TOOL, "tool_call_id": "call_1"}, ANSWER]
    train, _ = load_with_template(tmp_path, [{"messages": conversation}])
    assert train[0]["messages"][1]["tool_calls"] == [tool_call()]
    assert "leaves out the turn fields `tool_call_id` (row 1 first)" in capsys.readouterr().out
    sharegpt_named, _ = load(write_jsonl(tmp_path / "named.jsonl", [{"conversations": conversation}]))
    assert sharegpt_named[0]["messages"][1]["tool_calls"] == [tool_call()]  # chat turns keep their fields
