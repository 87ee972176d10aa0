"""What the async run tests share: the two placements on 2 CPUs, and a resumable copy of a
run directory."""

from __future__ import annotations

import shutil
from pathlib import Path

PLACEMENTS = {
    "colocated": ["trainer.cpus_per_proc=2"],
    "separate": [
        "rollout.placement=separate",
        "trainer.cpus_per_proc=1",
        "rollout.cpus_per_proc=1",
        "ray.num_cpus=2",
    ],
}


def resume_from_copy(straight: Path, out: Path, step: int) -> Path:
    """A copy of ``straight``'s run directory set to resume from its checkpoint at ``step``."""
    shutil.copytree(straight, out, symlinks=True, ignore=shutil.ignore_patterns(".lock"))
    ckpts = out / "checkpoints"
    for later in ckpts.glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (ckpts / "latest").write_text(f"step_{step:08d}")
    return ckpts / f"step_{step:08d}"
