"""Issue 7's fixes and additions against hand-computed numbers: range checks, Dr.GRPO
aggregation, two-sided CISPO, KL in the reward, straight-through KL, mismatch corrections,
GMPO, Clip-Cov, KL-Cov and the pass@k advantage."""

from __future__ import annotations

import math

import pytest
import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs, compute_passk_scores
from rlframe.algorithms.losses import (
    POLICY_LOSSES,
    KLController,
    LossScale,
    PolicyLossInputs,
    aggregate_loss,
    apply_kl_penalty,
    compute_kl,
)
from rlframe.algorithms.mismatch import compute_mismatch_metrics, compute_mismatch_weights
from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    RolloutConfig,
)


@pytest.mark.parametrize(
    "field,value",
    [
        ("clip_low", -0.5),
        ("clip_low", 1.5),
        ("clip_high", -1.0),
        ("kl_coef", -3.0),
        ("kl_reward_coef", -1.0),
    ],
)
def test_range_checks_run(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        AlgorithmConfig(**{field: value})


def make_config(**algorithm) -> Config:
    n = algorithm.pop("n", 4)
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2),
        rollout=RolloutConfig(n=n, max_tokens=7),
        actor=ActorConfig(mini_batch_size=2 * n, micro_batch_size=n),
        algorithm=AlgorithmConfig(**algorithm),
    )


def test_cross_field_checks() -> None:
    with pytest.raises(ConfigError, match="rollout.n: algorithm.advantage=grpo compares"):
        make_config(n=1)
    make_config(n=1, advantage="reinforce_pp")  # not group-relative: fine
    with pytest.raises(ConfigError, match="algorithm.pass_k: 8 exceeds"):
        make_config(advantage="grpo_passk", pass_k=8)
    assert make_config().algorithm.loss_agg_norm == 7  # 0 resolves to rollout.max_tokens
    assert make_config(loss_agg_norm=100).algorithm.loss_agg_norm == 100
    with pytest.raises(ConfigError, match="data.task: must be one of"):
        DataConfig(task="arithmatic")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_dr_grpo_aggregations() -> None:
    scale = LossScale(tokens=5.0, sequences=2.0)
    # Token sums 6 and 9, over 2 responses and the constant 4: no response weighed by its length.
    assert aggregate_loss(
        LOSS, MASK, "seq-mean-token-sum-norm", scale, norm=4.0
    ).item() == pytest.approx(15 / 8)
    assert aggregate_loss(LOSS, MASK, "token-sum", scale).item() == pytest.approx(15.0)
    # Shares of two micro-batches add up to the whole, as for the other modes.
    halves = sum(
        aggregate_loss(LOSS[i : i + 1], MASK[i : i + 1], "seq-mean-token-sum-norm", scale, norm=4.0)
        for i in range(2)
    )
    assert halves.item() == pytest.approx(15 / 8)


def policy_loss(
    name: str,
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor | None = None,
    **cfg,
):
    logp = logp.clone().requires_grad_()
    mask = torch.ones_like(adv) if mask is None else mask
    out = POLICY_LOSSES.get(name)(PolicyLossInputs(logp, old, adv, mask, AlgorithmConfig(**cfg)))
    (out.token_loss * mask).sum().backward()
    return out.token_loss.detach(), logp.grad, out.metrics


def test_cispo_clips_the_weight_on_both_sides() -> None:
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[0.5, 1.5]]))
    _, grad, metrics = policy_loss(
        "cispo", logp, old, torch.ones(1, 2), clip_low=0.2, clip_high=0.2
    )
    torch.testing.assert_close(
        grad, torch.tensor([[-0.8, -1.2]])
    )  # weights clamp(0.5)=0.8, clamp(1.5)=1.2
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 1.0]]
    _, upper_only, _ = policy_loss(
        "cispo", logp, old, torch.ones(1, 2), clip_low=1.0, clip_high=0.2
    )
    torch.testing.assert_close(upper_only, torch.tensor([[-0.5, -1.2]]))


