"""PPO's clipped value loss (the critic's objective) against hand-computed numbers."""

from __future__ import annotations

import torch

from workers.critic import compute_value_loss


def test_clipped_value_loss_takes_the_larger_branch_with_a_half() -> None:
    # Token 0: V moved 0 -> 2 past the clip range 0.5 toward a return of 0: the unclipped
    #   error (2 - 0)^2 = 4 beats the clipped one (0.5 - 0)^2 = 0.25: loss 0.5 * 4 = 2.
    # Token 1: same move, return 3: the clipped error (0.5 - 3)^2 = 6.25 beats (2 - 3)^2 = 1:
    #   loss 0.5 * 6.25 = 3.125, and V gets no gradient (the clipped value is constant in V).
    # Token 2: a move inside the range (1 -> 1.2): both branches give 0.04, loss 0.02.
    values = torch.tensor([[2.0, 2.0, 1.2]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0, 1.0]])
    returns = torch.tensor([[0.0, 3.0, 1.0]])
    loss, clipped = compute_value_loss(values, old_values, returns, cliprange=0.5)
    torch.testing.assert_close(loss, torch.tensor([[2.0, 3.125, 0.02]]))
    assert clipped.tolist() == [[0.0, 1.0, 0.0]]
    loss.sum().backward()
    # d/dV of 0.5 (V - R)^2 is V - R on the unclipped branch, 0 on the clipped one.
    torch.testing.assert_close(values.grad, torch.tensor([[2.0, 0.0, 0.2]]))


def test_clip_range_bounds_the_move_in_both_directions() -> None:
    # V fell 1 -> -1 with a clip range of 0.25: V_clip = 0.75. Return 1: the clipped error
    # (0.75 - 1)^2 = 0.0625 is below the unclipped (-1 - 1)^2 = 4, so the loss stays 2.
    # Return -3: clipped (0.75 + 3)^2 = 14.0625 beats (-1 + 3)^2 = 4: loss 7.03125.
    values = torch.tensor([[-1.0, -1.0]])
    loss, clipped = compute_value_loss(
        values, torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, -3.0]]), cliprange=0.25
    )
    torch.testing.assert_close(loss, torch.tensor([[2.0, 7.03125]]))
    assert clipped.tolist() == [[0.0, 1.0]]
