"""Data as users have it: other column names mapped onto TRL's, the hub's instruction, ShareGPT, Capybara and oasst
rows converted to TRL's `messages`, and several sources mixed into one training set with a record of how many rows came
from each.

TRL reads `messages`, `prompt` + `completion` and `text` and nothing else; its `maybe_convert_to_chatml` renames
ShareGPT's keys but keeps `human`/`gpt` as roles, which chat templates do not know, so the conversion is here.
The mixture's keys and its fraction rule follow TRL's `DatasetMixtureConfig` (trl/scripts/utils.py); its
`get_dataset` loads and concatenates in one step, with no place to convert and check each source, so it is not called.
alignment-handbook's mixture schema (src/alignment/configs.py and data.py there) is read as it is written.
"""

import json
from collections import defaultdict
from functools import reduce

import pyarrow.compute as pc
from datasets import Dataset, concatenate_datasets

from finetune.errors import UserError, first_line, say

TRL_COLUMNS = {"messages": ["messages"], "prompt-completion": ["prompt", "completion"], "text": ["text"]}


# What TRL reads beside a format's own columns, row by row. Every other column is dropped before TRL sees the rows:
# TRL tells the format apart with `set.pop()` over the columns it knows (trl.data_utils.is_conversational), so a
# `prompt` beside `messages` (ultrachat_200k) would make the outcome depend on the hash seed.
TRL_EXTRAS = ["chat_template_kwargs", "tools"]


TURN_COLUMNS = ("conversations", "conversation", "items")  # ShareGPT's names for a conversation, and Capybara's


# Each row shape by the columns its rows fill, tried in this order: a conversation beside a `prompt` (ultrachat_200k)
# trains the conversation, and `instruction` + `output` beside a `text` (tatsu-lab/alpaca) the Alpaca conversion.
ROW_SHAPES = {
    "messages": ("messages",),
    "prompt-completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),  # DPO's rows (trl-lib/ultrafeedback_binarized), trained on the chosen side
    "oasst": ("message_id", "role", "text"),  # OpenAssistant/oasst1, oasst2: one message of a tree per row
    "Alpaca": ("instruction", "output"),
    "Dolly": ("instruction", "response"),  # databricks/databricks-dolly-15k, `context` as Alpaca's `input`
    **{column: (column,) for column in TURN_COLUMNS},
    "text": ("text",),
}


INSTRUCTION_COLUMNS = {"Alpaca": ("instruction", "input", "output"), "Dolly": ("instruction", "context", "response")}


# Turns of a conversation column, by the key they carry: ShareGPT's {from, value}, Capybara's {input, output}
# exchanges, or chat turns {role, content} under another column name (lmsys-chat-1m's `conversation`).
TURN_STYLES = {"from": "ShareGPT", "input": "Capybara", "role": "chat"}


SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "system": "system"}


SYSTEM_COLUMNS = ("system", "system_prompt")  # Alpaca variants' and OpenHermes-2.5's system prompt


OASST_ROLES = {"prompter": "user", "assistant": "assistant"}


ANSWER_HINTS = ("answer", "response", "reply", "output", "completion", "target")


PROMPT_HINTS = ("prompt", "question", "instruction", "input", "query")


MIXTURE_KEYS = {"datasets", "seed", "test_split_size"}


SOURCE_KEYS = {"path", "name", "split", "test_split", "columns", "fraction"}


# alignment-handbook's entries: `id` is the dataset, `config` its name, and `weight` the share of that dataset's own
# rows kept (shuffled with the mixture's seed first), not a share of the mixture as TRL's `fraction` is.
HANDBOOK_SOURCE_KEYS = {"id", "config", "split", "columns", "weight"}


def trl_format(columns: list[str]) -> str | None:
    """The one place the data's format is told from its columns: the first of TRL's formats whose columns are all
    there (`messages` before `prompt` + `completion` before `text`), or None."""
    return next((name for name, needed in TRL_COLUMNS.items() if set(needed) <= set(columns)), None)


