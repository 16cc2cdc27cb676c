"""Numbers outside the range where they mean something, refused in one sentence before anything loads, not as a
traceback after loading or a run that silently trains something else. Shared by the run (checks/recipe.py, on the parsed
arguments) and the planner (on the recipe and flags it reads without TRL's parser): `value_of(key)` is the run's value
of a key, None when it is unset. Imports nothing heavy.
"""

import math
from collections.abc import Callable

from finetune.errors import UserError

AT_LEAST_ONE = "must be a whole number of at least 1"


AT_LEAST_ONE_OR_UNSET = "must be a whole number of at least 1 (or unset)"


STEPS_SHARE = "must be above 0 (a fraction below 1 is a share of the run)"


PROBABILITY = "is a probability and must be at least 0 and below 1"


DECAY_RATE = "is a decay rate and must be at least 0 and below 1"


SEED = "seeds numpy, which takes 0 to 2**32 - 1"


# (key, whether a value is in range, what the value means): every numeric field of the dataclasses the run parses
# (ScriptArguments, SFTConfig, ModelConfig, FinetuneArguments; tests/test_numbers.py walks them), checked whenever
# the key has a number. NaN and infinity are refused for every one of them before its range is asked.
RANGES = [
    ("per_device_train_batch_size", lambda value: value >= 1, AT_LEAST_ONE),
    ("per_device_eval_batch_size", lambda value: value >= 1, AT_LEAST_ONE),
    ("gradient_accumulation_steps", lambda value: value >= 1, AT_LEAST_ONE),
    ("eval_accumulation_steps", lambda value: value >= 1, AT_LEAST_ONE_OR_UNSET),
    ("learning_rate", lambda value: value > 0, "must be above 0"),
    ("max_length", lambda value: value >= 1, "is the tokens per row and must be at least 1 (or unset)"),
    ("max_steps", lambda value: value > 0 or value == -1, ("must be above 0, or -1 to train num_train_epochs "
                                                           "(transformers would otherwise train the epochs instead "
                                                           "without a word)")),
    ("num_train_epochs", lambda value: value >= 0, "must be 0 or more (a positive max_steps wins over it)"),
    ("eval_samples_before_after", lambda value: value >= 0, "must be 0 (no scores) or more"),
    # the optimizer's and the schedule's, which torch checks only once the model is loaded, or never (NaN weights)
    ("warmup_steps", lambda value: value >= 0, "must be 0 or more (below 1: that share of the steps)"),
    ("weight_decay", lambda value: value >= 0, "must be 0 or more"),
    ("max_grad_norm", lambda value: value >= 0, "must be 0 or more (0 turns clipping off)"),
    ("adam_epsilon", lambda value: value > 0, "must be above 0"),
    ("adam_beta1", lambda value: 0 <= value < 1, DECAY_RATE),
    ("adam_beta2", lambda value: 0 <= value < 1, DECAY_RATE),
    ("label_smoothing_factor", lambda value: 0 <= value < 1, PROBABILITY),
    ("neftune_noise_alpha", lambda value: value >= 0, "scales NEFTune's noise and must be 0 or more (or unset)"),
    ("router_aux_loss_coef", lambda value: value >= 0, "weighs the router's loss and must be 0 or more (or unset)"),
    ("dataset_num_proc", lambda value: value >= 1, "must be at least 1 (or unset)"),
    ("pad_to_multiple_of", lambda value: value >= 1, AT_LEAST_ONE_OR_UNSET),
    # how often: a share of the run below 1, steps from 1 on
    ("logging_steps", lambda value: value > 0, STEPS_SHARE),
    ("save_steps", lambda value: value > 0, STEPS_SHARE),
    ("eval_steps", lambda value: value > 0, STEPS_SHARE),
    ("eval_delay", lambda value: value >= 0, "must be 0 or more"),
    # transformers reads 0 as no limit, keeping every checkpoint of a recipe that meant to keep none; below 0 it fails
    ("save_total_limit", lambda value: value >= 1,
     "must be at least 1 (transformers reads 0 as no limit and keeps every checkpoint: write `save_total_limit: "
     "null` or --save_total_limit None for that, `save_strategy: no` to save none)"),
    ("torch_empty_cache_steps", lambda value: value >= 1, AT_LEAST_ONE_OR_UNSET),
    ("seed", lambda value: 0 <= value < 2**32, SEED),
    ("data_seed", lambda value: 0 <= value < 2**32, SEED),
    # the processes' and data loaders'
    ("dataloader_num_workers", lambda value: value >= 0, "must be 0 (load in the training process) or more"),
    ("dataloader_prefetch_factor", lambda value: value >= 1, AT_LEAST_ONE_OR_UNSET),
    ("ddp_bucket_cap_mb", lambda value: value >= 1, AT_LEAST_ONE_OR_UNSET),
    ("ddp_timeout", lambda value: value >= 1, "is seconds and must be at least 1"),
    ("local_rank", lambda value: value >= -1, "is set by the launcher: -1 or a process's rank from 0"),
    # finetune's own
    ("tiny_width", lambda value: value >= 1, AT_LEAST_ONE),
    ("activation_memory_budget", lambda value: 0 < value <= 1,
     "is the fraction of a compiled layer's activations it may keep and must be above 0 and at most 1"),
]


