"""Every row checked before a model is loaded: rows TRL would silently mis-train on are refused (an empty assistant
turn, a conversation that never lets the assistant speak, content that is not text, turns out of order, a turn the
chat template fails on or drops text of), and the rows whose whole answer TRL's truncation would cut away are
counted. Shared by the training data (data.py) and `finetune generate`'s prompts (run/generation.py).
"""

import json

from datasets import Dataset

from finetune import families
from finetune.data import formats as data_formats
from finetune.errors import UserError, first_line, say

ROLES = {"system", "developer", "user", "assistant", "tool"}


def refuse_long_samples(dataset: Dataset, source: str, tokenizer, max_length: int | None) -> None:
    """Name the first row longer than max_length (with `truncation: false`: TRL would cut it silently)."""
    if max_length is None:
        return
    lengths = dataset.map(lambda row: {"length": _token_count(row, tokenizer)}, remove_columns=dataset.column_names)
    for index, length in enumerate(lengths["length"]):
        if length > max_length:
            raise UserError(
                f"{source}: row {index + 1} is {length} tokens, longer than `max_length: {max_length}` with "
                f"`truncation: false`; raise max_length, shorten or remove the row, or set truncation: true to let "
                f"TRL cut it."
            )


def check_answers_survive_truncation(dataset: Dataset, source: str, tokenizer, max_length: int) -> None:
    """TRL keeps a row's first max_length tokens, so a row whose prompt alone fills them loses its whole answer
    (TRL drops it when the loss is masked, and it teaches no answer otherwise): a warning counting such rows, and a
    refusal when no row keeps an answer. Each prompt is rendered and tokenized once, up to its first answer."""
    if data_formats.trl_format(dataset.column_names) not in ("messages", "prompt-completion"):
        return
    cut, shortest = [], None
    for index, row in enumerate(dataset):
        text, special_tokens = _prompt_text(row, tokenizer)
        # a token covers at least one byte: a prompt of fewer bytes cannot fill max_length (2 for BOS and the like)
        length = len(text.encode()) + 2
        if length >= max_length:
            length = len(tokenizer(text, add_special_tokens=special_tokens)["input_ids"])
        if length >= max_length:
            cut.append(index + 1)
            shortest = length if shortest is None else min(shortest, length)
    if cut and len(cut) == len(dataset):
        raise UserError(
            f"{source}: every row's prompt fills `max_length: {max_length}` (the shortest is {shortest} tokens), so "
            f"truncation cuts every answer away and nothing is left to learn; raise max_length above {shortest} or "
            f"shorten the prompts."
        )
    if cut:
        say(f"{source}: {len(cut)} of {len(dataset)} rows lose their whole answer to truncation at max_length "
            f"{max_length} (rows {_row_list(cut)}): their prompt alone fills it, so they teach no answer; raise "
            f"max_length or shorten those rows.")


def _prompt_text(row: dict, tokenizer) -> tuple[str, bool]:
    """What comes before the first answer token, as TRL renders it, and whether the tokenizer adds special tokens
    to it: conversations through the chat template up to the first assistant turn, plain prompts as they are."""
    template_kwargs = {**_template_kwargs(row), "tools": _tools(row)}
    if "messages" in row:
        turns = row["messages"]
        first_answer = next(position for position, turn in enumerate(turns) if turn["role"] == "assistant")
        return tokenizer.apply_chat_template(turns[:first_answer], tokenize=False, add_generation_prompt=True,
                                             **template_kwargs), False
    if isinstance(row["prompt"], list):
        return tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True,
                                             **template_kwargs), False
    return row["prompt"], True


def _tools(row: dict):
    """A row's tool schemas, which TRL gives the chat template (as a list, or JSON text of one)."""
    tools = row.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def _token_count(row: dict, tokenizer) -> int:
    """Tokens of a row as TRL tokenizes it: the chat template for conversations, plain text plus EOS otherwise."""
    data_format = data_formats.trl_format(list(row))
    template_kwargs = {**_template_kwargs(row), "tools": _tools(row)}
    if data_format == "messages":
        return len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                                 **template_kwargs)["input_ids"])
    if data_format == "text":
        return len(tokenizer(row["text"])["input_ids"]) + 1
    if isinstance(row["prompt"], list):
        turns = row["prompt"] + row["completion"]
        return len(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True,
                                                 **template_kwargs)["input_ids"])
    return len(tokenizer(row["prompt"] + row["completion"])["input_ids"]) + 1


