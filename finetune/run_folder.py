"""Every file of an output folder: the run record, checkpoints and the markers that say a checkpoint (or the final
model) was written completely, atomic writes, and finding the newest complete checkpoint to resume from. Plain
files and JSON only: the launcher, the checks and the run all read the folder through here."""

from __future__ import annotations

import atexit
import fcntl
import json
import math
import os
import re
import shutil
import socket
import time
from pathlib import Path

from finetune.errors import UserError, say
from finetune.json_files import fsync, read_object, write_atomically

RUN_RECORD = "finetune_run.json"


def recorded_run(output_dir: str | Path) -> dict:
    """The run record of an output folder ({} when there is none or it is unreadable)."""
    return read_object(Path(output_dir) / RUN_RECORD)


MARKER = "finetune_checkpoint.json"


FINAL_MARKER = "finetune_final.json"  # written last, after the final model: the run is finished


PREEMPTED_EXIT_CODE = 143


CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")


# What a checkpoint needs besides its weights to resume exactly: one of these names for the optimizer state.
OPTIMIZER_STATE = ("optimizer.pt", "optimizer.bin", "optimizer_0", "pytorch_model_fsdp_0")


LOCK = "finetune_run.lock"  # the launch training into the folder now: a second one is refused while it lives
LOCK_BEING_WRITTEN = ".tmp"  # a lock's record written aside (finetune_run.lock.PID.tmp) before it is linked into place


def is_lock(name: str) -> bool:
    """The lock, or a launch's record of it not linked into place yet: neither is a file of the run's."""
    return name == LOCK or (name.startswith(f"{LOCK}.") and name.endswith(LOCK_BEING_WRITTEN))


