"""A user's agent (``rollout.agent=path/to/file.py:fn``) run end to end: the
responses the run trains on and logs are the ones the agent returned."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

AGENT = '''
from pathlib import Path

import torch

from rlframe.rollout import run_single_turn


def one_token_agent(prompts, ctx):
    """Sample every response with a budget of one token; count the calls beside this file."""
    calls = Path(__file__).with_name("calls.txt")
    calls.write_text(str(int(calls.read_text() or 0) + 1) if calls.exists() else "1")
    capped = prompts.with_tensors(max_tokens=torch.ones(len(prompts), dtype=torch.long))
    return run_single_turn(capped, ctx)
'''


def test_user_agent_file_runs_end_to_end(tmp_path: Path) -> None:
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    out = tmp_path / "run"
    metrics = run_recipe(
        out,
        "trainer.total_steps=2",
        f"rollout.agent={agent}:one_token_agent",
        # A user's agent may take turns: the response width reserves observations for
        # agent.max_turns, more than the tiny model's 512 positions with the defaults.
        "agent.max_turns=1",
    ).metrics
    assert [m["step"] for m in metrics] == [1, 2]
    assert (tmp_path / "calls.txt").read_text() == "2"
    # grpo_tiny samples up to 3 tokens; the cap of 1 the agent set is what the run saw.
    assert all(m["response_length/mean"] <= 1.0 for m in metrics)
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics)
