"""The CLI joins a running cluster (here: the test session's) instead of starting one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import spawn_cli

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]


def test_cli_joins_running_cluster(tmp_path: Path) -> None:
    import ray

    address = ray.get_runtime_context().gcs_address
    nodes_before = len(ray.nodes())
    # A fresh process, not run_recipe: joining from a driver that has not initialised Ray is
    # what is checked (in this process Ray is already up, and the launcher would reuse it).
    result = spawn_cli(
        "+recipe=grpo_tiny",
        f"ray.address={address}",
        "trainer.total_steps=1",
        "trainer.cpus_per_proc=1",
        f"trainer.output_dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"rlframe: ray      joined {address}" in result.stdout
    assert "Started a local Ray instance" not in (tmp_path / "logs" / "driver.log").read_text()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 1
    # The joined cluster outlives the job: same nodes, still answering.
    assert len(ray.nodes()) == nodes_before and ray.cluster_resources()["CPU"] == 4
