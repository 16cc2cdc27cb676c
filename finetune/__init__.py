"""finetune: supervised fine-tuning recipes for Llama 3.2 and GPT-OSS over TRL, peft, accelerate and DeepSpeed.

From Python: `finetune.train(config=..., **overrides)` trains in this process, `finetune.launch(config=...,
num_processes=N, accelerate_config=..., **overrides)` as N processes (finetune/api.py). Importing finetune loads
neither torch nor trl; they load when a run starts.
"""

import importlib
import logging
import types

__version__ = "0.1.0"

NOTEBOOK_ENTRY_POINTS = ("train", "launch")

# peft imports bitsandbytes whenever transformers is imported (peft/helpers.py), QLoRA or not; on a CPU with AVX512-BF16
# and no hub access it then logs that it could not fetch an optional CPU 4-bit kernel, which only QLoRA on CPU would use
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


class _EntryPointModule(types.ModuleType):
    """`finetune.train` and `finetune.launch` are modules (the trainer, the launcher) and, called, the notebook
    functions of the same name in finetune/api.py: Python binds a submodule to its package's attribute of the same
    name on import, so a plain function there would be replaced by the module the first time a run imports it."""

    def __call__(self, *args, **kwargs):
        from finetune import api

        return getattr(api, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


def make_callable(module: types.ModuleType) -> None:
    module.__class__ = _EntryPointModule


def __getattr__(name: str):
    if name in NOTEBOOK_ENTRY_POINTS:
        return importlib.import_module(f"finetune.{name}")  # the module makes itself callable as it loads
    raise AttributeError(f"module 'finetune' has no attribute {name!r}")
