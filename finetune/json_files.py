"""The one way the toolkit reads a JSON object file it or another program wrote, and the one way it writes a file
that a kill must never leave half-written."""

import json
import os
from pathlib import Path


def read_object(path: str | os.PathLike) -> dict:
    """A JSON object file's values; {} when it is missing, damaged or not an object (the caller decides whether that
    is a problem, and names it)."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, text: str) -> None:
    """Write aside (a name of this process's own, so that processes writing the same file never share one), flush to
    disk, rename: a kill or a full disk leaves the previous file or the new one, never half of one."""
    path = Path(path)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync(path.parent)
