"""The CLI starts its own local Ray when no address is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cli_starts_local_ray_and_places_bundles() -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [
            sys.executable, "-m", "rlframe.main", "model.path=unused", "trainer.device=cpu",
            "trainer.procs_per_node=2", "actor.mini_batch_size=32", "actor.micro_batch_size=4",
            "ray.num_cpus=2",
        ],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )
    out = result.stdout + result.stderr
    assert "Ray up (started locally), 2 cpu bundle(s) placed: {'CPU': 1} each" in out, out
    assert "Traceback" not in out