def _from_command_line(value):
    """A value as the recipe gives it, or as JSON text from the command line (`--columns '{"dialog": "messages"}'`)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return None


def as_mapping(value, source: str, key: str) -> dict:
    """A recipe mapping, or the same as JSON from the command line."""
    value = _from_command_line(value)
    if not isinstance(value, dict):
        raise UserError(f"{source}: `{key}` must be a mapping, e.g. {key}: {{dialog: messages}}; fix its value.")
    return value


def column_choice(value, source: str) -> dict | list | None:
    """`columns:` as a mapping {their_name: our_name} renames; as a list (TRL's and alignment-handbook's mixture
    entries) keeps those columns only."""
    if value is None:
        return None
    value = _from_command_line(value)
    if isinstance(value, dict) or isinstance(value, list) and value and all(isinstance(name, str) for name in value):
        return value
    raise UserError(f"{source}: `columns` must be a mapping such as {{dialog: messages}} (to rename) or a list of "
                    f"the columns to keep such as [messages]; fix its value.")


def apply_columns(dataset: Dataset, source: str, columns: dict | list | None) -> Dataset:
    """The data's columns renamed by a `columns:` mapping, or cut down to a `columns:` list."""
    if not columns:
        return dataset
    missing = [name for name in columns if name not in dataset.column_names]
    if missing:
        verb, noun = ("maps", "mapping") if isinstance(columns, dict) else ("lists", "list")
        raise UserError(
            f"{source}: `columns` {verb} `{missing[0]}`, which the data does not have (its columns: "
            f"{dataset.column_names}); fix the {noun}."
        )
    if isinstance(columns, list):
        return dataset.select_columns(columns)
    clashing = [new for old, new in columns.items() if new in dataset.column_names and new not in columns]
    if clashing:
        raise UserError(
            f"{source}: `columns` renames a column to `{clashing[0]}`, which the data already has; map that one "
            f"elsewhere or pick the column you want to train on."
        )
    return dataset.rename_columns(columns)


def to_trl_format(dataset: Dataset, source: str,
                  columns: dict | list | None = None) -> tuple[Dataset, dict[str, str]]:
    """The rows in one of TRL's formats and nothing else: mapped columns, then instruction, ShareGPT, Capybara or oasst
    rows converted to `messages` (one printed line says which and how many); rows already in a TRL format keep their
    format's columns (and the chat template values TRL reads) and lose the rest. Beside them, each TRL column that is
    one of the data's own under another name (preference rows' `chosen`), for the row checks to name what the user
    has."""
    dataset = apply_columns(dataset, source, columns)
    if len(dataset) == 0:
        return dataset, {}
    shape = _uniform_shape(dataset, source)
    if shape in TRL_COLUMNS:
        kept = TRL_COLUMNS[shape] + [column for column in TRL_EXTRAS if column in dataset.column_names]
        unused = [column for column in dataset.column_names if column not in kept]
        if unused:
            say(f"{source}: training on {' + '.join(f'`{column}`' for column in TRL_COLUMNS[shape])}; columns not "
                 f"used: {unused}")
        return dataset.select_columns(kept), {}
    if shape == "oasst":
        return _oasst_conversations(dataset, source), {}
    if shape == "preference":
        return _chosen_rows(dataset, source)
    label = shape if shape in INSTRUCTION_COLUMNS else _turn_style(dataset[0][shape], shape)
    convert = _instruction_messages if shape in INSTRUCTION_COLUMNS else _turn_messages
    converted = dataset.map(lambda row, index: {"messages": convert(row, index + 1, source, shape)}, with_indices=True,
                            remove_columns=dataset.column_names)
    # a TRL column beside them (tatsu-lab/alpaca's prompt-formatted `text`) is said to be left out, not trained on
    passed_over = [column for column in dataset.column_names if column in ("messages", "prompt", "completion", "text")]
    say(f"{source}: {label} rows found; {len(converted)} rows converted to `messages`"
         + (f" (not used: {passed_over})" if passed_over else ""))
    return converted, {}


def _row_shape(row: dict) -> str | None:
    filled = {column for column, value in row.items() if value is not None}
    return next((shape for shape, needed in ROW_SHAPES.items() if set(needed) <= filled), None)


