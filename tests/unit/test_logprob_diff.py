"""``rollout/logprob_diff`` checks only the tokens sampled with the trainer's weights; the
stale tokens' gap is ``rollout/logprob_diff_stale`` (rlframe/loop/step_metrics.py)."""

from __future__ import annotations

import pytest
import torch

from rlframe.core.protocol import Batch
from rlframe.loop.step_metrics import compute_logprob_diffs, read_token_versions

ROLLOUT = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, 0.0]])
TRAINER = torch.tensor([[-1.0, -2.5, -3.0], [-0.75, -0.5, -9.0]])
"""Gaps: row 0 [0, 0.5, 0], row 1 [0.25, 0, 9] (the 9 sits on padding)."""
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
VERSIONS = torch.tensor([[3, 4, 4], [4, 4, 4]])


def test_lockstep_counts_every_token() -> None:
    out = compute_logprob_diffs(ROLLOUT, TRAINER, MASK, VERSIONS, None)
    # Rows' means: 0.5 / 3 and 0.25 / 2 (the padded 9 counts in neither).
    assert out == {
        "rollout/logprob_diff": pytest.approx(0.75 / 5),
        "rollout/logprob_diff_row_max": pytest.approx(0.5 / 3),
    }


def test_async_splits_by_the_trainer_version() -> None:
    out = compute_logprob_diffs(ROLLOUT, TRAINER, MASK, VERSIONS, 4)
    # current: (0, 1), (0, 2), (1, 0), (1, 1) -> 0.5 + 0.25 over 4; stale: (0, 0) -> 0
    assert out == {
        "rollout/logprob_diff": pytest.approx(0.75 / 4),
        "rollout/logprob_diff_stale": 0.0,
        "rollout/logprob_diff_row_max": pytest.approx(0.5 / 2),  # row 0's current tokens
    }
    out = compute_logprob_diffs(ROLLOUT, TRAINER, MASK, VERSIONS, 3)
    assert out == {
        "rollout/logprob_diff": 0.0,
        "rollout/logprob_diff_stale": pytest.approx(0.75 / 4),
        "rollout/logprob_diff_row_max": 0.0,
    }


def test_a_set_without_tokens_is_left_out() -> None:
    """A step of stale tokens only checks no sync: no ``logprob_diff`` that reads clean."""
    out = compute_logprob_diffs(ROLLOUT, TRAINER, MASK, VERSIONS, 5)
    assert out == {"rollout/logprob_diff_stale": pytest.approx(0.75 / 5)}
    out = compute_logprob_diffs(ROLLOUT, TRAINER, MASK, torch.full_like(VERSIONS, 5), 5)
    assert out == {
        "rollout/logprob_diff": pytest.approx(0.75 / 5),
        "rollout/logprob_diff_row_max": pytest.approx(0.5 / 3),
    }


def test_token_versions_from_a_row_column() -> None:
    per_token = Batch({"loss_mask": MASK, "token_version": VERSIONS})
    assert torch.equal(read_token_versions(per_token), VERSIONS)
    per_row = Batch({"loss_mask": MASK, "weights_version": torch.tensor([3, 4])})
    assert read_token_versions(per_row).tolist() == [[3, 3, 3], [4, 4, 4]]
    assert read_token_versions(Batch({"loss_mask": MASK})) is None
