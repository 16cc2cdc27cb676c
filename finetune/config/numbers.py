"""Numbers outside the range where they mean something, refused in one sentence before anything loads, not as a
traceback after loading or a run that silently trains something else. Shared by the run (config.check, on the parsed
arguments) and the planner (on the recipe and flags it reads without TRL's parser): `value_of(key)` is the run's value
of a key, None when it is unset. Imports nothing heavy.
"""

import math
from collections.abc import Callable

from finetune.errors import UserError

AT_LEAST_ONE = "must be a whole number of at least 1"


STEPS_SHARE = "must be above 0 with its strategy `steps` (a fraction below 1 is a share of the run)"


# (key, whether a value is in range, what the value means): checked whenever the key has a number
RANGES = [
    ("per_device_train_batch_size", lambda value: value >= 1, AT_LEAST_ONE),
    ("per_device_eval_batch_size", lambda value: value >= 1, AT_LEAST_ONE),
    ("gradient_accumulation_steps", lambda value: value >= 1, AT_LEAST_ONE),
    ("learning_rate", lambda value: math.isfinite(value) and value > 0, "must be a finite number above 0"),
    ("max_length", lambda value: value >= 1, "is the tokens per row and must be at least 1 (or unset)"),
    ("max_steps", lambda value: value > 0 or value == -1, ("must be above 0, or -1 to train num_train_epochs "
                                                           "(transformers would otherwise train the epochs instead "
                                                           "without a word)")),
    ("eval_samples_before_after", lambda value: value >= 0, "must be 0 (no scores) or more"),
    # the optimizer's and the schedule's, which torch checks only once the model is loaded, or never (NaN weights)
    ("warmup_steps", lambda value: math.isfinite(value) and value >= 0,
     "must be 0 or more (below 1: that share of the steps)"),
    ("weight_decay", lambda value: math.isfinite(value) and value >= 0, "must be a finite number, 0 or more"),
    ("max_grad_norm", lambda value: value >= 0, "must be 0 or more (0 turns clipping off)"),
    ("adam_epsilon", lambda value: math.isfinite(value) and value > 0, "must be a finite number above 0"),
    ("adam_beta1", lambda value: 0 <= value < 1, "is a decay rate and must be at least 0 and below 1"),
    ("adam_beta2", lambda value: 0 <= value < 1, "is a decay rate and must be at least 0 and below 1"),
    ("dataset_num_proc", lambda value: value >= 1, "must be at least 1 (or unset)"),
]


LORA_RANGES = [
    ("lora_r", lambda value: value >= 1, "is the adapters' rank and must be at least 1"),
    ("lora_alpha", lambda value: math.isfinite(value) and value > 0, "scales the adapters and must be above 0"),
    ("lora_dropout", lambda value: 0 <= value < 1, "is a probability and must be at least 0 and below 1"),
]


# The training arguments' mapping fields that take a JSON object only (the others also take a file's path)
MAPPING_FIELDS = ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "activation_checkpointing_kwargs",
                  "model_init_kwargs", "dataset_kwargs")


def check_numbers(value_of: Callable[[str], object], source: str) -> None:
    def number(key: str):
        value = value_of(key)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else None

    def refuse(key: str, meaning: str) -> None:
        raise UserError(f"{source}: `{key}: {value_of(key)}` {meaning}; fix `{key}` (a recipe key or --{key}).")

    ranges = RANGES + (LORA_RANGES if value_of("use_peft") else [])
    for key, in_range, meaning in ranges:
        if number(key) is not None and not in_range(number(key)):
            refuse(key, meaning)
    max_steps, epochs = number("max_steps"), number("num_train_epochs")
    if max_steps is not None and max_steps <= 0 and epochs is not None and not epochs > 0:
        refuse("num_train_epochs", "trains nothing without a positive max_steps; give a number of epochs above 0 or "
                                   "set max_steps")
    for key in ("save_steps", "logging_steps", "eval_steps"):
        strategy = value_of(key.replace("_steps", "_strategy"))
        if number(key) is not None and number(key) <= 0 and str(getattr(strategy, "value", strategy)) == "steps":
            refuse(key, STEPS_SHARE)
    for key in MAPPING_FIELDS:
        if isinstance(value_of(key), str):
            refuse(key, "must be a mapping, e.g. {\"power\": 2} (JSON on the command line)")