def _uniform_shape(dataset: Dataset, source: str) -> str:
    """The rows' shape, from the columns the data has; one file, one shape: a row that does not fill its columns (a row
    of another shape: `datasets` gives it the others' columns, empty) is named with the columns it has."""
    shape = _row_shape(dict.fromkeys(dataset.column_names, ""))
    if shape is None:
        raise UserError(
            f"{source}: row 1 has columns {dataset.column_names}, which match no format finetune reads (TRL's "
            f"`messages`, `prompt` + `completion` or `text`; Alpaca `instruction` + `output` (Dolly: `response`); "
            f"ShareGPT or Capybara `conversations`/`conversation`; oasst `message_id` + `role` + `text`); map yours "
            f"onto one of them with `columns:` in the recipe, e.g. columns: {_suggested_mapping(dataset[0])}."
        )
    table = dataset.with_format("arrow")[:]
    empty = pc.index(_any_null(table, ROW_SHAPES[shape]), True).as_py()
    if empty >= 0:
        raise _mixed_rows(source, empty + 1, dataset[empty], shape)
    return shape


def _any_null(table, columns):
    return reduce(pc.or_, (table[column].is_null() for column in columns))


def _mixed_rows(source: str, number: int, row: dict, shape: str) -> UserError:
    found = sorted(column for column, value in row.items() if value is not None)
    own = _row_shape(row)
    if own in TURN_COLUMNS:
        own = _turn_style(row[own], own)
    kind = f"{'an' if own[0] in 'AEIOUaeiou' else 'a'} {own} row" if own else "a row of no format finetune reads"
    if shape in TRL_COLUMNS:
        needed = TRL_COLUMNS[shape]
        missing = next(column for column in needed if row.get(column) is None)
        return UserError(
            f"{source}: row {number} has no `{missing}` ({f'it has {found}, {kind}' if found else 'it is empty'}); the "
            f"rows are {shape} rows, so give "
            f"every row `{'` and `'.join(needed)}`, or give each format its own file (mix them with "
            f"`dataset_mixture:`)."
        )
    return UserError(
        f"{source}: row {number} has columns {found}, not the {shape} rows the rest of the file holds ({kind}); give "
        f"each format its own file (mix them with `dataset_mixture:`) or fix the row."
    )


def _suggested_mapping(row: dict) -> str:
    """A `columns:` mapping for what the row holds: a list of turns as `messages`, two texts as prompt and answer;
    never a rejected answer of preference rows, which would be trained as the one to give."""
    row = {column: value for column, value in row.items() if "rejected" not in column.lower()}
    turns = [column for column, value in row.items()
             if isinstance(value, list) and value and isinstance(value[0], dict)]
    texts = [column for column, value in row.items() if isinstance(value, str)]
    if turns:
        return f"{{{turns[0]}: messages}}"
    if len(texts) >= 2:
        answer = next((column for column in texts if any(hint in column.lower() for hint in ANSWER_HINTS)), texts[-1])
        prompt = next(column for column in texts if column != answer)
        return f"{{{prompt}: prompt, {answer}: completion}}"
    return "{dialog: messages}"


def _chosen_rows(dataset: Dataset, source: str) -> tuple[Dataset, dict[str, str]]:
    """Preference rows trained as SFT on their chosen side, as alignment-handbook's SFT recipes train on preference
    data, and said in one line: a chosen conversation as `messages`, a `prompt` with its chosen answer (text or turns)
    as `prompt` + `completion`, a chosen text holding the whole exchange (Anthropic/hh-rlhf's) as `text`. Told from the
    first row, as the other shapes are: a row unlike it is refused by the row checks."""
    chosen = dataset[0]["chosen"]
    prompts = [column for column, value in dataset[0].items() if isinstance(value, str)
               and column not in ("chosen", "rejected") and any(hint in column.lower() for hint in PROMPT_HINTS)]
    if isinstance(chosen, list) and any(isinstance(turn, dict) and turn.get("role") not in ("assistant", "tool")
                                        for turn in chosen):
        columns, trained = {"chosen": "messages"}, "the chosen conversation as `messages`"
    elif "prompt" in dataset.column_names:
        columns, trained = {"prompt": "prompt", "chosen": "completion"}, "`prompt` and the chosen answer as `completion`"
    elif isinstance(chosen, str) and not prompts:
        columns, trained = {"chosen": "text"}, "the chosen text as `text`"
    else:
        raise UserError(f"{source}: preference rows whose `chosen` holds the answer alone, with no `prompt` column to "
                        f"train it after; name the prompt's column with `columns:` in the recipe, e.g. columns: "
                        f"{{{prompts[0] if prompts else 'question'}: prompt}}.")
    kept = [*columns, *(column for column in TRL_EXTRAS if column in dataset.column_names)]
    unused = [column for column in dataset.column_names if column not in kept and column != "rejected"]
    say(f"{source}: preference rows (`chosen` and `rejected`) found; training on {trained} ({len(dataset)} rows), "
        f"`rejected` dropped" + (f" (not used either: {unused})" if unused else ""))
    renamed = {old: new for old, new in columns.items() if old != new}
    return dataset.select_columns(kept).rename_columns(renamed), {new: old for old, new in renamed.items()}


