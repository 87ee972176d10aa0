"""Defects found by a cross-check against veRL's reference, and the behaviours that a round of
deliberate breakages showed the suite did not pin down: each test here fails on the defect
(or the breakage) it is named after."""

from __future__ import annotations

import math

import pytest
import torch

from rlframe.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    compute_passk_scores,
    place_on_last_token,
)
from rlframe.algorithms.losses import POLICY_LOSSES, PolicyLossInputs, compute_kl
from rlframe.config import AlgorithmConfig, ConfigError

MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None = None,
    **cfg: float | str,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    logp = logp.clone().requires_grad_()
    mask = torch.ones_like(adv) if mask is None else mask
    out = POLICY_LOSSES.get(name)(PolicyLossInputs(logp, old, adv, mask, AlgorithmConfig(**cfg)))
    (out.token_loss * mask).sum().backward()
    assert logp.grad is not None
    return out.token_loss.detach(), logp.grad, out.metrics


def advantages(
    name: str,
    rewards: list[float],
    groups: list[int],
    mask: torch.Tensor = MASK,
    values: torch.Tensor | None = None,
    **cfg: float | str | bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = ADVANTAGES.get(name)(
        AdvantageInputs(
            torch.tensor(rewards),
            mask,
            torch.tensor(groups),
            AlgorithmConfig(**cfg),
            values=values,
        )
    )
    return out.advantages, out.returns


# --- defects of the unmodified code -------------------------------------------------------


def test_gmpo_clipfrac_counts_clipped_tokens_only() -> None:
    """A zero-advantage response is not clipped (its sign is 0); a positive one is clipped
    where its ratio is above 1 + high, a negative one where it is below 1 - low."""
    old = torch.zeros(3, 2)
    logp = torch.log(torch.tensor([[2.0, 0.5], [2.0, 0.5], [2.0, 0.5]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]])
    _, _, metrics = policy_loss("gmpo", logp, old, adv, clip_low=0.2, clip_high=0.2)
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]


def test_grpo_passk_honours_norm_by_std_false() -> None:
    # n = 4, one right, k = 2: R = 0.5, s = 0.5. Without the std: A+ = 0.5, A- = 0.5 - 2/3.
    assert compute_passk_scores(1, 4, 2, norm_by_std=False) == pytest.approx((0.5, -1 / 6))
    adv, _ = advantages(
        "grpo_passk",
        [1.0, 0.0, 0.0, 0.0],
        [0, 0, 0, 0],
        torch.ones(4, 2),
        advantage="grpo_passk",
        pass_k=2,
        norm_by_std=False,
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -1 / 6, -1 / 6, -1 / 6]))
    normed, _ = advantages(
        "grpo_passk", [1.0, 0.0, 0.0, 0.0], [0, 0, 0, 0], torch.ones(4, 2), pass_k=2
    )
    torch.testing.assert_close(normed[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))


def test_clip_cov_draws_its_cut_among_tokens_ppo_did_not_clip() -> None:
    """Covariances 1.45 (tokens 0-2, inside the default [1, 5]) and 13.05 (token 3, above).
    Tokens 0 and 1 have ratio 2 with A > 0: PPO already clipped them. The default ratio
    (2e-4 of 4 tokens) cuts one token by the at-least-one floor: always token 2."""
    logp = torch.tensor([[-0.1, -0.1, -0.1, -3.0]])
    adv = torch.tensor([[2.0, 2.0, 2.0, -6.0]])
    old = logp - torch.log(torch.tensor([[2.0, 2.0, 1.0, 1.0]]))
    for seed in range(8):
        torch.manual_seed(seed)
        _, grad, metrics = policy_loss("clip_cov", logp, old, adv)
        assert metrics["cov_selected_frac"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
        assert metrics["pg_clipfrac"].tolist() == [[1.0, 1.0, 0.0, 0.0]]
        # Only token 3 keeps a gradient: -A * ratio = 6.
        torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0, 6.0]]))