def trl_rows(dataset: Dataset, source: str, columns: dict | list | None = None) -> Dataset:
    """The rows in one of TRL's formats (data_formats.to_trl_format), each checked, a problem named in the columns the
    data has."""
    rows, named = data_formats.to_trl_format(dataset, source, columns)
    check_rows(rows, source, named)
    return rows


def check_rows(dataset: Dataset, source: str, named: dict[str, str] | None = None) -> None:
    """Refuse the first row that TRL cannot train on correctly, naming its number and what to fix; `named` gives the
    column the data has for a TRL column renamed from it (preference rows' `chosen` as `messages`), which is the one
    a refusal names."""
    data_format = data_formats.trl_format(dataset.column_names)
    if data_format is None:
        raise UserError(
            f"{source}: columns {dataset.column_names} match none of TRL's formats; "
            f"rename them to `messages`, `prompt` + `completion`, or `text`."
        )
    if len(dataset) == 0:
        raise UserError(f"{source}: the split has no rows; point --dataset_name at data with examples.")
    named = named or {}
    columns = data_formats.TRL_COLUMNS[data_format]
    wanted = [named.get(column, column) for column in columns]
    for index, row in enumerate(dataset):
        missing = [column for column in columns if row.get(column) is None]
        if missing:  # rows of several formats in one file: `datasets` fills the other format's columns with None
            present = sorted(named.get(key, key) for key, value in row.items() if value is not None)
            raise UserError(f"{source}: row {index + 1} has no `{named.get(missing[0], missing[0])}` (it has "
                            f"{present}); the rows are {data_format} rows, so give every row "
                            f"`{'` and `'.join(wanted)}`.")
        problem = _row_problem(row, data_format, named) or _extras_problem(row)
        if problem:
            raise UserError(f"{source}: row {index + 1} {problem}.")


def _row_problem(row: dict, data_format: str, named: dict[str, str]) -> str | None:
    if data_format == "messages":
        return _conversation_problem(row["messages"], named.get("messages", "messages"))
    if data_format == "text":
        text = named.get("text", "text")
        return _not_text(row["text"], f"`{text}`") or (
            None if row["text"].strip() else f"has an empty `{text}`; remove the row")
    prompt, completion = named.get("prompt", "prompt"), named.get("completion", "completion")
    for column, name in (("prompt", prompt), ("completion", completion)):
        value = row[column]
        if isinstance(value, list):
            problem = turns_problem(value, name)
        else:
            problem = _not_text(value, f"`{name}`") or (
                None if value.strip() else f"has an empty `{name}`; fill it or remove the row")
        if problem:
            return problem
    if isinstance(row["prompt"], list) != isinstance(row["completion"], list):
        return (f"has a `{prompt}` and a `{completion}` of which one is a list of turns and the other text, which TRL "
                f"cannot render together; give both as turns or both as text")
    if isinstance(row["prompt"], list):
        return _exchange_problem(row["prompt"], row["completion"], prompt, completion)
    return None


def _exchange_problem(prompt: list, completion: list, prompt_name: str, completion_name: str) -> str | None:
    """A prompt and completion of turns: the completion is what is trained, so it holds the answer (assistant turns,
    and the tool turns between them), and the two read as one conversation in order."""
    for position, turn in enumerate(completion, start=1):
        if turn["role"] not in ("assistant", "tool"):
            return (f"turn {position} of `{completion_name}` is a {turn['role']!r} turn, which would be trained as the "
                    f"answer; keep the answer's assistant (and tool) turns in `{completion_name}` and move the rest "
                    f"to `{prompt_name}`")
    if all(turn["role"] != "assistant" for turn in completion):
        return (f"has no assistant turn in `{completion_name}`, so there is nothing to learn; add one or remove the "
                f"row")
    places = [(prompt_name, position, turn["role"]) for position, turn in enumerate(prompt, start=1)]
    places += [(completion_name, position, turn["role"]) for position, turn in enumerate(completion, start=1)]
    return _order_problem(places)