def _text(value, source: str, number: int, where: str) -> str:
    """A field a chat template renders: text, or one sentence naming the row, the field and what it holds instead."""
    if isinstance(value, str):
        return value
    if value is None:
        raise UserError(f"{source}: row {number} has no {where}; fill it or remove the row.")
    raise UserError(f"{source}: row {number} has {where} of type {type(value).__name__} ({str(value)[:40]}), not "
                    f"text; make it a string or remove the row.")


def _system_turn(row: dict, source: str, number: int) -> list[dict]:
    column = next((column for column in SYSTEM_COLUMNS if row.get(column)), None)
    return [{"role": "system", "content": _text(row[column], source, number, f"`{column}`")}] if column else []


def _instruction_messages(row: dict, number: int, source: str, shape: str) -> list[dict]:
    """Alpaca's instruction, its optional input (Dolly's context) after a blank line, and the answer."""
    instruction, extra, answer = INSTRUCTION_COLUMNS[shape]
    parts = [_text(row[instruction], source, number, f"`{instruction}`")]
    if row.get(extra) is not None:
        parts.append(_text(row[extra], source, number, f"`{extra}`"))
    prompt = "\n\n".join(part for part in parts if part)
    return [*_system_turn(row, source, number), {"role": "user", "content": prompt},
            {"role": "assistant", "content": _text(row[answer], source, number, f"`{answer}`")}]


def _turn_style(turns, column: str) -> str:
    first = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else {}
    style = next((TURN_STYLES[key] for key in TURN_STYLES if first.get(key) is not None), None)
    return style or f"`{column}`"


def _turn_messages(row: dict, number: int, source: str, column: str) -> list[dict]:
    """ShareGPT's {from, value} turns (their system turn, or a `system` column), Capybara's {input, output}
    exchanges, or chat turns {role, content} under another name, as `messages`."""
    turns = row[column]
    if not isinstance(turns, list):
        raise UserError(f"{source}: row {number} has a `{column}` that is not a list of turns; fix or remove the row.")
    messages = []
    for position, turn in enumerate(turns, start=1):
        where = f"turn {position} of `{column}`"
        if not isinstance(turn, dict):
            raise UserError(f"{source}: row {number} {where} is {str(turn)[:40]!r}, not a turn; ShareGPT turns are "
                            f"{{from: human|gpt|system, value: ...}}, so fix or remove the row.")
        if turn.get("from") is not None:
            messages.append({"role": _sharegpt_role(turn, number, position, source),
                             "content": _text(turn.get("value"), source, number, f"`value` in {where}")})
        elif turn.get("input") is not None or turn.get("output") is not None:
            question = _text(turn.get("input"), source, number, f"`input` in {where}")
            answer = _text(turn.get("output"), source, number, f"`output` in {where}")
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        elif turn.get("role") is not None:  # chat turns as they are (tool calls and traces too), checked as `messages`
            messages.append({key: value for key, value in turn.items() if value is not None})
        else:
            raise UserError(
                f"{source}: row {number} {where} has keys {sorted(turn)}; turns are ShareGPT's {{from, value}}, "
                f"Capybara's {{input, output}} or {{role, content}}, so fix the row or map the column with `columns:`."
            )
    has_system = any(message["role"] == "system" for message in messages)
    return messages if has_system else [*_system_turn(row, source, number), *messages]


def _sharegpt_role(turn: dict, number: int, position: int, source: str) -> str:
    role = SHAREGPT_ROLES.get(turn["from"])
    if role is None:
        raise UserError(
            f"{source}: row {number} turn {position} has `from: {turn['from']}`; ShareGPT turns are "
            f"{{from: human|gpt|system, value: ...}}, so fix or remove the row."
        )
    if role == "assistant" and turn.get("weight") is not None and turn["weight"] == 0:
        raise UserError(
            f"{source}: row {number} turn {position} is a `{turn['from']}` turn with `weight: 0` (not to be trained "
            f"on), which TRL cannot honour (it trains every assistant turn); remove that turn or its weight."
        )
    return role


