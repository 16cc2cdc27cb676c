"""Data as users have it: other column names mapped onto TRL's, Alpaca rows and ShareGPT conversations converted to
TRL's `messages`, and several sources mixed into one training set with a record of how many rows came from each.

TRL reads `messages`, `prompt` + `completion` and `text` and nothing else; its `maybe_convert_to_chatml` renames
ShareGPT's keys but keeps `human`/`gpt` as roles, which chat templates do not know, so the conversion is here.
The mixture's keys and its fraction rule follow TRL's `DatasetMixtureConfig` (trl/scripts/utils.py); its
`get_dataset` loads and concatenates in one step, with no place to convert and check each source, so it is not called.
"""

import json
import os

from datasets import Dataset, concatenate_datasets

from finetune.errors import UserError

TRL_COLUMNS = {"messages": ["messages"], "prompt-completion": ["prompt", "completion"], "text": ["text"]}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
SHAPES = {"Alpaca": ("instruction", "output"), "ShareGPT": ("conversations",)}
MIXTURE_KEYS = {"datasets", "seed", "test_split_size"}
SOURCE_KEYS = {"path", "name", "split", "test_split", "columns", "fraction"}


def trl_format(columns: list[str]) -> str | None:
    return next((name for name, needed in TRL_COLUMNS.items() if set(needed) <= set(columns)), None)


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # one line per run, not one per process
        print(f"[finetune] {message}", flush=True)


def as_mapping(value, source: str, key: str) -> dict:
    """A recipe mapping, or the same as JSON from the command line (`--columns '{"dialog": "messages"}'`)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        raise UserError(f"{source}: `{key}` must be a mapping, e.g. {key}: {{dialog: messages}}; fix its value.")
    return value


def rename_columns(dataset: Dataset, source: str, columns: dict | None) -> Dataset:
    """`columns: {their_name: our_name}`: the data's column names mapped onto a format finetune reads."""
    if not columns:
        return dataset
    missing = [name for name in columns if name not in dataset.column_names]
    if missing:
        raise UserError(
            f"{source}: `columns` maps `{missing[0]}`, which the data does not have (its columns: "
            f"{dataset.column_names}); fix the mapping."
        )
    clashing = [new for old, new in columns.items() if new in dataset.column_names and new not in columns]
    if clashing:
        raise UserError(
            f"{source}: `columns` renames a column to `{clashing[0]}`, which the data already has; map that one "
            f"elsewhere or pick the column you want to train on."
        )
    return dataset.rename_columns(columns)


def to_trl_format(dataset: Dataset, source: str, columns: dict | None = None) -> Dataset:
    """The rows in one of TRL's formats: mapped columns, then Alpaca or ShareGPT rows converted to `messages`
    (one printed line says which and how many); rows already in a TRL format pass through untouched."""
    dataset = rename_columns(dataset, source, columns)
    if trl_format(dataset.column_names) or len(dataset) == 0:
        return dataset
    shapes = [shape for shape, needed in SHAPES.items() if set(needed) <= set(dataset.column_names)]
    if not shapes:
        raise UserError(
            f"{source}: row 1 has columns {dataset.column_names}, which match no format finetune reads (TRL's "
            f"`messages`, `prompt` + `completion` or `text`; Alpaca `instruction` + `output`; ShareGPT "
            f"`conversations`); map yours onto one of them with `columns:` in the recipe, e.g. columns: {{dialog: messages}}."
        )
    shape = _uniform_shape(dataset, source)
    convert = _alpaca_messages if shape == "Alpaca" else _sharegpt_messages
    if shape == "ShareGPT":
        _check_sharegpt_roles(dataset, source)
    converted = dataset.map(lambda row: {"messages": convert(row)}, remove_columns=dataset.column_names)
    _say(f"{source}: {shape} rows found; {len(converted)} rows converted to `messages`")
    return converted


def _row_shape(row: dict) -> str | None:
    if row.get("conversations") is not None:
        return "ShareGPT"
    if row.get("instruction") is not None and row.get("output") is not None:
        return "Alpaca"
    return None


