"""Where torch keeps what it compiles: one folder per machine that outlives /tmp, so that a second launch of a
compiled recipe loads its graphs (Inductor's FX graphs, AOTAutograd's forward and backward, Triton's kernels and
autotuning results) instead of compiling them again.

torch picks its folder (`/tmp/torchinductor_<user>`) and writes it into TORCHINDUCTOR_CACHE_DIR the first time
anything imports its compiler (TRL's `SFTConfig` does, through transformers), and /tmp is emptied by a reboot or a new
container. So the folder is set when finetune is imported, before torch: `finetune/__init__.py` calls
`keep_compile_caches`, and the run calls it again with its `compile_cache_dir` (a flag or recipe key) if it has one.
Imports nothing heavy: it runs before torch is imported.
"""

import getpass
import os
import re
import tempfile
from pathlib import Path

COMPILE_CACHE_ENV = "FINETUNE_COMPILE_CACHE"  # moves the whole folder, like the `compile_cache_dir` flag
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # FX graphs, AOTAutograd, autotuning (torch reads it at each use)
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def default_compile_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "compile"


def compile_cache() -> Path:
    """The folder this process's compile caches live in."""
    return Path(os.environ.get(COMPILE_CACHE_ENV) or default_compile_cache()).expanduser()


def _torch_default_inductor_folder() -> str:
    """The folder torch writes into TORCHINDUCTOR_CACHE_DIR when nobody set it (torch/_inductor/runtime/
    cache_dir_utils.py: default_cache_dir), worked out without importing torch: a value equal to it is torch's own
    choice, not the user's."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def keep_compile_caches(folder: str | None = None) -> Path:
    """Point torch's compile caches at `folder` (a run's `compile_cache_dir`), else FINETUNE_COMPILE_CACHE, else
    ~/.cache/finetune/compile. A TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR the user set wins over the environment
    variable and the default, not over `folder`, which the run's own flag or recipe asked for."""
    if folder:
        os.environ[COMPILE_CACHE_ENV] = str(Path(folder).expanduser().absolute())
    root = compile_cache()
    inductor = os.environ.get(INDUCTOR_CACHE_ENV)
    if folder or not inductor or inductor == _torch_default_inductor_folder():
        os.environ[INDUCTOR_CACHE_ENV] = str(root / "inductor")
    if folder or not os.environ.get(TRITON_CACHE_ENV):
        os.environ[TRITON_CACHE_ENV] = str(root / "triton")
    return root
