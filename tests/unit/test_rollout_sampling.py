"""Groups of rows: DAPO's uniform-reward test and joining groups of different prompt widths
(the producer's admission of replacements is tests/unit/test_experience.py)."""

from __future__ import annotations

import torch

from rlframe.core.protocol import Batch
from rlframe.rollout.sampling import concat_groups, has_uniform_rewards

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


INFORMATIVE, UNIFORM = (0.0, 1.0), (1.0, 1.0)


def kept_groups(batch: Batch) -> list[int]:
    return batch["group"][::N].tolist()


def test_groups_of_different_prompt_widths_concatenate() -> None:
    batch = concat_groups([groups_batch([INFORMATIVE], 0, 2), groups_batch([UNIFORM], 1, 5)])
    assert batch["prompt_ids"].shape == (2 * N, 5)
    # The narrower group is left-padded: its real tokens stay right-aligned next to the response.
    assert batch["prompt_mask"][:N].tolist() == [[0, 0, 0, 1, 1]] * N
    assert batch["prompt_ids"][:N, :3].eq(0).all() and batch["prompt_ids"][:N, 3:].eq(7).all()
    assert kept_groups(batch) == [0, 1]


def test_uniform_rewards() -> None:
    groups = groups_batch([UNIFORM, INFORMATIVE, (0.5, 0.5)], 0).split(N)
    assert [has_uniform_rewards(g) for g in groups] == [True, False, True]
