"""A user's agent (``rollout.agent=path/to/file.py:fn``) run end to end through the CLI: the
responses the run trains on and logs are the ones the agent returned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

AGENT = '''
from pathlib import Path

import torch


def one_token_agent(prompts, ctx):
    """Sample every response with a budget of one token; count the calls beside this file."""
    calls = Path(__file__).with_name("calls.txt")
    calls.write_text(str(int(calls.read_text() or 0) + 1) if calls.exists() else "1")
    capped = prompts.with_tensors(max_tokens=torch.ones(len(prompts), dtype=torch.long))
    return prompts.union(ctx.generate(capped))
'''


def test_user_agent_file_runs_end_to_end(tmp_path: Path) -> None:
    agent = tmp_path / "my_agent.py"
    agent.write_text(AGENT)
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlframe.main",
            "+recipe=grpo_tiny",
            f"trainer.output_dir={out}",
            "trainer.total_steps=2",
            f"rollout.agent={agent}:one_token_agent",
            # A user's agent may take turns: the response width reserves observations for
            # agent.max_turns, more than the tiny model's 512 positions with the defaults.
            "agent.max_turns=1",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert (tmp_path / "calls.txt").read_text() == "2"
    # grpo_tiny samples up to 3 tokens; the cap of 1 the agent set is what the run saw.
    assert all(m["response_length/mean"] <= 1.0 for m in metrics)
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics)