def _oasst_conversations(dataset: Dataset, source: str) -> Dataset:
    """OpenAssistant message trees (one message per row, linked by `parent_id`) as one conversation per tree: the
    top-ranked reply at each step from the prompt down, as OpenAssistant's own oasst_top1 release takes them,
    leaving out deleted messages and those that failed review; a path ending on a prompt loses that prompt."""
    columns = [column for column in ("message_id", "parent_id", "role", "text", "rank", "deleted", "review_result")
               if column in dataset.column_names]
    replies, roots = defaultdict(list), []
    for number, message in enumerate(dataset.select_columns(columns).to_list(), start=1):
        if message["role"] not in OASST_ROLES:
            raise UserError(f"{source}: row {number} is an oasst message with `role: {message['role']}`; oasst roles "
                            f"are prompter and assistant, so fix or remove the row.")
        _text(message["text"], source, number, "`text`")
        if message.get("deleted") or message.get("review_result") is False:
            continue
        (replies[message["parent_id"]] if message.get("parent_id") else roots).append(message)
    conversations = []
    for root in roots:
        path = [root]
        while replies.get(path[-1]["message_id"]):
            path.append(min(replies[path[-1]["message_id"]], key=_oasst_rank))
        while path and path[-1]["role"] != "assistant":
            path.pop()
        if path:
            conversations.append([{"role": OASST_ROLES[turn["role"]], "content": turn["text"]} for turn in path])
    if not conversations:
        raise UserError(f"{source}: the oasst message trees hold no prompt with a reply; give the file whole trees "
                        f"(every message from each tree's prompt on).")
    say(f"{source}: oasst message trees found: {len(dataset)} messages in {len(roots)} trees; each tree's top-ranked "
         f"path kept as one conversation ({len(conversations)} rows in `messages`)")
    return Dataset.from_dict({"messages": conversations})


def _oasst_rank(message: dict) -> tuple:
    """Rank 0 is the best reply; unranked replies come after ranked ones, in file order."""
    rank = message.get("rank")
    return (rank is None, rank or 0)


def check_mixture(mixture, source: str) -> dict:
    """The `dataset_mixture:` mapping, its keys checked before anything loads; alignment-handbook's entries
    (`id`, `config`, `weight`) come back in TRL's names (`path`, `name`), their `weight` kept for `keep_share`."""
    mixture = as_mapping(mixture, source, "dataset_mixture")
    unknown = sorted(set(mixture) - MIXTURE_KEYS)
    if unknown:
        raise UserError(f"{source}: `dataset_mixture` has unknown key `{unknown[0]}`; use {sorted(MIXTURE_KEYS)}.")
    entries = mixture.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{source}: `dataset_mixture` needs `datasets:`, a list of {{path: ..., fraction: ...}}; "
                        f"add it.")
    _check_mixture_numbers(mixture, source)
    schemas = {"id" in entry and "path" not in entry for entry in entries if isinstance(entry, dict)}
    if len(schemas) > 1:
        raise UserError(f"{source}: `dataset_mixture` mixes TRL's entries (`path:`, `fraction:`) with "
                        f"alignment-handbook's (`id:`, `weight:`); write every entry in one of the two.")
    checked = [_check_source(entry, number, source) for number, entry in enumerate(entries, start=1)]
    fractions = [entry.get("fraction") is None for entry in checked]
    if any(fractions) and not all(fractions):
        raise UserError(f"{source}: `dataset_mixture` sets `fraction` on some entries only; set it on all or none.")
    if schemas == {True}:
        say("dataset_mixture in alignment-handbook's schema: `id` is each dataset, `weight` the share of its own rows "
             "kept, `test_split_size` the test rows taken from the mixture")
    return {**mixture, "datasets": checked}


def _check_mixture_numbers(mixture: dict, source: str) -> None:
    seed = mixture.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserError(f"{source}: `dataset_mixture` has `seed: {seed}`; give a whole number.")
    size = mixture.get("test_split_size")
    valid = isinstance(size, int) and size >= 1 or isinstance(size, float) and 0 < size < 1
    if size is not None and (isinstance(size, bool) or not valid):
        raise UserError(f"{source}: `dataset_mixture` has `test_split_size: {size}`; give a share between 0 and 1 "
                        f"or a number of test rows (1 or more).")