def test_abs_plus_kl_estimator_is_accepted_and_straight_through() -> None:
    assert AlgorithmConfig(kl_estimator="abs+", kl_coef=0.1).kl_estimator == "abs+"
    with pytest.raises(ConfigError, match="algorithm.kl_reward_estimator"):
        AlgorithmConfig(kl_reward_estimator="abs+")
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    kl = compute_kl(logp, ref, "abs+")
    torch.testing.assert_close(kl.detach(), torch.tensor([0.5, 1.0]))
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([0.5, -1.0]))  # k2's: log p - log q


# --- discounting: every other test uses gamma = 1 ------------------------------------------


def test_gae_discounts_with_gamma_below_one() -> None:
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    # lambda = 1: returns are the discounted Monte-Carlo returns gamma^(T-1-t).
    _, returns = advantages("gae", [1.0, 1.0], [0, 1], values=values, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    # gamma = lambda = 0.5. Row 0: A2 = 1 - .7 = .3; A1 = .5*.7 - .6 + .25*.3 = -.175;
    # A0 = .5*.6 - .5 + .25*(-.175) = -.24375. Row 1: A1 = 1 - .4 = .6; A0 = .5*.4 - .2 + .25*.6.
    adv, returns = advantages("gae", [1.0, 1.0], [0, 1], values=values, gamma=0.5, lam=0.5)
    raw = torch.tensor([[-0.24375, -0.175, 0.3], [0.15, 0.6, 0.0]])
    torch.testing.assert_close(returns, (raw + values) * MASK)
    flat = raw[MASK.bool()]
    whitened = (flat - flat.mean()) / flat.std(unbiased=False)
    torch.testing.assert_close(adv[MASK.bool()], whitened, atol=1e-5, rtol=0)


def test_gae_skips_an_observation_without_discounting_it() -> None:
    """An observation between two turns is not a step: the reward reaches the first turn
    discounted once (one sampled token later), not twice."""
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.7]])
    _, returns = advantages("gae", [1.0], [0], mask, values=values, gamma=0.5)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.0, 1.0]]))


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_discounts_across_turns(name: str) -> None:
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    _, returns = advantages(name, [1.0, 0.0], [0, 0], mask, gamma=0.5)
    # reinforce_pp_baseline subtracts the group mean 0.5 first: 0.5 and -0.5 on the last token.
    last = (1.0, 0.0) if name == "reinforce_pp" else (0.5, -0.5)
    expected = torch.tensor(
        [[0.25 * last[0], 0.0, 0.5 * last[0], last[0]], [0.5 * last[1], last[1], 0.0, 0.0]]
    )
    torch.testing.assert_close(returns, expected)


def test_place_on_last_token_uses_the_last_masked_token() -> None:
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    placed = place_on_last_token(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert placed.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, 4.0]]


# --- Clip-Cov / KL-Cov bounds and floors --------------------------------------------------


