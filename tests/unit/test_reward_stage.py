"""The reward stage on the driver: decode, rule score, weights, env reward, overlong
penalty, and the step metrics that read them (``reward/rule_mean`` is the raw rule score)."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AgentConfig,
    Config,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
)
from rlframe.core.protocol import Batch
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.loop.step_metrics import collect_reward_metrics, read_weights_version
from rlframe.rewards.stage import RewardStage

TOKENIZER = build_tiny_tokenizer()


def read_digit(response: str, ground_truth: str, sample: dict) -> float:
    """The rule reward: the digit answered."""
    return float(response)


def responses(digits: list[str], width: int = 4) -> Batch:
    """One digit then EOS per row, padded to ``width``: 2 sampled tokens each."""
    ids = torch.zeros(len(digits), width, dtype=torch.long)
    ids[:, 0] = torch.tensor(TOKENIZER.convert_tokens_to_ids(digits))
    ids[:, 1] = TOKENIZER.eos_token_id
    mask = (ids != 0).float()
    rows = len(digits)
    return Batch(
        {"response_ids": ids, "response_mask": mask, "loss_mask": mask.clone()},
        {"prompt": ["p"] * rows, "extra": [{}] * rows, "ground_truth": ["0"] * rows},
    )


def make_stage(**reward: object) -> RewardStage:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        rollout=RolloutConfig(n=2, max_tokens=4),
        data=DataConfig(batch_size=1),
        actor=ActorConfig(mini_batch_size=2, micro_batch_size=2),
        agent=AgentConfig(rule_reward_weight=0.5, env_reward_weight=2.0),
        reward=RewardConfig(fn="tests.unit.test_reward_stage:read_digit", num_workers=0, **reward),
    )
    return RewardStage(cfg, TOKENIZER)


def test_single_turn_score_is_the_weighted_rule_score_and_reward_adds_the_penalty() -> None:
    # Budget 4 tokens, buffer 3: 2 sampled tokens are 1 into the buffer, a third of the penalty.
    stage = make_stage(weight=2.0, overlong_buffer=3, overlong_penalty=0.3)
    out = stage.compute_rewards(responses(["3", "1"]))
    assert list(out["response"]) == ["3", "1"]  # the closing EOS is not part of the text
    assert out["rule_score"].tolist() == [3.0, 1.0]
    assert out["score"].tolist() == [6.0, 2.0]
    torch.testing.assert_close(out["reward"], torch.tensor([5.9, 1.9]))
    assert collect_reward_metrics(out)["reward/rule_mean"] == 2.0


def test_env_reward_combines_but_the_rule_score_stays_raw() -> None:
    stage = make_stage(weight=2.0)
    batch = responses(["3", "1", "2"]).with_tensors(
        env_reward=torch.tensor([1.0, -1.0, 5.0]), env_failed=torch.tensor([0.0, 0.0, 1.0])
    )
    out = stage.compute_rewards(batch)
    # score = 0.5 * (2 * rule) + 2 * env; the episode its env failed scores 0.
    assert out["score"].tolist() == [5.0, -1.0, 0.0]
    assert out["reward"].tolist() == [5.0, -1.0, 0.0]
    assert out["rule_score"].tolist() == [3.0, 1.0, 2.0]
    assert collect_reward_metrics(out)["reward/rule_mean"] == pytest.approx(2.0)


def test_weights_version_reads_the_row_column_else_the_meta() -> None:
    batch = Batch({"weights_version": torch.tensor([3, 3, 4, 4])}, meta={"weights_version": 9})
    assert read_weights_version(batch) == 3.5
    assert read_weights_version(Batch({"x": torch.zeros(2)}, meta={"weights_version": 2})) == 2
    assert read_weights_version(Batch({"x": torch.zeros(2)})) == 0