def _uniform_shape(dataset: Dataset, source: str) -> str:
    """One file, one format: a row of another shape (or of none) is named with the columns it has."""
    first = None
    for index, row in enumerate(dataset, start=1):
        shape = _row_shape(row)
        if shape is not None and first is None:
            first = shape
        if shape is None or shape != first:
            found = sorted(column for column, value in row.items() if value is not None)
            expected = first or "Alpaca (`instruction` + `output`) or ShareGPT (`conversations`)"
            raise UserError(
                f"{source}: row {index} has columns {found}, not the {expected} rows the file starts with; give each "
                f"format its own file (mix them with `dataset_mixture:`) or fix the row."
            )
    return first


def _alpaca_messages(row: dict) -> list[dict]:
    prompt = row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*system, {"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]


def _sharegpt_messages(row: dict) -> list[dict]:
    system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
    return [*system, *({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]} for turn in row["conversations"])]


def _check_sharegpt_roles(dataset: Dataset, source: str) -> None:
    for index, turns in enumerate(dataset["conversations"], start=1):
        for position, turn in enumerate(turns, start=1):
            if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or "value" not in turn:
                role = turn.get("from") if isinstance(turn, dict) else turn
                raise UserError(
                    f"{source}: row {index} turn {position} has `from: {role}`; ShareGPT turns are "
                    f"{{from: human|gpt|system, value: ...}}, so fix or remove the row."
                )


def check_mixture(mixture, source: str) -> dict:
    """The `dataset_mixture:` mapping, its keys checked before anything loads."""
    mixture = as_mapping(mixture, source, "dataset_mixture")
    unknown = sorted(set(mixture) - MIXTURE_KEYS)
    if unknown:
        raise UserError(f"{source}: `dataset_mixture` has unknown key `{unknown[0]}`; use {sorted(MIXTURE_KEYS)}.")
    entries = mixture.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{source}: `dataset_mixture` needs `datasets:`, a list of {{path: ..., fraction: ...}}; add it.")
    for number, entry in enumerate(entries, start=1):
        if not isinstance(entry, dict) or not entry.get("path"):
            raise UserError(f"{source}: `dataset_mixture` entry {number} has no `path`; give a hub id, folder or file.")
        unknown = sorted(set(entry) - SOURCE_KEYS)
        if unknown:
            raise UserError(
                f"{source}: `dataset_mixture` entry {number} ({entry['path']}) has unknown key `{unknown[0]}`; "
                f"use {sorted(SOURCE_KEYS)}."
            )
        fraction = entry.get("fraction")
        if fraction is not None and (not isinstance(fraction, (int, float)) or fraction <= 0):
            raise UserError(f"{source}: `dataset_mixture` entry {number} has `fraction: {fraction}`; give a number above 0.")
    fractions = [entry.get("fraction") is None for entry in entries]
    if any(fractions) and not all(fractions):
        raise UserError(f"{source}: `dataset_mixture` sets `fraction` on some entries only; set it on all or none.")
    return mixture


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
            f"{source}: the mixture's sources are in different formats ({', '.join(f'{k}: {v}' for k, v in formats.items())}); "
            f"map them onto one with each entry's `columns:`."
        )
    columns = TRL_COLUMNS[next(iter(formats.values()))]
    selected = [rows.select_columns(columns) for _, rows, _ in parts]
    try:
        selected = [rows.cast(selected[0].features) for rows in selected]
        mixed = concatenate_datasets(selected).shuffle(seed=seed)
    except (ValueError, TypeError) as error:
        raise UserError(
            f"{source}: the mixture's sources hold differently typed rows ({str(error).splitlines()[0]}); "
            f"make their turns the same shape."
        ) from None
    counts = {label: len(rows) for (label, _, _), rows in zip(parts, selected)}
    _say(f"dataset mixture: {len(mixed)} rows ({', '.join(f'{label}: {n}' for label, n in counts.items())})")
    return mixed, counts