def test_clip_cov_leaves_tokens_outside_the_bounds_alone() -> None:
    """Covariances 0.725 (tokens 0-2) and 6.525 (token 3): none in the default [1, 5], so no
    token is cut even by the at-least-one floor; with ub=7 token 3 is the only candidate."""
    logp = torch.tensor([[-0.1, -0.1, -0.1, -3.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -3.0]])
    _, grad, metrics = policy_loss("clip_cov", logp, logp, adv)
    assert metrics["cov_selected_frac"].sum() == 0
    torch.testing.assert_close(grad, -adv)
    _, grad, metrics = policy_loss("clip_cov", logp, logp, adv, clip_cov_ub=7.0)
    assert metrics["cov_selected_frac"].tolist() == [[0.0, 0.0, 0.0, 1.0]]
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0, -1.0, 0.0]]))
    # clip_cov_ratio 0.5 of 4 tokens asks for 2, but only token 3 is a candidate.
    _, _, metrics = policy_loss("clip_cov", logp, logp, adv, clip_cov_ub=7.0, clip_cov_ratio=0.5)
    assert metrics["cov_selected_frac"].tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_kl_cov_selects_at_least_one_loss_token_never_padding() -> None:
    """Both loss tokens have covariance -0.25, below padding's 0: the default ratio (2e-3 of
    2 tokens) still selects one token, and it is a loss token."""
    logp = torch.tensor([[-1.0, -2.0, 0.0]])
    old = logp - 0.5
    adv = torch.tensor([[1.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    token_loss, _, metrics = policy_loss("kl_cov", logp, old, adv, mask, kl_cov_coef=2.0)
    selected = metrics["cov_selected_frac"]
    assert selected.sum() == 1 and selected[0, 2] == 0
    expected = -adv * math.exp(0.5) + selected * 2.0 * 0.5
    torch.testing.assert_close(token_loss * mask, expected * mask)


def test_select_token_share_floor_and_rounding() -> None:
    from rlframe.algorithms.losses import select_token_share

    assert select_token_share(2e-4, 4) == 1
    assert select_token_share(0.5, 7) == 3
    assert select_token_share(1.0, 7) == 7
    assert select_token_share(0.5, 0) == 0


def test_rloo_group_of_two_scales_by_n_over_n_minus_one() -> None:
    """With two responses the baseline of each is the other's reward: 1 - 0 and 0 - 1."""
    adv, _ = advantages("rloo", [1.0, 0.0, 0.5], [0, 0, 1], torch.ones(3, 1))
    assert adv[:, 0].tolist() == [1.0, -1.0, 0.0]


# --- breakages a second review found unnoticed (issue 35) ---------------------------------


def test_grpo_passk_reads_a_reward_of_exactly_one_half_as_wrong() -> None:
    """Right means a reward above 0.5: of 0.5 and 0.50001 only the second is right, so the
    group holds one right answer (n = 4, k = 2: A+ = 1, A- = -1/3 as above)."""
    adv, _ = advantages(
        "grpo_passk", [0.5, 0.50001, 0.0, 0.0], [0, 0, 0, 0], torch.ones(4, 1), pass_k=2
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1 / 3, 1.0, -1 / 3, -1 / 3]))


def test_kl_cov_penalises_the_size_of_a_negative_log_ratio() -> None:
    """log p - log p_old = -0.5 on every token: the selected token pays +coef * 0.5 (a signed
    penalty would pay it back), and its gradient is -A r - coef, pulling log p up."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    old = logp + 0.5
    adv = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    token_loss, grad, metrics = policy_loss("kl_cov", logp, old, adv, mask, kl_cov_coef=2.0)
    selected = metrics["cov_selected_frac"]
    assert selected.tolist() == [[0.0, 0.0, 1.0, 0.0]]  # the highest covariance, 10/9
    ratio = math.exp(-0.5)
    torch.testing.assert_close(token_loss * mask, (-adv * ratio + selected * 1.0) * mask)
    torch.testing.assert_close(grad * mask, (-adv * ratio - selected * 2.0) * mask)


def test_k3_is_clamped_at_ten_where_the_reference_finds_the_token_far_likelier() -> None:
    """k3 = e^(q-p) - (q-p) - 1: 142.4 at q - p = 5 is clamped to 10 (no gradient through
    the clamp); 4.39 at q - p = 2 is kept; the straight-through k3+ keeps the clamped value."""
    logp = torch.tensor([-6.0, -3.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0])
    kl = compute_kl(logp, ref, "k3")
    torch.testing.assert_close(kl.detach(), torch.tensor([10.0, math.exp(2) - 3]))
    kl.sum().backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, 1 - math.exp(2)]))
    plus = compute_kl(logp.detach(), ref, "k3+")
    torch.testing.assert_close(plus, torch.tensor([10.0, math.exp(2) - 3]))


def test_masked_mean_divides_by_the_tokens_it_counts() -> None:
    from rlframe.algorithms.losses import masked_mean

    values = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert masked_mean(values, mask).item() == 2.0  # not 6 / 4
    assert masked_mean(values, torch.zeros(2, 2)).item() == 0.0
