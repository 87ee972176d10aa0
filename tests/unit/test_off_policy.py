"""``algorithm.off_policy_correction``: the checks before Ray, the one rule that decides the
old-log-prob pass (with ``rollout.max_staleness``), and the behaviour-weight metrics."""

from __future__ import annotations

import math

import pytest
import torch

from rlframe.algorithms.off_policy import compute_off_policy_metrics, needs_old_logprob_pass
from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    RolloutConfig,
    TrainerConfig,
)
from tests.unit.cli_errors import check_config_error

ROWS = 16


def make_config(mode: str = "recompute", epochs: int = 1, **algorithm: float | str) -> Config:
    return Config(
        data=DataConfig(batch_size=4, max_prompt_length=16),
        rollout=RolloutConfig(n=4, max_tokens=8),
        actor=ActorConfig(mini_batch_size=ROWS, micro_batch_size=4, epochs=epochs),
        algorithm=AlgorithmConfig(off_policy_correction=mode, **algorithm),
        trainer=TrainerConfig(device="cpu"),
    )


@pytest.mark.parametrize(
    ("algorithm", "key", "words"),
    [
        ({"off_policy_correction": "vtrace"}, "algorithm.off_policy_correction", "one of"),
        ({"off_policy_correction": "decoupled", "tis_cap": 2.0}, "off_policy_correction", "tis"),
        (
            {"off_policy_correction": "decoupled", "mismatch_mask": "token"},
            "algorithm.off_policy_correction",
            "already weights",
        ),
        (
            {"off_policy_correction": "rollout", "tis_cap": 2.0},
            "off_policy_correction",
            "is always 1",
        ),
        (
            {"off_policy_correction": "rollout", "recompute_old_logprobs": True},
            "algorithm.off_policy_correction",
            "recompute_old_logprobs",
        ),
        ({"behav_weight_cap": 0.5}, "algorithm.behav_weight_cap", "0 (no cap) or > 1"),
    ],
)
def test_contradictory_combinations_name_the_key(algorithm: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError, match=key) as error:
        AlgorithmConfig(**algorithm)
    assert words in str(error.value)


def test_recompute_keeps_the_mismatch_corrections() -> None:
    AlgorithmConfig(tis_cap=2.0, mismatch_mask="sequence")
    AlgorithmConfig(off_policy_correction="decoupled", behav_weight_cap=0)


def test_a_contradiction_exits_2_before_ray() -> None:
    check_config_error(
        "+recipe=grpo_tiny",
        "algorithm.off_policy_correction=decoupled",
        "algorithm.tis_cap=2",
        key="algorithm.off_policy_correction",
        text="tis",
    )


def needs_pass(cfg: Config, kl_in_reward: bool = False, actor_updates: bool = True) -> bool:
    return needs_old_logprob_pass(cfg, ROWS, kl_in_reward, actor_updates)


@pytest.mark.parametrize("mode", ["recompute", "decoupled"])
def test_pass_is_skipped_for_one_optimizer_step(mode: str) -> None:
    """recompute and decoupled (its proximal policy) skip the pass for an update of one
    optimizer step, whose first forward runs with the weights the pass would use; a stale
    batch (rollout.max_staleness > 0) is no exception (issue 47: the pass cost 30% of the
    asynchronous update for the same numbers)."""
    assert not needs_pass(make_config(mode))
    assert needs_pass(make_config(mode, epochs=2))
    assert needs_pass(make_config(mode), kl_in_reward=True)
    assert needs_pass(make_config(mode), actor_updates=False)
    stale = make_config(mode)
    stale.rollout.max_staleness = 1
    assert not needs_pass(stale)
    stale.actor.epochs = 2
    assert needs_pass(stale)


@pytest.mark.parametrize("mode", ["recompute", "decoupled"])
def test_lora_dropout_runs_the_pass(mode: str) -> None:
    """An update of one optimizer step with LoRA dropout on still runs the (eval-mode) pass: the
    update's own log-probs carry the dropout mask, and the sync check compares the old
    log-probs with the rollout's (issue 46: a false "weight sync broken" at step 2). Dropout
    on adapters that are off (rank 0) changes nothing."""
    cfg = make_config(mode)
    cfg.model.lora.rank = 16
    assert not needs_pass(cfg)
    cfg.model.lora.dropout = 0.1
    assert needs_pass(cfg)
    cfg.model.lora.rank = 0
    assert not needs_pass(cfg)
    # The rollout's log-probs are the old policy: no pass, dropout or not.
    rollout = make_config("rollout")
    rollout.model.lora.rank, rollout.model.lora.dropout = 16, 0.1
    assert not needs_pass(rollout)


def test_rollout_never_runs_the_pass() -> None:
    cfg = make_config("rollout", epochs=2)
    cfg.rollout.max_staleness = 2
    assert not needs_pass(cfg, kl_in_reward=True, actor_updates=False)


def test_trainer_asks_the_same_rule() -> None:
    from rlframe.loop.trainer import Trainer

    stale = make_config()
    trainer = Trainer(stale, None, None, None, lambda: 0, None)
    trainer.step_count = 1
    assert not trainer.needs_old_logprob_pass(ROWS)
    stale.rollout.max_staleness = 1
    assert not trainer.needs_old_logprob_pass(ROWS)
    stale.actor.epochs = 2
    assert trainer.needs_old_logprob_pass(ROWS)


def test_behaviour_weight_metrics() -> None:
    """Weights 0.5, 1, 3 and 6 on four loss tokens (a fifth token is padding, weight 100):
    mean 2.625, max 6, and at a cap of 5 one token in four is dropped."""
    behaviour = torch.zeros(1, 5)
    proximal = torch.log(torch.tensor([[0.5, 1.0, 3.0, 6.0, 100.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    metrics = compute_off_policy_metrics(
        proximal, behaviour, mask, AlgorithmConfig(off_policy_correction="decoupled")
    )
    assert metrics["off_policy/behav_weight_mean"] == pytest.approx(2.625)
    assert metrics["off_policy/behav_weight_max"] == pytest.approx(6.0)
    assert metrics["off_policy/behav_capped_frac"] == pytest.approx(0.25)
    uncapped = AlgorithmConfig(off_policy_correction="decoupled", behav_weight_cap=0)
    assert (
        compute_off_policy_metrics(proximal, behaviour, mask, uncapped)[
            "off_policy/behav_capped_frac"
        ]
        == 0.0
    )
    assert compute_off_policy_metrics(proximal, behaviour, mask, AlgorithmConfig()) == {}
    assert math.isfinite(metrics["off_policy/behav_weight_mean"])
