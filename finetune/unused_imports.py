"""Packages a run does not use, kept from being imported. accelerate imports DeepSpeed whenever it is installed (to
unwrap models, in every run), and DeepSpeed imports MLflow (its autotuner): 2.1 s of the tiny default run's 16 s on a
CPU before its first step, measured with `python -X importtime`."""

import os
import sys


def skip_deepspeed(training) -> None:
    """A run that does not use DeepSpeed sees it as not installed: None in sys.modules is Python's own "no such
    module", so accelerate's and transformers' checks (importlib.util.find_spec) answer False and nothing imports it.
    A later run in this process that uses DeepSpeed (the Python API) gets it back."""
    uses_deepspeed = bool(training.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if uses_deepspeed and "deepspeed" in sys.modules and sys.modules["deepspeed"] is None:
        del sys.modules["deepspeed"]
    elif not uses_deepspeed:
        sys.modules.setdefault("deepspeed", None)