def _extras_problem(row: dict) -> str | None:
    """The values TRL hands the chat template row by row: `chat_template_kwargs`, a mapping, and `tools`, a list of
    tool schemas or JSON text of one."""
    values = row.get("chat_template_kwargs")
    if values is not None and not isinstance(values, dict):
        return (f"has a `chat_template_kwargs` that is {type(values).__name__} ({str(values)[:40]}), not a mapping; "
                f"make it {{name: value}} or remove it")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            return "has `tools` text that is not JSON; give a list of tool schemas, or JSON text of one"
    if tools is not None and not (isinstance(tools, list) and all(isinstance(tool, dict) for tool in tools)):
        return f"has `tools` that is no list of tool schemas ({str(tools)[:40]}); fix or remove it"
    return None


def _not_text(value, what: str) -> str | None:
    """What is wrong with a value that must be text: its type and a glimpse of it (a number, a list, a mapping)."""
    if isinstance(value, str):
        return None
    return f"has {what} of type {type(value).__name__} ({str(value)[:40]}), not text; make it a string"


def turns_problem(turns, column: str) -> str | None:
    if isinstance(turns, (str, dict)):
        return (f"has a `{column}` that is {'text' if isinstance(turns, str) else 'one mapping'}, not a list of turns; "
                f"make it a list of {{role, content}} turns")
    if not isinstance(turns, list) or not turns:
        return f"has an empty `{column}` list; give it at least one turn or remove the row"
    for position, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            return (f"turn {position} of `{column}` is a {type(turn).__name__} ({str(turn)[:40]}), not a turn; make "
                    f"`{column}` one list of {{role, content}} turns")
        if turn.get("role") not in ROLES:
            return f"turn {position} of `{column}` has role {turn.get('role')!r}; use one of {sorted(ROLES)}"
        where = f"turn {position} of `{column}` ({turn['role']})"
        calls = turn["role"] == "assistant" and turn.get("tool_calls")  # a tool call may be the whole answer
        if turn.get("content") is None and not calls:
            return f"{where} has no `content`; fill it or remove the row"
        if turn.get("content") is not None and not isinstance(turn["content"], str):
            return f"{where} {_not_text(turn['content'], 'a `content`')}"
        if turn["role"] == "assistant" and not (turn.get("content") or "").strip() and not calls:
            return f"{where} has empty content; fill it or remove the row"
        if turn["role"] == "assistant" and turn.get("weight") is not None and turn["weight"] == 0:
            return (f"{where} has `weight: 0` (not to be trained on), which TRL cannot honour (it trains every "
                    f"assistant turn); remove that turn or its weight")
        problem = _reasoning_problem(turn, where)
        if problem:
            return problem
    return None


def _reasoning_problem(turn: dict, where: str) -> str | None:
    """A reasoning trace that is not text, or a tag of a family's reasoning format (GPT-OSS's harmony) inside a turn:
    the chat template writes those around each message, and the tokenizers read them as real turn boundaries."""
    thinking = turn.get("thinking")
    if thinking is not None and not isinstance(thinking, str):
        return f"{where} has a `thinking` that is not text; make it a string (the reasoning trace) or remove it"
    for field_name in ("content", "thinking"):
        for reasoning in families.REASONING_FORMATS:
            tag = next((tag for tag in reasoning.tags if tag in (turn.get(field_name) or "")), None)
            if tag:
                return (
                    f"{where} holds the {reasoning.name} tag {tag} in its `{field_name}`, which the chat template "
                    f"writes itself; give the plain text (the reasoning in `thinking`, the answer in `content`) "
                    f"without tags"
                )
    return None


