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
from dataclasses import dataclass
from pathlib import Path

COMPILE_CACHE_ENV = "FINETUNE_COMPILE_CACHE"  # moves the whole folder, like the `compile_cache_dir` flag
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # FX graphs, AOTAutograd, autotuning (torch reads it at each use)
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def default_compile_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "compile"


def compile_cache() -> Path:
    """The folder this process's compile caches live in."""
    return Path(os.environ.get(COMPILE_CACHE_ENV) or default_compile_cache()).expanduser().absolute()


def _torch_default_inductor_folder() -> str:
    """The folder torch writes into TORCHINDUCTOR_CACHE_DIR when nobody set it (torch/_inductor/runtime/
    cache_dir_utils.py: default_cache_dir), worked out without importing torch: a value equal to it is torch's own
    choice, not the user's."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


@dataclass(frozen=True)
class UnusableCache:
    """A compile cache folder that cannot be written, why, and what named it (None: this toolkit's default)."""
    folder: Path
    reason: str
    named_by: str | None


def unusable_compile_cache(folder: str | None = None) -> UnusableCache | None:
    """Why the folder a run's compile caches are to go to (its `compile_cache_dir`, else FINETUNE_COMPILE_CACHE, else
    the default) cannot be written; None when it can, or when the user's own TORCHINDUCTOR_CACHE_DIR and
    TRITON_CACHE_DIR send both caches elsewhere."""
    if not folder and _user_chose_inductor_folder() and os.environ.get(TRITON_CACHE_ENV):
        return None
    root = Path(folder).expanduser().absolute() if folder else compile_cache()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as error:
        named_by = "compile_cache_dir" if folder else COMPILE_CACHE_ENV if os.environ.get(COMPILE_CACHE_ENV) else None
        reason = "a file, not a folder" if root.is_file() else error.strerror or type(error).__name__
        return UnusableCache(root, reason, named_by)
    return None


def _user_chose_inductor_folder() -> bool:
    inductor = os.environ.get(INDUCTOR_CACHE_ENV)
    return bool(inductor) and inductor != _torch_default_inductor_folder()


def keep_compile_caches(folder: str | None = None) -> Path:
    """Point torch's compile caches at `folder` (a run's `compile_cache_dir`), else FINETUNE_COMPILE_CACHE, else
    ~/.cache/finetune/compile. A TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR the user set wins over the environment
    variable and the default, not over `folder`, which the run's own flag or recipe asked for. A folder that cannot
    be written is left to torch's own in /tmp (torch creates its folder when its compiler is imported, and that import
    fails where it cannot); the run's check says so (finetune/checks/recipe.py: check_compile_cache)."""
    if unusable_compile_cache(folder):
        return compile_cache()
    if folder:
        os.environ[COMPILE_CACHE_ENV] = str(Path(folder).expanduser().absolute())
    root = compile_cache()
    if folder or not _user_chose_inductor_folder():
        os.environ[INDUCTOR_CACHE_ENV] = str(root / "inductor")
    if folder or not os.environ.get(TRITON_CACHE_ENV):
        os.environ[TRITON_CACHE_ENV] = str(root / "triton")
    return root


def inductor_cache() -> str:
    """The folder Inductor's and AOTAutograd's caches are in, wherever it was chosen."""
    return os.environ.get(INDUCTOR_CACHE_ENV) or _torch_default_inductor_folder()