def test_kl_in_reward_estimator_and_per_token_mean() -> None:
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-2.0, -1.0, -1.0], [-1.5, -1.5, 0.0]])
    # k1 per token: [1, 0, 0] and [0.5, 0.5]: per-token means 1/3 and 0.5, batch mean 5/12.
    rewards, kl = apply_kl_penalty(torch.zeros(2, 3), old, ref, MASK, coef=0.1)
    assert kl == pytest.approx(5 / 12)
    torch.testing.assert_close(rewards, -0.1 * torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]))
    # k2 = diff^2 / 2: [0.5, 0, 0] and [0.125, 0.125]: means 1/6 and 0.125.
    _, kl2 = apply_kl_penalty(torch.zeros(2, 3), old, ref, MASK, coef=0.1, estimator="k2")
    assert kl2 == pytest.approx((1 / 6 + 0.125) / 2)


def test_adaptive_controller_reads_per_token_kl() -> None:
    ctrl = KLController(0.1, "adaptive", target=0.5, horizon=100)
    _, kl = apply_kl_penalty(
        torch.zeros(2, 3), torch.zeros(2, 3), -torch.ones(2, 3), torch.ones(2, 3), 0.1
    )
    assert kl == pytest.approx(1.0)  # a summed KL would read 3.0
    ctrl.update(kl, 10)  # error clip(1/0.5 - 1) = 0.2 -> x(1 + 0.2 * 10/100)
    assert ctrl.value == pytest.approx(0.1 * 1.02)


@pytest.mark.parametrize("base", ["k1", "k3"])
def test_straight_through_kl_has_k2_gradient(base: str) -> None:
    ref = torch.tensor([-1.0, -2.0, -0.5])
    logp = torch.tensor([-1.5, -1.0, -0.5], requires_grad=True)
    value = compute_kl(logp, ref, f"{base}+")
    torch.testing.assert_close(value.detach(), compute_kl(logp.detach(), ref, base))
    value.sum().backward()
    torch.testing.assert_close(logp.grad, (logp - ref).detach())  # d/dlogp of (logp - ref)^2 / 2


OLD = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
ROLLOUT = torch.log(
    torch.tensor([[0.25, 0.5, 0.5], [1.0, 0.5, 0.9]])
)  # ratios [2, 1, 1] and [0.5, 1, -]


def test_truncated_is_per_token_and_per_sequence() -> None:
    token = compute_mismatch_weights(OLD, ROLLOUT, MASK, AlgorithmConfig(tis_cap=1.5))
    torch.testing.assert_close(token, torch.tensor([[1.5, 1.0, 1.0], [0.5, 1.0, 0.0]]))
    seq = compute_mismatch_weights(
        OLD, ROLLOUT, MASK, AlgorithmConfig(tis_cap=1.5, tis_level="sequence")
    )
    # Products of ratios: 2 -> capped at 1.5; 0.5 stays.
    torch.testing.assert_close(seq, torch.tensor([[1.5, 1.5, 1.5], [0.5, 0.5, 0.0]]))


def test_masked_is_drops_tokens_or_sequences_outside_the_band() -> None:
    token = compute_mismatch_weights(
        OLD,
        ROLLOUT,
        MASK,
        AlgorithmConfig(mismatch_mask="token", mismatch_low=0.6, mismatch_high=1.9),
    )
    torch.testing.assert_close(token, torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]]))
    # Geometric means: 2^(1/3) = 1.26 (kept), sqrt(0.5) = 0.71 (kept at low 0.6, dropped at 0.75).
    seq = compute_mismatch_weights(
        OLD, ROLLOUT, MASK, AlgorithmConfig(mismatch_mask="sequence", mismatch_low=0.75)
    )
    torch.testing.assert_close(seq, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    metrics = compute_mismatch_metrics(
        OLD,
        ROLLOUT,
        MASK,
        AlgorithmConfig(mismatch_mask="token", mismatch_low=0.6, mismatch_high=1.9, tis_cap=1.5),
    )
    assert metrics["mismatch/masked_frac"] == pytest.approx(2 / 5)
    assert metrics["mismatch/tis_clipfrac"] == pytest.approx(1 / 5)
    assert metrics["mismatch/ratio_max"] == pytest.approx(2.0)
    assert metrics["mismatch/ratio_mean"] == pytest.approx((2 + 1 + 1 + 0.5 + 1) / 5)
    k3 = (2 - math.log(2) - 1) + (0.5 - math.log(0.5) - 1)
    assert metrics["mismatch/kl"] == pytest.approx(k3 / 5)


def test_gmpo_geometric_mean_with_sign_aware_clip() -> None:
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[2.0, 0.5], [2.0, 1.0]]))
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    token_loss, grad, _ = policy_loss("gmpo", logp, old, adv, clip_low=0.2, clip_high=0.2)
    # A > 0: pessimistic = min(l, clip(l)): log 1.2 and log 0.5 -> -A * sqrt(1.2 * 0.5).
    # A < 0: pessimistic = max(l, clip(l)): log 2 and log 1 -> -A * sqrt(2).
    torch.testing.assert_close(token_loss[:, 0], torch.tensor([-math.sqrt(0.6), math.sqrt(2.0)]))
    assert (token_loss[:, 0] == token_loss[:, 1]).all()  # one loss per response
    # Gradients flow only through unclipped tokens: d/dl_t of -A exp(mean l') = -A s / 2,
    # counted once per token of the loss (two tokens carry the response's loss).
    torch.testing.assert_close(
        grad, torch.tensor([[0.0, -math.sqrt(0.6)], [math.sqrt(2.0), math.sqrt(2.0)]])
    )