def _conversation_problem(turns, column: str) -> str | None:
    problem = turns_problem(turns, column)
    if problem:
        return problem
    if all(turn["role"] != "assistant" for turn in turns):
        return f"has no assistant turn in `{column}`, so there is nothing to learn; add one or remove the row"
    return _order_problem([(column, position, turn["role"]) for position, turn in enumerate(turns, start=1)])


def _order_problem(places: list[tuple[str, int, str]]) -> str | None:
    """The first assistant turn that answers neither a user nor a tool turn, of (column, position, role) in order."""
    roles = [role for _, _, role in places]
    for (column, position, role), before in zip(places, ["start"] + roles):
        if role == "assistant" and before not in ("user", "tool"):
            return (f"turn {position} of `{column}` is an assistant turn after {before!r}; an assistant answers a user "
                    f"or tool turn")
    return None


def with_chat_template_kwargs(dataset: Dataset, values: dict | None) -> Dataset:
    """Every conversational row carries the recipe's chat template values (its own values win), in the
    `chat_template_kwargs` column TRL passes to the chat template row by row."""
    if not values or data_formats.trl_format(dataset.column_names) not in ("messages", "prompt-completion"):
        return dataset
    return dataset.map(lambda row: {"chat_template_kwargs": {**values, **_template_kwargs(row)}})


def _template_kwargs(row: dict) -> dict:
    """A row's own chat template values (Arrow fills the keys other rows have with None: those are not values)."""
    return {key: value for key, value in (row.get("chat_template_kwargs") or {}).items() if value is not None}


# A turn's fields every chat template reads; `thinking` is check_reasoning_traces'
PLAIN_TURN_FIELDS = {"role", "content"}


REASONING_FIELDS = ("reasoning_content", "reasoning")  # other projects' names for a reasoning trace


def check_turn_fields(dataset: Dataset, source: str, tokenizer) -> None:
    """What conversations hold beyond each turn's role and content (tool calls, a reasoning trace under another name
    than `thinking`, a turn's `name`) reaches the model only as the chat template renders it. One row of each kind of
    turn is rendered: a row the template fails on (TRL would fail after loading the model), or an assistant turn's text
    or tool call it leaves out (trained as something else than the row, without a word), is refused; the fields of
    other turns it leaves out are named in one line."""
    data_format = data_formats.trl_format(dataset.column_names)
    if data_format not in ("messages", "prompt-completion"):
        return
    seen, unrendered = set(), {}
    conversations = dataset["messages"] if data_format == "messages" else (
        prompt + completion if isinstance(prompt, list) and isinstance(completion, list) else []
        for prompt, completion in zip(dataset["prompt"], dataset["completion"]))
    for index, turns in enumerate(conversations):
        kinds = {_turn_kind(turn) for turn in turns} - seen
        seen |= kinds
        if all(role != "tool" and fields <= PLAIN_TURN_FIELDS for role, fields, _ in kinds):
            continue
        row = dataset[index]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False, tools=_tools(row), **_template_kwargs(row))
        except Exception as error:  # the template is the model's code: any failure of it is the row's to fix
            raise UserError(f"{source}: row {index + 1} cannot be rendered by the model's chat template "
                            f"({first_line(error)}); fix the row so that the template accepts it, or remove "
                            f"it.") from None
        for position, turn in enumerate(turns, start=1):
            problem = _left_out(turn, text, tokenizer)
            if problem:
                raise UserError(f"{source}: row {index + 1} turn {position} ({turn['role']}) {problem}.")
            if turn["role"] != "assistant":
                for field in _fields(turn) - PLAIN_TURN_FIELDS:
                    if isinstance(turn[field], str) and turn[field].strip() not in text:
                        unrendered.setdefault(field, index + 1)
    if unrendered:
        say(f"{source}: the chat template leaves out the turn fields "
            f"{', '.join(f'`{field}` (row {row} first)' for field, row in sorted(unrendered.items()))}, so the model "
            f"never sees them; move their text into `content` if it should.")


