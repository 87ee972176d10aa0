"""Failed writes: a checkpoint save that fails says why in one line and leaves no partial
save behind; a full disk anywhere in the run directory ends the run in one line with exit
status :data:`DISK_FULL_EXIT`.

A full disk shows up in many shapes: ``OSError(ENOSPC)`` from the driver's own writes, or,
from a rank's ``torch.distributed.checkpoint`` writer, a worker traceback that ends in
something like ``unexpected pos 704 vs 598``. So the folder's free space is read *before*
the partial save is removed: nearly nothing left means the disk was full, whatever the
error said.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

FULL_BELOW_BYTES = 1 << 20
"""Less free space than this on the checkpoint's file system counts as a full disk."""

DISK_FULL_EXIT = 74
"""Exit status of a run stopped by a full disk (``EX_IOERR`` of sysexits.h)."""

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved; the message names the path and the intact one."""

    def __init__(self, message: str, disk_full: bool = False) -> None:
        super().__init__(message)
        self.disk_full = disk_full


def find_full_disk(error: BaseException) -> OSError | None:
    """The ``OSError(ENOSPC / EDQUOT)`` behind ``error`` (itself, its cause or the error it
    was raised while handling), or None when the disk was not full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_DISK_ERRNOS:
            return current
        current = current.__cause__ or current.__context__
    return None


def describe_full_disk(error: OSError, output_dir: str | Path, where: str, then: str) -> str:
    """One line: the file that could not be written (the run directory when the error does
    not say), where the run stopped and how it resumes (``where`` and ``then`` as
    :func:`rlframe.run.interrupts.describe_position` gives them)."""
    path = error.filename if error.filename else Path(output_dir)
    return (
        f"rlframe: no space left on device writing {path}; the run stopped {where}; "
        f"{then} once there is room"
    )


def is_disk_full(path: Path, error: BaseException) -> bool:
    if find_full_disk(error) is not None:
        return True
    if "No space left on device" in str(error):
        return True
    try:
        return shutil.disk_usage(path).free < FULL_BELOW_BYTES
    except OSError:
        return False


def describe_failed_save(tmp: Path, previous: Path | None, error: BaseException) -> CheckpointError:
    """Remove the partial save ``tmp`` and describe the failure in one line."""
    full = is_disk_full(tmp.parent, error)
    shutil.rmtree(tmp, ignore_errors=True)
    if full:
        why = f"no space left on device ({tmp.parent})"
    else:
        lines = [line for line in str(error).strip().splitlines() if line.strip()]
        why = f"{type(error).__name__}: {lines[-1] if lines else ''}".strip()
    kept = (
        f"the previous checkpoint {previous} is intact and resumable"
        if previous is not None
        else "there is no earlier checkpoint"
    )
    return CheckpointError(
        f"could not save checkpoint {tmp.name.removeprefix('.tmp_')} in {tmp.parent}: {why}; "
        f"the partial save was removed; {kept}",
        disk_full=full,
    )