def _check_source(entry, number: int, source: str) -> dict:
    if not isinstance(entry, dict) or not (entry.get("path") or entry.get("id")):
        raise UserError(f"{source}: `dataset_mixture` entry {number} has no `path` (alignment-handbook: `id`); give "
                        f"a hub id, folder or file.")
    handbook = "path" not in entry
    known, other = (HANDBOOK_SOURCE_KEYS, SOURCE_KEYS) if handbook else (SOURCE_KEYS, HANDBOOK_SOURCE_KEYS)
    unknown = sorted(set(entry) - known)
    if unknown:
        hint = (f" (`{unknown[0]}` is {'TRL' if handbook else 'alignment-handbook'}'s, whose entries start with "
                f"`{'path' if handbook else 'id'}:`)" if unknown[0] in other else "")
        raise UserError(
            f"{source}: `dataset_mixture` entry {number} ({entry.get('path') or entry['id']}) has unknown key "
            f"`{unknown[0]}`{hint}; use {sorted(known)}."
        )
    for key, upper in (("fraction", None), ("weight", 1)):
        value = entry.get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
                                  or upper and value > upper):
            raise UserError(f"{source}: `dataset_mixture` entry {number} has `{key}: {value}`; give a number above 0"
                            f"{' and at most 1 (the share of its rows kept)' if upper else ''}.")
    column_choice(entry.get("columns"), f"{source}: `dataset_mixture` entry {number}")
    if not handbook:
        return entry
    # the handbook loads `split` (default train) and takes its test rows from the mixture, never from a test split
    return {"path": entry["id"], "name": entry.get("config"), "split": entry.get("split", "train"), "test_split": None,
            "columns": entry.get("columns"), "weight": entry.get("weight")}


def keep_share(rows: Dataset, weight: float | None, seed: int, label: str) -> Dataset:
    """alignment-handbook's `weight`: that share of a source's rows, shuffled with the mixture's seed first."""
    if weight is None:
        return rows
    kept = int(len(rows) * weight)
    if kept == 0:
        raise UserError(f"{label}: `weight: {weight}` keeps none of its {len(rows)} rows; raise it (the share of the "
                        f"dataset's rows kept, up to 1).")
    return rows.shuffle(seed=seed).select(range(kept))


def mix(parts: list[tuple[str, Dataset, float | None]], seed: int, source: str) -> tuple[Dataset, dict]:
    """Sources (label, rows, fraction) into one shuffled set and the rows taken from each. Fractions are shares of the
    mixture, normalized, and the mixture is as large as it can be without repeating a row (TRL's rule); each source is
    shuffled before its share is taken, so a file sorted by topic or length gives a sample, not its head."""
    fractions = [fraction for _, _, fraction in parts]
    if all(fraction is not None for fraction in fractions):
        weights = [fraction / sum(fractions) for fraction in fractions]
        total = min(len(rows) / weight for (_, rows, _), weight in zip(parts, weights))
        parts = [(label, rows.shuffle(seed=seed).select(range(round(weight * total))), None)
                 for (label, rows, _), weight in zip(parts, weights)]
    formats = {label: trl_format(rows.column_names) for label, rows, _ in parts}
    if len(set(formats.values())) > 1:
        raise UserError(
            f"{source}: the mixture's sources are in different formats "
            f"({', '.join(f'{label}: {name}' for label, name in formats.items())}); map them onto one with each "
            f"entry's `columns:`."
        )
    # the chat template values TRL reads row by row travel with the rows where every source has them
    extras = [column for column in TRL_EXTRAS if all(column in rows.column_names for _, rows, _ in parts)]
    columns = TRL_COLUMNS[next(iter(formats.values()))] + extras
    selected = [rows.select_columns(columns) for _, rows, _ in parts]
    try:
        selected = [rows.cast(selected[0].features) for rows in selected]
        mixed = concatenate_datasets(selected).shuffle(seed=seed)
    except (ValueError, TypeError) as error:
        raise UserError(
            f"{source}: the mixture's sources hold differently typed rows ({first_line(error)}); "
            f"make their turns the same shape."
        ) from None
    counts = {label: len(rows) for (label, _, _), rows in zip(parts, selected)}
    say(f"dataset mixture: {len(mixed)} rows ({', '.join(f'{label}: {n}' for label, n in counts.items())})")
    return mixed, counts