def test_clip_cov_cuts_the_gradient_of_high_covariance_tokens_only() -> None:
    torch.manual_seed(0)
    logp = torch.tensor([[-0.1, -0.2, -3.0, -3.0, -0.1, -3.0]])
    adv = torch.tensor([[2.0, 2.0, -2.0, 0.1, 0.5, 0.5]])
    # On-policy (ratio 1), so PPO's clip cuts nothing and every token has a gradient -A.
    token_loss, grad, metrics = policy_loss(
        "clip_cov", logp, logp, adv, clip_cov_ratio=0.34, clip_cov_lb=1.0, clip_cov_ub=5.0
    )
    # Centred covariances: 2.21, 2.05, 3.60 (tokens 0-2, inside [1, 5]), 0.29, -0.23, 0.36:
    # int(0.34 * 6) = 2 of the three candidates are cut.
    selected = metrics["cov_selected_frac"][0].bool()
    assert int(selected.sum()) == 2 and not selected[3:].any()
    assert (grad[0][selected] == 0).all()
    torch.testing.assert_close(grad[0][~selected], -adv[0][~selected])


def test_kl_cov_penalises_the_top_covariance_token() -> None:
    old = torch.tensor([[-0.4, -2.0, -2.0, -1.0]])
    logp = torch.tensor([[-0.1, -2.0, -2.0, -1.0]])
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    # Covariances: 1.03, 0.82, -0.27, -0.03; kl_cov_ratio 0.25 of 4 tokens selects token 0.
    token_loss, _, metrics = policy_loss(
        "kl_cov", logp, old, adv, kl_cov_ratio=0.25, kl_cov_coef=2.0
    )
    assert metrics["cov_selected_frac"].tolist() == [[1.0, 0.0, 0.0, 0.0]]
    expected = -adv * torch.exp(logp - old)
    expected[0, 0] += 2.0 * 0.3
    torch.testing.assert_close(token_loss, expected)


def test_passk_scores_by_hand() -> None:
    # n = 4, one right, k = 2: R = 1 - C(3,2)/C(4,2) = 0.5, s = 0.5;
    # A+ = 0.5 / 0.5 = 1; A- = (1 - 0.5 - C(2,1)/C(3,1)) / 0.5 = -1/3.
    positive, negative = compute_passk_scores(1, 4, 2)
    assert positive == pytest.approx(1.0) and negative == pytest.approx(-1 / 3)
    # k = 1 is GRPO with the population std: p = 0.25 -> (1 - p)/s and -p/s.
    s = math.sqrt(0.25 * 0.75)
    assert compute_passk_scores(1, 4, 1) == pytest.approx((0.75 / s, -0.25 / s))
    assert compute_passk_scores(0, 4, 2) == (0.0, 0.0) and compute_passk_scores(4, 4, 2) == (
        0.0,
        0.0,
    )


def test_grpo_passk_advantage() -> None:
    out = ADVANTAGES.get("grpo_passk")(
        AdvantageInputs(
            torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
            torch.ones(8, 2),
            torch.tensor([0] * 4 + [1] * 4),
            AlgorithmConfig(advantage="grpo_passk", pass_k=2),
        )
    )
    torch.testing.assert_close(
        out.advantages[:, 0], torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0])
    )
