"""The training data: a hub id, a local folder or a local file (each data file of a folder checked as a file),
loaded with `datasets` into one of TRL's formats (`messages`, `prompt`/`completion`, `text`), mixtures and test
splits, and every row checked (finetune/data/rows.py) before a model is loaded.

Chat formatting, tokenization, packing and loss masking are TRL's; this module only finds the data.
"""

import json
import math
from functools import partial
from pathlib import Path

import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict, load_dataset, load_from_disk
from datasets.data_files import FILES_TO_IGNORE
from trl import ScriptArguments, SFTConfig
from trl.data_utils import is_conversational

from finetune.data import formats as data_formats
from finetune.data import rows as row_checks
from finetune.errors import UserError, first_line, say

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


EVAL_FRACTION_WHEN_NO_TEST_SPLIT = 0.05


NO_ROWS = "{name}: the file holds no rows; give a file with at least one row."


def looks_local(name: str) -> bool:
    return Path(name).suffix in FILE_BUILDERS or name.startswith((".", "/", "~")) or Path(name).exists()


def _load(name: str, config_name: str | None) -> DatasetDict:
    path = Path(name).expanduser()
    if looks_local(name) and not path.exists():
        raise UserError(f"{name}: dataset file or folder not found; fix --dataset_name (a hub id, folder or file).")
    if (path / "state.json").is_file():  # one split saved by save_to_disk, which load_dataset refuses to read
        try:
            return DatasetDict({"train": load_from_disk(str(path))})
        except Exception as error:
            raise UserError(f"{name}: a folder saved by save_to_disk that cannot be read ({first_line(error)}); "
                            f"save the dataset again.") from None
    if path.is_dir():
        _check_folder(path, name)
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise UserError(f"{name}: unsupported dataset file type; use one of {', '.join(FILE_BUILDERS)}.")
        _check_file(path, name)
        try:
            return load_dataset(FILE_BUILDERS[path.suffix], data_files=str(path))
        except Exception as error:
            if "corresponds to no data" in str(error):  # `datasets`' words for `[]` in .json, a lone .csv header
                raise UserError(NO_ROWS.format(name=name)) from None
            raise UserError(f"{name}: cannot be read as {path.suffix} ({first_line(error)}); fix that line.") from None
    try:
        return load_dataset(str(path) if path.exists() else name, name=config_name)
    except Exception as error:
        raise UserError(
            f"{name}: the dataset could not be loaded ({first_line(error)}); without network pass a local "
            f"folder or .jsonl/.json/.parquet/.csv file to --dataset_name."
        ) from None


def _check_file(path: Path, name: str) -> None:
    if path.suffix in (".jsonl", ".json", ".csv"):
        _check_text(path, name, json_lines=path.suffix == ".jsonl")
    else:
        _check_parquet(path, name)


# What `datasets` reads in a folder, by file type: the most common type only, the other files left out without a word;
# never the files it writes itself beside the data (save_to_disk's state.json among them)
FOLDER_DATA_TYPES = {**FILE_BUILDERS, ".txt": "text", ".tsv": "csv", ".arrow": "arrow"}


NOT_DATA_FILES = {*FILES_TO_IGNORE, "state.json"}


def _check_folder(path: Path, name: str) -> None:
    """A local folder's data files, checked as single files are (`datasets` fails on them with a traceback or a
    message naming no file); a folder of several file types is refused, since `datasets` would train on one type."""
    files = sorted(file for file in path.rglob("*") if file.is_file() and file.suffix in FOLDER_DATA_TYPES
                   and file.name not in NOT_DATA_FILES
                   and not any(part.startswith((".", "__")) for part in file.relative_to(path).parts))
    if not files:
        raise UserError(f"{name}: the folder holds no data files; put .jsonl, .json, .parquet or .csv files in it, "
                        f"or pass one file to --dataset_name.")
    kinds = {}
    for file in files:
        kinds.setdefault(FOLDER_DATA_TYPES[file.suffix], file)
    if len(kinds) > 1:
        found = ", ".join(f"{kind} ({file.relative_to(path)})" for kind, file in kinds.items())
        raise UserError(f"{name}: the folder holds data files of several types ({found}), and `datasets` reads only "
                        f"its most common type, leaving the others out; keep one type in the folder, or give each "
                        f"its own entry in `dataset_mixture:`.")
    for file in files:
        if file.suffix in FILE_BUILDERS:
            _check_file(file, str(file))


def _check_text(path: Path, name: str, json_lines: bool) -> None:
    """A text data file must be UTF-8, hold something and, as .jsonl, a JSON object on every line that is not blank:
    name the first line that does not (`datasets` only says the file failed, or fails later with a traceback)."""
    empty = True
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                text = line.decode("utf-8-sig" if number == 1 else "utf-8")  # `datasets` reads past a BOM
            except UnicodeDecodeError as error:
                raise UserError(f"{name}: line {number} is not UTF-8 text (its byte {error.start + 1}); save the file "
                                f"as UTF-8.") from None
            if not text.strip():
                continue
            if not json_lines or _check_json_line(text, number, name):
                empty = False
    if empty:
        raise UserError(NO_ROWS.format(name=name))


