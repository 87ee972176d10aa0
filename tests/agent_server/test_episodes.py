"""The ``openai`` agent end to end on the driver: episodes of users' functions become
training rows (forks, fillers, failures, timeouts), rewards shared within an episode."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlframe.agent_server import pick_agent
from rlframe.config import AgentConfig
from rlframe.core.protocol import Batch
from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import load_prompt_records
from rlframe.data.tiny_model import resolve_model_path
from rlframe.envs import EnvError
from rlframe.rewards.stage import combine_rewards
from rlframe.rollout import AgentContext
from rlframe.rollout.engine_client import EngineClient
from tests.agent_server.conftest import make_config
from tests.rows_grid import run_agent
from workers.roles.rollout_role import RolloutRole

PLUGINS = "tests.plugins.openai_agents"


def run(entry: str, dynamic_sampling: bool = False, **agent: Any) -> tuple[Batch, Batch]:
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny:0")
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = make_config(entry=f"{PLUGINS}:{entry}", **agent)
    cfg.algorithm.dynamic_sampling = dynamic_sampling
    records = load_prompt_records([], "guess", tokenizer, 16, seed=3, synthetic_size=4)
    prompts = build_prompt_batch(records, 2, 0, tokenizer.pad_token_id, seed=3)
    prompts.meta |= {
        "stop_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    role = RolloutRole(cfg, path, "cpu", 0)
    ctx = AgentContext(role.generate, tokenizer, cfg, engine=EngineClient([role.serve]))
    try:
        return prompts, run_agent(pick_agent("openai"), prompts, ctx)
    finally:
        ctx.resources["openai_server"].stop()


def test_forked_rows_share_the_reward_and_fill_mini_batches() -> None:
    prompts, batch = run("fork")
    # 8 episodes x 2 rows, filled up to 2 mini-batches of 8: nothing to fill.
    assert len(batch) == 16 and batch["agent_episode"].tolist() == [i // 2 for i in range(16)]
    assert torch.equal(batch["group"], prompts["group"].repeat_interleave(2))
    assert batch["agent_turns"].tolist() == [2.0, 1.0] * 8
    assert batch["weights_version"].tolist() == [0] * 16
    assert batch["loss_mask"].sum(-1).tolist() == [2.0, 1.0] * 8
    assert (batch["env_reward"] == 0.5).all() and (batch["agent_reward_given"] == 1).all()
    scored = combine_rewards(
        batch.with_tensors(score=torch.zeros(16), reward=torch.zeros(16)), make_config().agent
    )
    assert (scored["reward"] == 0.5).all()


def test_fillers_and_rule_scores_shared_by_an_episode() -> None:
    _, batch = run("unscored", max_concurrent_envs=2)
    assert len(batch) == 8 and (batch["agent_reward_given"] == 0).all()
    # The rule score of an episode's last row goes to all its rows.
    rows = Batch(
        {
            "agent_episode": torch.tensor([0, 0, 1]),
            "agent_reward_given": torch.tensor([0.0, 0.0, 1.0]),
            "env_reward": torch.tensor([0.0, 0.0, 0.25]),
            "env_failed": torch.zeros(3),
            "score": torch.tensor([0.0, 1.0, 1.0]),
            "reward": torch.tensor([0.0, 1.0, 1.0]),
        }
    )
    assert combine_rewards(rows, AgentConfig())["reward"].tolist() == [1.0, 1.0, 0.25]


def test_fillers_complete_a_mini_batch() -> None:
    from rlframe.rollout.agents import fill_mini_batches

    _, batch = run("unscored")
    filled = fill_mini_batches(batch.rows(list(range(5))), 8)
    assert len(filled) == 8 and filled["loss_mask"][5:].sum() == 0
    assert len(set(filled["group"][5:].tolist())) == 3
    assert set(filled["group"][5:].tolist()).isdisjoint(filled["group"][:5].tolist())


def test_failed_and_hung_agents_fail_their_episodes_or_the_run() -> None:
    _, batch = run("flaky", step_timeout_s=3.0, on_env_error="fail_episode")
    secrets = [int(g) for g in batch["ground_truth"]]
    failed = [s % 2 == 1 or s == 2 for s in secrets]
    assert batch["env_failed"].tolist() == [float(f) for f in failed]
    assert all(batch["env_reward"][i] == (0.0 if f else 1.0) for i, f in enumerate(failed))
    assert any(failed) and not all(failed)
    with pytest.raises(EnvError, match="the agent broke|TimeoutError"):
        run("flaky", step_timeout_s=3.0)


def test_forks_refused_with_dynamic_sampling() -> None:
    with pytest.raises(EnvError, match="dynamic_sampling needs one row per episode"):
        run("fork", dynamic_sampling=True)
