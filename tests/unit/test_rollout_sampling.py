"""DAPO's sampling loop: rounds, kept fraction, top-up with uniform groups, truncation."""

from __future__ import annotations

import torch

from rlframe.protocol import Batch
from rlframe.rollout.sampling import (
    concat_groups,
    run_sampling_rounds,
    select_groups,
    split_uniform_groups,
)

N = 2


def groups_batch(
    rewards: list[tuple[float, float]], first_group: int, prompt_width: int = 3
) -> Batch:
    """One row per response, N per group, with the group's rewards and a prompt of
    ``prompt_width``."""
    rows = len(rewards) * N
    return Batch(
        {
            "reward": torch.tensor([r for pair in rewards for r in pair]),
            "group": torch.arange(first_group, first_group + len(rewards)).repeat_interleave(N),
            "prompt_ids": torch.full((rows, prompt_width), 7),
            "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
            "response_ids": torch.ones(rows, 4, dtype=torch.long),
        },
        meta={"pad_token_id": 0},
    )


class Rounds:
    """Draws scripted rounds of scored groups, as the producer's ``draw`` would."""

    def __init__(
        self, rounds: list[list[tuple[float, float]]], widths: list[int] | None = None
    ) -> None:
        self.rounds, self.widths, self.calls, self.next_group = rounds, widths, 0, 0

    def __call__(self) -> Batch:
        rewards = self.rounds[self.calls]
        width = self.widths[self.calls] if self.widths else 3
        self.calls += 1
        batch = groups_batch(rewards, self.next_group, width)
        self.next_group += len(rewards)
        return batch


INFORMATIVE, UNIFORM = (0.0, 1.0), (1.0, 1.0)


def kept_groups(batch: Batch) -> list[int]:
    return batch["group"][::N].tolist()


def test_select_groups_keeps_informative_first_and_truncates() -> None:
    informative = [groups_batch([INFORMATIVE], g) for g in (0, 3)]
    uniform = [groups_batch([UNIFORM], g) for g in (1, 2)]
    # Uniform groups only top up, after every informative group, whatever the draw order.
    assert [kept_groups(g)[0] for g in select_groups(informative, uniform, 3)] == [0, 3, 1]
    assert [kept_groups(g)[0] for g in select_groups(informative, uniform, 1)] == [0]
    assert select_groups([], uniform, 5) == uniform


def test_rounds_stop_once_enough_informative_groups() -> None:
    draw = Rounds(
        [[INFORMATIVE, UNIFORM, UNIFORM], [INFORMATIVE, INFORMATIVE, UNIFORM], [INFORMATIVE] * 3]
    )
    batch, metrics = run_sampling_rounds(draw, N, wanted=3, max_rounds=5)
    assert draw.calls == 2
    assert metrics["rollout/sampling_rounds"] == 2
    assert metrics["rollout/kept_group_frac"] == 3 / 6
    assert kept_groups(batch) == [0, 3, 4]  # informative groups only, in drawn order


def test_rounds_truncate_to_the_batch_size() -> None:
    draw = Rounds([[INFORMATIVE] * 3, [INFORMATIVE] * 3])
    batch, metrics = run_sampling_rounds(draw, N, wanted=2, max_rounds=5)
    assert draw.calls == 1 and kept_groups(batch) == [0, 1] and len(batch) == 2 * N
    assert metrics["rollout/kept_group_frac"] == 1.0


def test_rounds_top_up_with_uniform_groups_when_they_run_out() -> None:
    draw = Rounds([[UNIFORM, INFORMATIVE, UNIFORM], [UNIFORM, UNIFORM, UNIFORM]])
    batch, metrics = run_sampling_rounds(draw, N, wanted=3, max_rounds=2)
    assert draw.calls == 2 and metrics["rollout/sampling_rounds"] == 2
    assert metrics["rollout/kept_group_frac"] == 1 / 6
    # The informative group first, then the uniform ones in drawn order.
    assert kept_groups(batch) == [1, 0, 2]
    assert len(batch) == 3 * N


def test_rounds_with_different_prompt_widths_concatenate() -> None:
    draw = Rounds([[INFORMATIVE, UNIFORM], [INFORMATIVE, UNIFORM]], widths=[2, 5])
    batch, _ = run_sampling_rounds(draw, N, wanted=2, max_rounds=2)
    assert batch["prompt_ids"].shape == (2 * N, 5)
    # The narrower round is left-padded: its real tokens stay right-aligned next to the response.
    assert batch["prompt_mask"][:N].tolist() == [[0, 0, 0, 1, 1]] * N
    assert batch["prompt_ids"][:N, :3].eq(0).all() and batch["prompt_ids"][:N, 3:].eq(7).all()


def test_split_uniform_groups() -> None:
    informative, uniform = split_uniform_groups(
        groups_batch([UNIFORM, INFORMATIVE, (0.5, 0.5)], 0), N
    )
    assert [kept_groups(g) for g in informative] == [[1]]
    assert [kept_groups(g) for g in uniform] == [[0], [2]]
    assert len(concat_groups(informative + uniform)) == 3 * N