def _check_parquet(path: Path, name: str) -> None:
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise UserError(f"{name}: cannot be read as .parquet ({first_line(error)}); write the file again.") from None
    if rows == 0:
        raise UserError(NO_ROWS.format(name=name))


def _check_json_line(text: str, number: int, name: str) -> dict:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{name}: line {number} is not valid JSON ({error.msg}); fix or remove that line.") from None
    if not isinstance(row, dict):
        raise UserError(f"{name}: line {number} is not a JSON object; make each line one {{...}} row.")
    return row


def load_datasets(script: ScriptArguments, training: SFTConfig, length_tokenizer=None, sources=None,
                  record: dict | None = None, *, tokenizer=None) -> tuple[Dataset, Dataset | None]:
    """The train split, and the eval split when evaluation is on (carved from train when the data has none).
    With `length_tokenizer` (truncation: false), a row longer than max_length is refused as well. `sources` (finetune's
    arguments) brings `columns:`, `dataset_mixture:` and `chat_template_kwargs:` (given to every conversational row:
    TRL passes a row's `chat_template_kwargs` to the chat template); `record` receives the rows taken from each
    source. With `tokenizer`, reasoning traces (`thinking`) are checked against what its chat template renders, and
    where TRL cuts rows at max_length, rows whose whole answer it would cut away are counted."""
    checks = {"length_tokenizer": length_tokenizer, "max_length": training.max_length, "tokenizer": tokenizer,
              "chat_template_kwargs": getattr(sources, "chat_template_kwargs", None),
              "answer_tokenizer": tokenizer if length_tokenizer is None and _cuts_rows(training) else None}
    mixture = getattr(sources, "dataset_mixture", None)
    if mixture:
        train, evaluation = _load_mixture(mixture, script, training, checks, record)
        name = "dataset_mixture"
    else:
        train, evaluation = _load_single(script, training, checks, getattr(sources, "columns", None))
        name = script.dataset_name
    if training.assistant_only_loss and not is_conversational(train[0]):
        raise UserError(
            f"{name}: `assistant_only_loss: true` needs conversations (`messages`, or `prompt` and "
            f"`completion` as lists of turns), and these rows are plain text; set assistant_only_loss: false "
            f"(prompt-completion rows still train on the completion only)."
        )
    if training.eval_strategy == "no":
        evaluation = None
    elif evaluation is None:
        if len(train) < 2:
            raise UserError(f"{name}: one row cannot be split into training and evaluation rows (there is no "
                            f"`{script.dataset_test_split}` split); add rows or a test split, or set "
                            f"eval_strategy: no.")
        parts = train.train_test_split(test_size=EVAL_FRACTION_WHEN_NO_TEST_SPLIT, seed=training.seed)
        train, evaluation = parts["train"], parts["test"]
    if record is not None and not mixture:
        record["train"] = {f"{name} [{script.dataset_train_split}]": len(train)}
        record["test"] = {f"{name} [{script.dataset_test_split}]": len(evaluation)} if evaluation is not None else {}
    return train, evaluation


def _cuts_rows(training: SFTConfig) -> bool:
    """Whether TRL keeps only each row's first max_length tokens: truncation, or packing's best-fit strategy, which
    truncates what overflows (its other strategies split rows and keep every token)."""
    if training.max_length is None:
        return False
    return not training.packing or getattr(training, "packing_strategy", "bfd") == "bfd"


def _checked_split(splits: DatasetDict, name: str, split: str, columns, length_tokenizer, max_length, tokenizer,
                   chat_template_kwargs, answer_tokenizer) -> Dataset:
    source = f"{name} [{split}]"
    rows = row_checks.trl_rows(splits[split], source, columns)
    rows = row_checks.with_chat_template_kwargs(rows, chat_template_kwargs)
    if tokenizer is not None:
        row_checks.check_reasoning_traces(rows, source, tokenizer, max_length)
        row_checks.check_turn_fields(rows, source, tokenizer)
    if length_tokenizer is not None:
        row_checks.refuse_long_samples(rows, source, length_tokenizer, max_length)
    if answer_tokenizer is not None:
        row_checks.check_answers_survive_truncation(rows, source, answer_tokenizer, max_length)
    return rows