def _fields(turn: dict) -> set[str]:
    """A turn's fields that hold something (Arrow gives every turn the fields any turn has, as None)."""
    return {field for field, value in turn.items() if value is not None}


def _turn_kind(turn: dict) -> tuple:
    calls = turn.get("tool_calls")
    return turn["role"], frozenset(_fields(turn)), len(calls) if isinstance(calls, list) else type(calls).__name__


def _left_out(turn: dict, text: str, tokenizer) -> str | None:
    """What of an assistant turn the rendered conversation `text` leaves out, as the end of a sentence with its fix."""
    if turn["role"] != "assistant":
        return None
    for call in turn.get("tool_calls") or []:
        function = (call.get("function") or call) if isinstance(call, dict) else {}
        if not function.get("name") or function["name"] not in text:
            return (f"has a tool call ({str(call)[:60]}) that the model's chat template leaves out, so it would not "
                    f"be trained; write tool calls as [{{type: function, function: {{name, arguments}}}}]")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and json.dumps(arguments) in text:
            return ("has tool call arguments given as JSON text, which the model's chat template writes as one quoted "
                    "string, so the model would learn escaped JSON; give `arguments` as a mapping")
    for field in ["content", *sorted(_fields(turn) - PLAIN_TURN_FIELDS - {"thinking", "tool_calls"})]:
        value = turn.get(field)
        if not isinstance(value, str) or not value.strip() or value.strip() in text:
            continue
        if field == "content":
            fix = "give that text an assistant turn of its own before the tool call"
        elif field in REASONING_FIELDS:
            fix = ("rename the field `thinking`, which the template renders" if _renders_thinking(tokenizer) else
                   "remove it: this model's chat template renders no reasoning trace")
        else:
            fix = "move its text into `content` or remove the field"
        return (f"has a `{field}` that the model's chat template leaves out, so it would be dropped from training "
                f"without a word; {fix}")
    return None


def _renders_thinking(tokenizer) -> bool:
    probe = "reasoning-trace-probe"
    return probe in tokenizer.apply_chat_template(
        [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!", "thinking": probe}], tokenize=False)


def check_reasoning_traces(dataset: Dataset, source: str, tokenizer, max_length: int | None) -> None:
    """Reasoning traces (`thinking` on assistant turns) reach the loss only where the chat template renders them.

    A template that renders no trace at all (Llama 3.2) would drop every one: refused. GPT-OSS's renders the trace of
    the conversation's last assistant turn only and drops earlier ones, and TRL cuts rows longer than max_length at
    the end, where that trace and its answer are: each is a warning naming the rows."""
    if data_formats.trl_format(dataset.column_names) != "messages":
        return
    traced = [index for index, turns in enumerate(dataset["messages"]) if any(turn.get("thinking") for turn in turns)]
    if not traced:
        return
    if not _renders_thinking(tokenizer):
        raise UserError(
            f"{source}: row {traced[0] + 1} has a reasoning trace (`thinking`), which this model's chat template never "
            f"renders, so it would be dropped without a word; remove the `thinking` fields or train a model with a "
            f"reasoning channel (recipes/gpt-oss-*)."
        )
    dropped, cut = [], []
    for index in traced:
        row = dataset[index]
        text = tokenizer.apply_chat_template(row["messages"], tokenize=False, **_template_kwargs(row))
        if any(turn.get("thinking") and turn["thinking"] not in text for turn in row["messages"]):
            dropped.append(index + 1)
        if max_length is not None and len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_length:
            cut.append(index + 1)
    if dropped:
        say(f"{source}: rows {_row_list(dropped)} have reasoning traces on earlier assistant turns, which the chat "
            f"template drops (only the last assistant turn's trace is rendered and trained); split such conversations "
            f"to train those traces.")
    if cut:
        say(f"{source}: rows {_row_list(cut)} are longer than max_length {max_length}: TRL cuts their end, the last "
            f"turn's reasoning trace and answer; raise max_length or set truncation: false to stop on them.")


def _row_list(rows: list[int], shown: int = 10) -> str:
    listed = ", ".join(map(str, rows[:shown]))
    return listed + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
