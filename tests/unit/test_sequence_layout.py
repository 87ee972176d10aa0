"""Sequence layout (packing indices, token-budget plans, rank balancing), the config keys of
issue 9, and when the old-log-prob pass is skipped."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.core.protocol import Batch
from rlframe.core.sequence_layout import (
    balance_ranks,
    balance_rows,
    build_layout,
    build_packed_layout,
    build_padded_layout,
    count_row_tokens,
    plan_micro_batches,
)
from rlframe.core.train_batch import TrainBatch


def two_rows() -> TrainBatch:
    """Row 0: prompt [5 6] + response [7 8 9] whose last token is an observation; row 1:
    prompt [4] (left-padded) + response [3]."""
    return TrainBatch(
        prompt_ids=torch.tensor([[5, 6], [0, 4]]),
        prompt_mask=torch.tensor([[1, 1], [0, 1]]),
        response_ids=torch.tensor([[7, 8, 9], [3, 0, 0]]),
        response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 0]]),
        loss_mask=torch.tensor([[1.0, 1, 0], [1, 0, 0]]),
    )


def test_packed_layout_by_hand() -> None:
    layout = build_packed_layout(two_rows())
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert layout.attention_mask is None
    # Tokens 7 and 8 of row 0 (predicted at packed positions 1, 2) and 3 of row 1 (at 5);
    # the observation 9 is attended to but not projected.
    assert layout.predict_index.tolist() == [1, 2, 5]
    assert layout.target_ids.tolist() == [7, 8, 3]
    assert layout.to_grid(torch.tensor([-1.0, -2.0, -3.0])).tolist() == [[-1, -2, 0], [-3, 0, 0]]


def test_padded_layout_by_hand() -> None:
    layout = build_padded_layout(two_rows())
    assert layout.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 4, 3, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]
    assert layout.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert layout.predict_index.tolist() == [1, 2, 6]
    assert layout.target_ids.tolist() == [7, 8, 3]
    # Row 1's token 3 is at column 0 of a grid 3 wide.
    assert layout.grid_index.tolist() == [0, 1, 3]
    assert layout.to_grid(torch.tensor([-1.0, -2.0, -3.0])).tolist() == [[-1, -2, 0], [-3, 0, 0]]


@pytest.mark.parametrize("packed", [False, True])
def test_layout_moves_to_a_device_unchanged(packed: bool) -> None:
    layout = build_layout(two_rows(), packed)
    moved = layout.to("cpu")
    for name in ("input_ids", "position_ids", "predict_index", "target_ids", "grid_index"):
        assert getattr(moved, name).tolist() == getattr(layout, name).tolist()
    assert moved.grid_shape == (2, 3)
    if packed:
        assert moved.attention_mask is None
    else:
        assert moved.attention_mask.tolist() == layout.attention_mask.tolist()


def test_packing_needs_a_prompt_token() -> None:
    rows = two_rows()
    rows.prompt_mask[1] = 0
    with pytest.raises(ValueError, match="prompt token"):
        build_packed_layout(rows)


def test_row_costs() -> None:
    rows = two_rows()
    assert count_row_tokens(rows.prompt_mask, rows.response_mask, True).tolist() == [5, 2]
    assert count_row_tokens(rows.prompt_mask, rows.response_mask, False).tolist() == [5, 5]


def test_plan_fills_up_to_the_budget() -> None:
    costs = [9, 1, 4, 6, 3, 12, 2]
    plan = plan_micro_batches(costs, budget=10)
    assert sorted(i for part in plan for i in part) == list(range(len(costs)))
    # 12 exceeds the budget and goes alone; the others fit under 10.
    assert [5] in plan
    assert all(sum(costs[i] for i in part) <= 10 for part in plan if part != [5])
    # First fit, longest first: 12 | 9 1 | 6 4 | 3 2, rows in order inside each.
    assert plan == [[5], [0, 1], [2, 3], [4, 6]]


def test_plan_reaches_the_agreed_count() -> None:
    costs = [5, 5, 5, 5, 1]
    assert len(plan_micro_batches(costs, budget=100)) == 1
    plan = plan_micro_batches(costs, budget=100, min_count=3)
    assert len(plan) == 3 and sorted(i for p in plan for i in p) == list(range(5))
    # Never more micro-batches than rows.
    assert len(plan_micro_batches([1, 1], budget=100, min_count=5)) == 2


def test_over_budget_row_is_never_split_into_an_empty_micro_batch() -> None:
    # 50 goes alone (above the budget); to reach 3 micro-batches the pair [1, 2] is halved,
    # not the single heaviest row.
    assert plan_micro_batches([50, 1, 1], budget=10, min_count=3) == [[0], [1], [2]]


def test_halving_splits_the_fullest_micro_batch_evenly() -> None:
    costs = [8, 7, 6, 5, 4, 3]
    # Longest first, each row to the lighter half: 8 5 4 (17) | 7 6 3 (16).
    assert plan_micro_batches(costs, budget=100, min_count=2) == [[0, 3, 4], [1, 2, 5]]
    # Then the fullest (17) is halved: 8 | 5 4.
    assert plan_micro_batches(costs, budget=100, min_count=3) == [[0], [3, 4], [1, 2, 5]]


def test_halving_follows_the_loads_after_each_split() -> None:
    costs = [4, 9, 6, 3, 7, 6]
    # Budget 12, first fit longest first: 9 3 (12) | 7 4 (11) | 6 6 (12).
    assert plan_micro_batches(costs, budget=12) == [[1, 3], [0, 4], [2, 5]]
    # Five: 9 3 is halved, then 6 6 (12), the fullest left, not 7 4 (11).
    plan = plan_micro_batches(costs, budget=12, min_count=5)
    assert plan == [[1], [3], [0, 4], [2], [5]]


def test_balance_ranks_longest_first_to_the_lightest_rank() -> None:
    # 9 -> rank 0, 8 -> rank 1, 2 -> rank 1 (lighter), 1 -> rank 0: 10 tokens each.
    order = balance_ranks(torch.tensor([9, 8, 2, 1]), world_size=2, mini_batch_size=4)
    assert order.tolist() == [0, 3, 1, 2]


def test_balance_needs_mini_batches_that_split_over_the_ranks() -> None:
    with pytest.raises(ValueError, match="do not split"):
        balance_ranks(torch.ones(8, dtype=torch.long), world_size=3, mini_batch_size=8)


def rows_of_lengths(lengths: list[int]) -> Batch:
    """Rows with one prompt token and ``length - 1`` response tokens, padded to 10."""
    response_mask = torch.tensor([[1.0] * (n - 1) + [0.0] * (11 - n) for n in lengths])
    return Batch(
        {
            "prompt_ids": torch.ones(len(lengths), 1, dtype=torch.long),
            "prompt_mask": torch.ones(len(lengths), 1, dtype=torch.long),
            "response_ids": torch.ones(len(lengths), 10, dtype=torch.long),
            "response_mask": response_mask,
        }
    )


def test_balance_rows_costs_real_tokens_and_keeps_one_rank_in_order() -> None:
    rows = rows_of_lengths([9, 8, 2, 1])
    masks = rows.tensor("prompt_mask"), rows.tensor("response_mask")
    assert count_row_tokens(*masks, packed=True).tolist() == [9, 8, 2, 1]
    # Padded, every row would cost 11 and the order would be 0 2 | 1 3.
    assert balance_rows(rows, world_size=2, mini_batch_size=4).tolist() == [0, 3, 1, 2]
    assert balance_rows(rows, world_size=1, mini_batch_size=4).tolist() == [0, 1, 2, 3]


def test_balance_ranks_keeps_mini_batches_and_evens_tokens() -> None:
    costs = torch.tensor([100, 1, 1, 1, 90, 2, 3, 1, 5, 50, 60, 5, 5, 5, 5, 5])
    order = balance_ranks(costs, world_size=2, mini_batch_size=8)
    assert sorted(order.tolist()) == list(range(16))
    rank0, rank1 = order[:8], order[8:]
    for share in (rank0, rank1):
        # Four rows of each mini-batch, the first mini-batch's first.
        assert all(int(i) < 8 for i in share[:4]) and all(int(i) >= 8 for i in share[4:])
    # 100 and 90 land on different ranks, so do 60 and 50.
    assert {100, 90} == {int(costs[rank0[:4]].max()), int(costs[rank1[:4]].max())}
    loads = [int(costs[rank0].sum()), int(costs[rank1].sum())]
    assert abs(loads[0] - loads[1]) <= 20


def test_balance_needs_whole_mini_batches() -> None:
    with pytest.raises(ValueError):
        balance_ranks(torch.ones(10, dtype=torch.long), world_size=2, mini_batch_size=8)


def make_config(**overrides) -> Config:
    parts = {
        "data": DataConfig(batch_size=4, max_prompt_length=16),
        "rollout": RolloutConfig(n=4, max_tokens=8),
        "actor": ActorConfig(mini_batch_size=16, micro_batch_size=4),
        "trainer": TrainerConfig(device="cpu"),
    }
    return Config(**(parts | overrides))


def test_config_keys() -> None:
    with pytest.raises(ConfigError, match="actor.logprob_chunk_size"):
        ActorConfig(logprob_chunk_size=-1)
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch"):
        ActorConfig(max_tokens_per_micro_batch=-5)
    with pytest.raises(ConfigError, match="actor.max_tokens_per_micro_batch"):
        make_config(actor=ActorConfig(mini_batch_size=16, max_tokens_per_micro_batch=20))
    # With a token budget micro_batch_size is not used, so it need not divide anything.
    make_config(
        actor=ActorConfig(mini_batch_size=16, micro_batch_size=5, max_tokens_per_micro_batch=24)
    )


def needs_pass(cfg: Config, critic: bool = False, step: int = 1, extra_rows: int = 0) -> bool:
    from rlframe.loop.trainer import Trainer

    # This check reads neither the workers, the experience nor the weight sync.
    trainer = Trainer(
        cfg,
        actor=None,
        critic=object() if critic else None,
        experience=None,
        sync_weights=lambda: 0,
        tracker=None,
    )
    trainer.step_count = step
    return trainer.needs_old_logprob_pass(cfg.data.batch_size * cfg.rollout.n + extra_rows)


def test_old_logprob_pass_only_when_needed() -> None:
    assert not needs_pass(make_config())
    # Rows forked by the openai agent make more than one mini-batch.
    assert needs_pass(make_config(), extra_rows=16)
    assert needs_pass(make_config(algorithm=AlgorithmConfig(recompute_old_logprobs=True)))
    assert needs_pass(make_config(actor=ActorConfig(mini_batch_size=8, micro_batch_size=4)))
    assert needs_pass(
        make_config(actor=ActorConfig(mini_batch_size=16, micro_batch_size=4, epochs=2))
    )
    assert needs_pass(make_config(algorithm=AlgorithmConfig(kl_reward_coef=0.1)))
    # A KL loss term reads the reference, not the old log-probs.
    assert not needs_pass(make_config(algorithm=AlgorithmConfig(kl_coef=0.1)))
    # While the critic warms up the actor does not update: nothing else would compute them.
    warmup = make_config(
        algorithm=AlgorithmConfig(advantage="gae"), critic=CriticConfig(actor_wait_steps=2)
    )
    assert needs_pass(warmup, critic=True, step=2)
    assert not needs_pass(warmup, critic=True, step=3)