def _load_single(script: ScriptArguments, training: SFTConfig, checks: dict, columns):
    if not script.dataset_name:
        raise UserError("recipe: `dataset_name` is not set; give a hub id, a local folder or a .jsonl file.")
    columns = data_formats.column_choice(columns, "recipe")
    splits = _load(script.dataset_name, script.dataset_config)
    if script.dataset_train_split not in splits:
        raise UserError(
            f"{script.dataset_name}: no split named `{script.dataset_train_split}` (it has {sorted(splits)}); "
            f"set --dataset_train_split to one of them."
        )
    check = partial(_checked_split, splits, script.dataset_name, columns=columns, **checks)
    train = check(script.dataset_train_split)
    if training.eval_strategy == "no":
        return train, None
    if script.dataset_test_split in splits:
        return train, check(script.dataset_test_split)
    others = sorted(set(splits) - {script.dataset_train_split})
    # a `validation` split left unused is said with the setting that would use it
    use = f" (it has {others}: set dataset_test_split to evaluate on one of them)" if others else ""
    say(f"{script.dataset_name} has no `{script.dataset_test_split}` split{use}: evaluating on "
        f"{100 * EVAL_FRACTION_WHEN_NO_TEST_SPLIT:.0f}% of the train split.")
    return train, None


def _load_mixture(mixture, script: ScriptArguments, training: SFTConfig, checks: dict, record: dict | None):
    """Every source loaded, converted and checked like a single dataset, then mixed; the test mixture comes from each
    source's test split, or from a share of its rows set aside before mixing, so it holds every source."""
    mixture = data_formats.check_mixture(mixture, "recipe")
    seed = mixture.get("seed", training.seed)
    wants_eval = training.eval_strategy != "no"
    sources = [_load_source(entry, script, checks, seed, wants_eval) for entry in mixture["datasets"]]
    if wants_eval:
        sources = _with_test_rows(sources, mixture.get("test_split_size", EVAL_FRACTION_WHEN_NO_TEST_SPLIT), seed)
    train, train_counts = data_formats.mix([(label, rows, fraction) for label, rows, _, fraction in sources], seed,
                                           "recipe `dataset_mixture`")
    test, test_counts = (data_formats.mix([(label, test, fraction) for label, _, test, fraction in sources], seed,
                                          "recipe `dataset_mixture`") if wants_eval else (None, {}))
    if record is not None:
        record.update(train=train_counts, test=test_counts, seed=seed)
    return train, test


def _load_source(entry: dict, script: ScriptArguments, checks: dict, seed: int, wants_eval: bool):
    """One mixture entry: (label, its rows, its test split's rows or None, its fraction)."""
    splits = _load(entry["path"], entry.get("name"))
    split = entry.get("split", script.dataset_train_split)
    test_split = entry.get("test_split", script.dataset_test_split)
    if split not in splits:
        raise UserError(
            f"{entry['path']}: no split named `{split}` (it has {sorted(splits)}); set `split:` of its "
            f"dataset_mixture entry to one of them."
        )
    columns = data_formats.column_choice(entry.get("columns"), entry["path"])
    check = partial(_checked_split, splits, entry["path"], columns=columns, **checks)
    label = f"{entry['path']} [{split}]"
    rows = data_formats.keep_share(check(split), entry.get("weight"), seed, label)
    test = check(test_split) if wants_eval and test_split in splits else None
    return label, rows, test, entry.get("fraction")


def _with_test_rows(sources: list, size: float, seed: int) -> list:
    """Sources without a test split set rows aside for it: `test_split_size` is the share of each, or, as a whole
    number, the test rows wanted in all (alignment-handbook's `test_split_size: 1000`), shared in proportion to the
    sources' rows (at least one from each, so the test mixture holds every source)."""
    lengths = [len(rows) for _, rows, test, _ in sources if test is None]
    counts = iter(_test_row_counts(lengths, size) if isinstance(size, int) and lengths else [])
    carved = []
    for label, rows, test, fraction in sources:
        if test is None:
            test_size = next(counts) if isinstance(size, int) else math.ceil(size * len(rows))  # as `datasets` rounds
            if test_size >= len(rows):
                raise UserError(f"recipe: `dataset_mixture` `test_split_size: {size}` would take all {len(rows)} rows "
                                f"of {label} for testing; lower test_split_size.")
            parts = rows.train_test_split(test_size=test_size, seed=seed)
            rows, test = parts["train"], parts["test"]
        carved.append((label, rows, test, fraction))
    return carved


def _test_row_counts(lengths: list[int], size: int) -> list[int]:
    """`size` rows shared in proportion to `lengths`, the largest remainders rounded up, at least one each."""
    shares = [size * length / sum(lengths) for length in lengths]
    counts = [int(share) for share in shares]
    for index in sorted(range(len(shares)), key=lambda index: counts[index] - shares[index])[:size - sum(counts)]:
        counts[index] += 1
    return [max(count, 1) for count in counts]


def load_split(name: str, split: str, config_name: str | None = None) -> Dataset:
    """One split of a dataset (hub id, folder or file), in one of TRL's formats, its rows checked."""
    splits = _load(name, config_name)
    if Path(name).expanduser().is_file():  # a single file is a single split, whatever it is called
        split = next(iter(splits))
    if split not in splits:
        raise UserError(f"{name}: no split named `{split}` (it has {sorted(splits)}); pass --split with one of them.")
    return row_checks.trl_rows(splits[split], f"{name} [{split}]")