def is_main() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def checkpoint_folders(output_dir: str | Path) -> list[tuple[int, Path]]:
    """The `checkpoint-N` folders of a run, oldest step first."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in folder.iterdir()
             if path.is_dir() and (match := CHECKPOINT_PATTERN.match(path.name))]
    return sorted(found)


def step_of(folder: Path) -> int | None:
    """N of a `checkpoint-N` folder (None for a folder of another name)."""
    match = CHECKPOINT_PATTERN.match(Path(folder).name)
    return int(match.group(1)) if match else None


def safetensors_header(path: Path) -> tuple[int, dict] | None:
    """The header of a .safetensors file (each tensor's dtype, shape and data offsets) and its length, read without
    the tensors; None when the file is shorter than its own header, OSError or ValueError when it cannot be read."""
    with open(path, "rb") as handle:
        header_length = int.from_bytes(handle.read(8), "little")
        if path.stat().st_size < 8 or 8 + header_length > path.stat().st_size:
            return None
        return header_length, json.loads(handle.read(header_length))


# Bytes per element of each safetensors dtype (the format's own list); a dtype not here is left to the reader
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                           "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _offsets_problem(header: dict) -> str | None:
    """Where a header's tensors do not tile the data as the safetensors reader requires: each tensor's bytes the size
    its dtype and shape take, one after another from byte 0 without gaps or overlaps. The reader refuses such a file
    only when it loads, in a traceback (`invalid offset for tensor`)."""
    entries = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape = [int(size) for size in entry["shape"]]
        except (KeyError, TypeError, ValueError):
            return f"tensor {name} has no readable shape and data_offsets"
        size = SAFETENSORS_DTYPE_BYTES.get(entry.get("dtype"))
        if size is not None and end - begin != size * math.prod(shape):
            return (f"tensor {name} takes bytes {begin}-{end}, where {entry.get('dtype')} {shape} takes "
                    f"{size * math.prod(shape)}")
        entries.append((begin, end, name))
    position = 0
    for begin, end, name in sorted(entries):
        if begin != position:
            return f"tensor {name} starts at byte {begin}, where the tensor before it ends at {position}"
        position = end
    return None


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot be read whole (truncated, bad header), or None."""
    size = path.stat().st_size
    try:
        read = safetensors_header(path)
    except (OSError, ValueError):
        return f"{path.name} has an unreadable header"
    if read is None:
        return f"{path.name} is truncated ({size} bytes, shorter than its own header)"
    header_length, header = read
    problem = _offsets_problem(header)
    if problem:
        return f"{path.name} has a header that does not fit its data ({problem})"
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    expected = 8 + header_length + data_end
    if size < expected:
        return f"{path.name} is truncated ({size} of {expected} bytes)"
    if size > expected:
        return f"{path.name} has {size - expected} bytes past its tensors"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why a checkpoint folder must not be resumed from, or None when it is complete."""
    marker_file = folder / MARKER
    if not marker_file.is_file():
        return f"no completeness marker ({MARKER}), so its save was interrupted"
    try:
        files = json.loads(marker_file.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its completeness marker {MARKER} is unreadable"
    problem = _listed_files_problem(folder, files)
    if problem:
        return problem
    names = set(files)
    weights = ("global_step", "pytorch_model_fsdp")
    if not any(name.endswith(".safetensors") or name.startswith(weights) for name in names):
        return "it holds no weights (no .safetensors file)"
    if "trainer_state.json" not in names:
        return "trainer_state.json is missing"
    if not any(name.split("/")[0] in OPTIMIZER_STATE or name.startswith("global_step") for name in names):
        return "it holds no optimizer state (optimizer.pt is missing)"
    for name in sorted(names):
        if name.endswith(".safetensors"):
            problem = safetensors_problem(folder / name)
            if problem:
                return problem
    return None


def _listed_files_problem(folder: Path, files: dict[str, int]) -> str | None:
    """Why the files a marker lists are not all there at their sizes, or None."""
    for name, size in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is truncated or changed ({path.stat().st_size} of {size} bytes)"
    return None


def newest_complete(output_dir: str | Path, report: bool = False) -> Path | None:
    """The newest complete checkpoint of a run; with `report`, say which one and why newer ones were skipped."""
    chosen, skipped = None, []
    for step, folder in reversed(checkpoint_folders(output_dir)):
        problem = checkpoint_problem(folder)
        if problem is None:
            chosen = folder
            break
        skipped.append((folder, problem))
    if report:
        for folder, problem in skipped:
            say(f"skipping {folder}: {problem}")
        if chosen is not None and skipped:
            say(f"resuming from {chosen}: the newest complete checkpoint")
        elif chosen is not None:
            say(f"resuming from {chosen}")
        elif skipped:
            say(f"no complete checkpoint in {output_dir}: training from the start")
    return chosen


def resume_point(requested: str | None, output_dir: str, announce: bool = True) -> str | None:
    """What `trainer.train(resume_from_checkpoint=...)` gets: the checkpoint asked for, checked, or the newest
    complete one in output_dir (None: start from scratch). Prints the choice on the main process."""
    if requested and str(requested).lower() not in ("true", "1", "yes"):
        problem = checkpoint_problem(Path(requested)) if Path(requested).is_dir() else "the folder does not exist"
        if problem:
            raise UserError(
                f"{requested}: cannot resume from this checkpoint ({problem}); pass another checkpoint-N folder to "
                f"--resume_from_checkpoint, or leave it out to resume from the newest complete one."
            )
        if announce and is_main():
            say(f"resuming from {requested}")
        return str(requested)
    chosen = newest_complete(output_dir, report=is_main())
    return str(chosen) if chosen is not None else None


def write_marker(folder: Path, step: int, world_size: int) -> None:
    """Flush every file of a finished checkpoint to disk, then write the marker that says it is complete."""
    files = _flushed_sizes(folder, folder.rglob("*"), MARKER)
    marker = {"step": step, "world_size": world_size, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    write_atomically(folder / MARKER, json.dumps(marker, indent=1) + "\n")


def _flushed_sizes(folder: Path, paths, marker: str) -> dict[str, int]:
    """Each file of `paths` (but the marker and files being written aside) flushed to disk, by its name under folder."""
    files = {}
    for path in sorted(paths):
        if path.is_file() and path.name not in (marker, LOCK) and not path.name.endswith(".tmp"):
            fsync(path)
            files[str(path.relative_to(folder))] = path.stat().st_size
    return files


def write_final_marker(output_dir: str | Path, step: int, length: dict) -> None:
    """After the final save: flush the output folder's files and write the marker listing them, last and atomically,
    so that a relaunch can tell a finished run (nothing to do) from one whose final save was cut short."""
    folder = Path(output_dir)
    files = _flushed_sizes(folder, folder.iterdir(), FINAL_MARKER)
    marker = {"step": step, "length": length, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": files}
    write_atomically(folder / FINAL_MARKER, json.dumps(marker, indent=1) + "\n")


def finished_step(output_dir: str | Path, length: dict | None = None) -> int | None:
    """The step at which this run finished, when its final model is complete (and, given `length`, it is relaunched
    to train as long as before); None when there is training or a final save left to do."""
    try:
        marker = json.loads((Path(output_dir) / FINAL_MARKER).read_text())
        files, step = marker["files"], int(marker["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (length is not None and marker.get("length") != length) or _listed_files_problem(Path(output_dir), files):
        return None
    return step


def rotate(output_dir: str | Path, save_total_limit: int | None, keep: set[Path] = frozenset()) -> list[Path]:
    """`save_total_limit`, applied only once the newest checkpoint is complete: keep the newest `save_total_limit`
    complete checkpoints (and `keep`), delete older complete ones and incomplete ones older than the newest complete
    one. Never deletes the newest complete checkpoint, nor anything newer than it."""
    if not save_total_limit or save_total_limit <= 0:
        return []
    folders = checkpoint_folders(output_dir)
    complete = [folder for _, folder in folders if checkpoint_problem(folder) is None]
    if not complete:
        return []
    newest_step = step_of(complete[-1])
    kept = set(complete[-save_total_limit:]) | {Path(path).resolve() for path in keep}
    deleted = []
    for step, folder in folders:
        if step >= newest_step or folder in kept or folder.resolve() in kept:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        deleted.append(folder)
    return deleted


def _launch() -> str:
    """What every process of one launch shares and no other launch does: the rendezvous address of a launch of
    several processes (one port is listened on by one launch at a time), else the host and the one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return f"{socket.gethostname()}:{os.getpid()}"


def _started(pid: int) -> str | None:
    """When a process started, in clock ticks since boot (Linux): a pid reused by a later process has another."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return started is None or _started(pid) in (None, started)


def lock_holder(output_dir: str | Path) -> dict | None:
    """The other launch training into output_dir now ({pid, host, since, ...}; {} for a lock that cannot be read), or
    None. A lock left by a process of this host that is gone (killed, the machine restarted) is stale and holds
    nothing."""
    return _live_holder(_read_lock(Path(output_dir) / LOCK))


def _read_lock(lock: Path) -> dict | None:
    """What a lock file records; None when there is none, {} when it is empty or damaged (never written by take_lock,
    which links a lock into place whole)."""
    try:
        held = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return held if isinstance(held, dict) else {}


def _live_holder(held: dict | None) -> dict | None:
    if held is None or held.get("launch") == _launch():
        return None
    try:
        pid = int(held["pid"])
    except (KeyError, TypeError, ValueError):
        return {}  # no launch can be told from it: held, not stale
    if held.get("host") == socket.gethostname() and not _alive(pid, held.get("started")):
        return None
    return held


def in_use_sentence(output_dir: str | Path, holder: dict) -> str:
    lock = Path(output_dir) / LOCK
    if "pid" not in holder:
        return (f"{lock}: this lock names no launch (no pid and host: empty or damaged), so whether another launch "
                f"trains into {output_dir} cannot be told; delete the file if none does, or pick another --output_dir.")
    return (f"{output_dir}: output_dir is in use by another launch (pid {holder['pid']} on {holder.get('host')}, "
            f"since {holder.get('since')}; {lock}); wait for it to end or pick another --output_dir (delete the lock "
            f"file only if that process is gone).")


def take_lock(output_dir: str | Path) -> None:
    """Mark output_dir as trained into by this launch, until this process exits; refused while another live launch
    holds it, a stale lock replaced with a line. The record is written aside and linked into place whole (os.link
    fails while the name exists), so a lock is never empty and of launches started together one wins."""
    folder = Path(output_dir)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK
    pid = os.getpid()
    record = {"pid": pid, "host": socket.gethostname(), "launch": _launch(), "started": _started(pid),
              "since": time.strftime("%Y-%m-%dT%H:%M:%S"), "created_folder": created}
    written = folder / f"{LOCK}.{pid}{LOCK_BEING_WRITTEN}"
    written.write_text(json.dumps(record) + "\n")
    try:
        while True:  # a stale lock is removed and taking it tried again
            try:
                os.link(written, lock)
                break
            except FileExistsError:
                held = _read_lock(lock)
                holder = _live_holder(held)
                if holder is not None:
                    raise UserError(in_use_sentence(folder, holder)) from None
                if held and _remove_stale(lock, held) and held.get("launch") != record["launch"]:
                    say(f"{lock}: the launch that held it (pid {held.get('pid')}) is gone; taking the folder over")
    finally:
        written.unlink(missing_ok=True)
    atexit.register(release_lock, folder)


def _remove_stale(lock: Path, judged: dict) -> bool:
    """Remove the lock judged stale, unless the name holds another lock by now. Launches taking over the same stale
    lock take turns on it (flock on the stale file): the first removes it, the others then find the name gone or
    linked to the winner's lock, and remove nothing."""
    try:
        descriptor = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        try:
            same_file = os.stat(lock).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            return False
        with os.fdopen(os.dup(descriptor)) as handle:
            text = handle.read()
        if not same_file or _parsed(text) != judged:
            return False
        os.unlink(lock)
        return True
    finally:
        os.close(descriptor)


def _parsed(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def release_lock(output_dir: str | Path) -> None:
    """Remove output_dir's lock when this process holds it, and the folder too when taking the lock created it and
    nothing was written there since (a run refused while loading leaves no trace)."""
    folder = Path(output_dir)
    held = _read_lock(folder / LOCK) or {}
    if held.get("pid") != os.getpid():
        return
    (folder / LOCK).unlink(missing_ok=True)
    if held.get("created_folder") and not any(folder.iterdir()):
        folder.rmdir()
