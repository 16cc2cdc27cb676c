"""finetune: supervised fine-tuning recipes for Llama 3.2 and GPT-OSS over TRL, peft, accelerate and DeepSpeed.

From Python: `finetune.train(config=..., **overrides)` trains in this process, `finetune.launch(config=...,
num_processes=N, accelerate_config=..., **overrides)` as N processes (finetune/api.py). Importing finetune loads
neither torch nor trl; they load when a run starts.
"""

import logging

from finetune.compile_cache import keep_compile_caches

# before torch is imported (every entry point imports finetune first): torch writes its /tmp default into the
# environment the first time its compiler is imported, and that folder is gone after a reboot
keep_compile_caches()

from finetune.api import launch, train  # noqa: E402, F401  (the notebook entry points; api.py imports nothing heavy)

__version__ = "0.1.0"

# peft imports bitsandbytes whenever it is installed (finetune/sft.py keeps it out of runs that do not use it); on a CPU
# with AVX512-BF16 and no hub access it then logs that it could not fetch an optional CPU 4-bit kernel, which only QLoRA
# on CPU would use
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
