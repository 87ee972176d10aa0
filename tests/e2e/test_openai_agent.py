"""The CLI trains an agent written only against the openai client (openai_agent_tiny):
it learns, and the ids and log-probs the endpoint recorded are the ones the trainer sees."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flood import FLOOD
from tests.harness import REPO, deterministic, free_port, mean_reward_gain, run_recipe

pytestmark = pytest.mark.slow
STEPS = 40


def test_the_example_agent_imports_only_the_openai_client() -> None:
    tree = ast.parse((REPO / "recipes" / "agents" / "guess_openai.py").read_text())
    modules = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "rlframe" not in modules and "openai" in modules


@pytest.mark.usefixtures("ray_cluster")
def test_openai_agent_tiny_learns(tmp_path: Path) -> None:
    """The default tier's learning proof of the OpenAI-compatible endpoint: 40 steps, each
    episode a real ``openai`` client talking HTTP to the run's endpoint; over 120 s because
    the client's request handling and the server share the driver's one interpreter."""
    out = tmp_path / "run"
    metrics = run_recipe(out, f"trainer.total_steps={STEPS}", recipe="openai_agent_tiny").metrics
    first, last = mean_reward_gain(metrics)
    gap = max(m["rollout/logprob_diff"] for m in metrics)
    print(
        f"openai_agent_tiny: {len(metrics)} steps, "
        f"{sum(m['timing_s/step'] for m in metrics):.0f} s of steps, reward first 5 "
        f"{first:.3f} -> last 5 {last:.3f}, turns/mean {metrics[0]['agent/turns/mean']:.2f} -> "
        f"{metrics[-1]['agent/turns/mean']:.2f}, max rollout/logprob_diff {gap:.2e}"
    )
    assert len(metrics) == STEPS
    # Every step's rows were sampled with the weights of the step before (on-policy).
    assert [m["rollout/weights_version"] for m in metrics] == list(range(STEPS))
    assert last - first >= 0.15
    assert gap < 1e-4
    assert all(m["agent/turns/mean"] > 1.5 and m["agent/obs_tokens/mean"] > 0 for m in metrics)
    assert all(m["response_length/mean"] <= 4 for m in metrics)
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    # The feedback the agent sent as user messages sits after the closed turn, token in.
    assert any("<eos>higher:" in r["response"] or "<eos>lower:" in r["response"] for r in rollouts)


SHORT = ["trainer.total_steps=2", "data.batch_size=4", "rollout.n=4"]
SHORT += ["actor.mini_batch_size=16", "actor.micro_batch_size=16"]


@pytest.mark.usefixtures("ray_cluster")
def test_a_local_flood_during_a_run_changes_none_of_its_metrics(tmp_path: Path) -> None:
    """Another local process keeps 300 unfinished connections open to the run's endpoint for
    the whole run, over a cap of 64 (16 episodes at once need 16): every episode is still
    answered and the run logs what the same run logs without the flood (loopback only,
    bounded in count and time). The cap is low because the endpoint lives only while the
    short run generates: a few seconds since the request stream."""
    port = free_port()
    common = [*SHORT, f"agent.server_port={port}", "agent.server_max_connections=64"]
    quiet = run_recipe(tmp_path / "quiet", *common, recipe="openai_agent_tiny").metrics
    stop = tmp_path / "stop_flood"
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(port), "300", "300", "300", str(stop)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        run = run_recipe(tmp_path / "flooded", *common, recipe="openai_agent_tiny")
    finally:
        stop.touch()
        out, _ = flood.communicate(timeout=60)
    opened = int(out.split()[-1])
    print(f"flood: {opened} connections opened during the run")
    # Past the cap of 64 while the endpoint was up: the server had to refuse or close some.
    # (How far past depends on how long the run's endpoint lives beside the rest of the suite.)
    assert opened > 64
    flooded = run.metrics
    assert len(flooded) == len(quiet) == 2
    for a, b in zip(quiet, flooded):
        assert deterministic(a) == deterministic(b), a["step"]
