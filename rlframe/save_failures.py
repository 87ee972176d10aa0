"""A checkpoint save that fails says why in one line, and leaves no partial save behind.

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


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved; the message names the path and the intact one."""


def is_disk_full(path: Path, error: BaseException) -> bool:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
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
        f"the partial save was removed; {kept}"
    )
