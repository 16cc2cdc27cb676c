"""Every number the run parses has a range (finetune/config/numbers.py), found by walking the argument dataclasses'
fields: a numeric field that a new TRL or transformers adds fails here until it is given one."""

import dataclasses
import math
import types
import typing

import pytest
from trl import ModelConfig, ScriptArguments, SFTConfig

from finetune.config import numbers
from finetune.errors import UserError
from finetune.run.arguments import FinetuneArguments

RUN_DATACLASSES = (ScriptArguments, SFTConfig, ModelConfig, FinetuneArguments)


def numeric_kinds(annotation) -> set[type]:
    """int and float in a field's type (`int`, `float | None`, `Union[int, str]`), never bool."""
    if annotation in (int, float):
        return {annotation}
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set().union(*(numeric_kinds(argument) for argument in typing.get_args(annotation)))
    return set()


def numeric_fields() -> dict[str, set[type]]:
    found = {}
    for dataclass in RUN_DATACLASSES:
        hints = typing.get_type_hints(dataclass)
        for field in dataclasses.fields(dataclass):
            if numeric_kinds(hints[field.name]):
                found[field.name] = numeric_kinds(hints[field.name])
    return found


def test_every_numeric_field_of_the_run_has_a_range():
    assert len(numeric_fields()) > 30  # the walk found the fields
    assert sorted(set(numeric_fields()) - numbers.RANGED_KEYS) == []


def test_every_range_is_of_a_field_the_run_parses():
    assert sorted(numbers.RANGED_KEYS - set(numeric_fields())) == []


FLOAT_FIELDS = sorted(name for name, kinds in numeric_fields().items() if float in kinds)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_no_float_field_takes_nan_or_infinity(key, value):
    with pytest.raises(UserError, match=f"`{key}: {value}` must be a finite number; fix `{key}`"):
        numbers.check_numbers(lambda name: value if name == key else True if name == "use_peft" else None, "r.yaml")


def test_the_defaults_are_in_range():
    defaults = {field.name: field.default for dataclass in RUN_DATACLASSES for field in dataclasses.fields(dataclass)
                if field.default is not dataclasses.MISSING}
    numbers.check_numbers(lambda name: True if name == "use_peft" else defaults.get(name), "defaults")
