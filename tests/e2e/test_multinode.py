"""``trainer.nnodes=2`` on two virtual Ray nodes: one rank per node, and the run learns
exactly as two ranks on one node do (same seeds, same data, same reductions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, clean_env, read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 6
COMMON = [
    f"trainer.total_steps={STEPS}",
    "trainer.cpus_per_proc=1",
    "actor.micro_batch_size=64",
]


def test_two_nodes_place_one_rank_each_and_learn_like_one_node(tmp_path: Path) -> None:
    """Over 120 s: a two-node cluster of its own (two raylets) must start, and two 6-step
    runs compared (the one-node run on the session's cluster, in-process)."""
    result_path = tmp_path / "two_nodes.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "e2e" / "two_node_cluster.py"),
            str(result_path),
            "+recipe=grpo_tiny",
            *COMMON,
            "trainer.nnodes=2",
            "trainer.procs_per_node=1",
            f"trainer.output_dir={tmp_path / 'two'}",
        ],
        check=True,
        timeout=1200,
        env=clean_env(),
        cwd=REPO,
    )
    result = json.loads(result_path.read_text())
    ranks = result["placement"]["ranks"]
    print("placement:", [(r["rank"], r["node_id"][:8], r["master"]) for r in ranks])
    assert len({r["node_id"] for r in ranks}) == 2, "the two ranks share a node"
    assert {r["node_id"] for r in ranks} == set(result["placement"]["nodes"])
    assert all(
        r["master"] == ranks[0]["master"] and r["master"].startswith("127.0.0.1:") for r in ranks
    )
    assert result["returncode"] == 0, result["stderr"]
    assert "2 rank(s) = 2 node(s) x 1" in result["stdout"]

    # The same run on one node: in-process, on the test session's cluster.
    run_recipe(tmp_path / "one", *COMMON, "trainer.procs_per_node=2")
    two_nodes, one_node = read_metrics(tmp_path / "two"), read_metrics(tmp_path / "one")
    for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "rollout/logprob_diff"):
        a, b = [m[key] for m in two_nodes], [m[key] for m in one_node]
        print(f"{key}: 2 nodes {[round(x, 5) for x in a]} | 1 node {[round(x, 5) for x in b]}")
    rewards_two = [m["reward/mean"] for m in two_nodes]
    rewards_one = [m["reward/mean"] for m in one_node]
    assert len(rewards_two) == STEPS
    assert max(abs(x - y) for x, y in zip(rewards_two, rewards_one)) < 1e-6
    assert (
        max(abs(a["actor/grad_norm"] - b["actor/grad_norm"]) for a, b in zip(two_nodes, one_node))
        < 1e-4
    )
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in two_nodes)
