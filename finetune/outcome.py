"""How a run ended, written by its training processes for whoever launched them (`finetune launch`,
`finetune.launch(...)`) to read: the status, the output folder, the error sentence. The launcher names the file in the
environment; nothing is read back from the processes' printed output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune import json_files

OUTCOME_FILE = "FINETUNE_OUTCOME_FILE"  # the environment variable the launcher sets to a file of its own
SAVED, FINISHED_ALREADY, USER_ERROR, PREEMPTED = "saved", "finished_already", "user_error", "preempted"


def record(status: str, output_dir: str | os.PathLike | None = None, error: str | None = None) -> None:
    """Write the outcome (aside, then renamed, so a reader never sees half of it); nothing when no launcher asked."""
    path = os.environ.get(OUTCOME_FILE)
    if not path:
        return
    outcome = {"status": status, "output_dir": str(output_dir) if output_dir is not None else None, "error": error}
    json_files.write_atomically(Path(path), json.dumps(outcome) + "\n")


def read(path: str | os.PathLike) -> dict:
    """The outcome a run wrote ({} when it wrote none: it crashed, or was killed)."""
    return json_files.read_object(path)