LORA_RANGES = [
    ("lora_r", lambda value: value >= 1, "is the adapters' rank and must be at least 1"),
    ("lora_alpha", lambda value: value > 0, "scales the adapters and must be above 0"),
    ("lora_dropout", lambda value: 0 <= value < 1, PROBABILITY),
]


RANGED_KEYS = {key for key, _, _ in RANGES + LORA_RANGES}


# The training arguments' mapping fields that take a JSON object only (the others also take a file's path)
MAPPING_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
                  "model_init_kwargs", "dataset_kwargs")


# Where a key's value came from, for the message: one file or flag for all, or a function of the key
Source = str | Callable[[str], str]


def check_numbers(value_of: Callable[[str], object], source: Source) -> None:
    """The first of `number_problems`, raised."""
    for problem in number_problems(value_of, source).values():
        raise problem


def number_problems(value_of: Callable[[str], object], source: Source) -> dict[str, UserError]:
    """Every number out of its range, and every mapping field not given as a mapping, by key."""
    found = range_problems(value_of, source)
    for key in MAPPING_FIELDS:
        if isinstance(value_of(key), str):
            found[key] = UserError(f"{_where(source, key)}: `{key}: {value_of(key)}` must be a mapping, e.g. {{\"power\": 2}} (JSON "
                                   f"on the command line); fix `{key}` (a recipe key or --{key}).")
    return found


def _where(source: Source, key: str) -> str:
    return source if isinstance(source, str) else source(key)


def range_problems(value_of: Callable[[str], object], source: Source) -> dict[str, UserError]:
    """Every number out of its range (or not finite, for a float), by key, in the order of RANGES."""
    def number(key: str):
        value = value_of(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def problem(key: str, meaning: str) -> UserError:
        return UserError(f"{_where(source, key)}: `{key}: {value_of(key)}` {meaning}; fix `{key}` (a recipe key or --{key}).")

    found = {}
    max_steps, epochs = number("max_steps"), number("num_train_epochs")
    if max_steps is not None and max_steps <= 0 and epochs is not None and epochs <= 0:
        found["num_train_epochs"] = problem("num_train_epochs", "trains nothing without a positive max_steps; give a "
                                                                "number of epochs above 0 or set max_steps")
    ranges = RANGES + (LORA_RANGES if value_of("use_peft") else [])
    for key, in_range, meaning in ranges:
        value = number(key)
        if key in found or value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            found[key] = problem(key, "must be a finite number")
        elif not in_range(value):
            found[key] = problem(key, meaning)
    return found
