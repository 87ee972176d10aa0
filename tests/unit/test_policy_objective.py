"""The composed policy objective (rlframe/algorithms/policy_objective.py) against numbers
worked out by hand.

One response of three sampled tokens and one padding position. The policy's ratios against
the old policy are 1.5, 0.5 and 1, the advantages 1, 1 and -2; clip range 0.2 both ways:

    token 0: r 1.5, A 1  -> max(-1.5, -1.2) = -1.2 (clipped: no gradient)
    token 1: r 0.5, A 1  -> max(-0.5, -0.8) = -0.5 (gradient -A r / 3 = -1/6)
    token 2: r 1,   A -2 -> 2, under the dual clip's 6 (gradient -A r / 3 = 2/3)

so the token-mean loss is (-1.2 - 0.5 + 2) / 3 = 0.1.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlframe.algorithms.losses import LossScale
from rlframe.algorithms.policy_objective import PolicyTerms, compose_policy_loss
from rlframe.config import AlgorithmConfig
from rlframe.core.names import OffPolicyCorrection

OLD = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
RATIOS = torch.tensor([[1.5, 0.5, 1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -2.0, 5.0]])
ENTROPY = torch.tensor([[2.0, 1.0, 3.0, 9.0]])
SCALE = LossScale(tokens=3, sequences=1)


def make_terms(**overrides: torch.Tensor | None) -> PolicyTerms:
    logprobs = (OLD + RATIOS.log()).requires_grad_()
    fields = {
        "logprobs": logprobs,
        "entropy": ENTROPY,
        "advantages": ADVANTAGES,
        "loss_mask": MASK,
        "scale": SCALE,
        "old_logprobs": OLD,
    }
    return PolicyTerms(**(fields | overrides))


def make_config(**overrides: object) -> AlgorithmConfig:
    return AlgorithmConfig(**({"clip_low": 0.2, "clip_high": 0.2} | overrides))


def test_ppo_clip_on_recomputed_old_logprobs() -> None:
    terms = make_terms()
    out = compose_policy_loss(terms, make_config())
    assert out.loss.item() == pytest.approx(0.1, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(terms.logprobs.grad, torch.tensor([[0.0, -1 / 6, 2 / 3, 0.0]]))
    assert out.metrics == pytest.approx(
        {
            "actor/pg_loss": 0.1,
            "actor/entropy": 2.0,
            "actor/pg_clipfrac": 1 / 3,
            "actor/pg_clipfrac_lower": 0.0,
            "actor/ppo_kl": -(math.log(1.5) + math.log(0.5)) / 3,
        },
        abs=1e-6,
    )
    assert torch.equal(out.old_logprobs, OLD)


def test_entropy_bonus_and_kl_penalty() -> None:
    """entropy mean 2 over the loss tokens, k1 KL [0.2, 0.4, 0] -> mean 0.2:
    0.1 - 0.1 * 2 + 1.0 * 0.2 = 0.1; the KL adds d/dlogp (k1 / 3) = 1/3 per token."""
    terms = make_terms()
    ref = terms.logprobs.detach() - torch.tensor([[0.2, 0.4, 0.0, 7.0]])
    cfg = make_config(entropy_coef=0.1, kl_coef=1.0, kl_estimator="k1")
    out = compose_policy_loss(make_terms(logprobs=terms.logprobs, ref_logprobs=ref), cfg)
    assert out.loss.item() == pytest.approx(0.1, abs=1e-6)
    assert out.metrics["actor/entropy"] == pytest.approx(2.0)
    assert out.metrics["actor/kl"] == pytest.approx(0.2, abs=1e-6)
    out.loss.backward()
    expected = torch.tensor([[0.0, -1 / 6, 2 / 3, 0.0]]) + torch.tensor([[1, 1, 1, 0]]) / 3
    torch.testing.assert_close(terms.logprobs.grad, expected)


def test_entropy_without_coefficient_is_reported_not_trained() -> None:
    entropy = ENTROPY.clone().requires_grad_()
    out = compose_policy_loss(make_terms(entropy=entropy), make_config())
    assert out.metrics["actor/entropy"] == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(0.1, abs=1e-6)
    out = compose_policy_loss(make_terms(entropy=entropy), make_config(entropy_coef=0.5))
    assert out.loss.item() == pytest.approx(0.1 - 0.5 * 2.0, abs=1e-6)


def test_decoupled_weights_each_token_by_prox_over_behav() -> None:
    """Behaviour weights 2, 0.5 and 8, the last over the cap 5 and dropped:
    (-1.2 * 2 - 0.5 * 0.5 + 2 * 0) / 3."""
    rollout = OLD - torch.tensor([[2.0, 0.5, 8.0, 1.0]]).log()
    cfg = make_config(off_policy_correction="decoupled", behav_weight_cap=5.0)
    out = compose_policy_loss(make_terms(rollout_logprobs=rollout), cfg)
    assert out.loss.item() == pytest.approx(-2.65 / 3, abs=1e-6)
    assert out.metrics["actor/behav_weight"] == pytest.approx(2.5 / 3, abs=1e-6)
    assert out.metrics["actor/pg_loss"] == pytest.approx(-2.65 / 3, abs=1e-6)
    assert torch.equal(out.old_logprobs, OLD)  # the ratio's old policy is the proximal one


def test_tis_weights_cap_the_mismatch_ratio() -> None:
    """Mismatch ratios old / rollout 4, 1, 0.5 capped at 2: (-1.2 * 2 - 0.5 + 2 * 0.5) / 3."""
    rollout = OLD - torch.tensor([[4.0, 1.0, 0.5, 1.0]]).log()
    out = compose_policy_loss(make_terms(rollout_logprobs=rollout), make_config(tis_cap=2.0))
    assert out.loss.item() == pytest.approx(-1.9 / 3, abs=1e-6)
    assert out.metrics["actor/mismatch_weight"] == pytest.approx(3.5 / 3, abs=1e-6)


def test_rollout_correction_takes_the_engines_logprobs() -> None:
    decoy = OLD + 3.0
    cfg = make_config(off_policy_correction="rollout")
    out = compose_policy_loss(make_terms(old_logprobs=decoy, rollout_logprobs=OLD), cfg)
    assert out.loss.item() == pytest.approx(0.1, abs=1e-6)
    assert torch.equal(out.old_logprobs, OLD)
    assert cfg.off_policy_correction is OffPolicyCorrection.rollout


def test_on_policy_update_takes_its_own_logprobs() -> None:
    """No old log-probs: ratio 1 everywhere, loss -mean(A) = 0, gradient -A / 3."""
    terms = make_terms(old_logprobs=None)
    out = compose_policy_loss(terms, make_config())
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(terms.logprobs.grad, torch.tensor([[-1 / 3, -1 / 3, 2 / 3, 0.0]]))
    torch.testing.assert_close(out.old_logprobs, terms.logprobs.detach())
    assert not out.old_logprobs.requires_grad


def test_a_missing_term_is_named() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        compose_policy_loss(make_terms(), make_config(kl_coef=0.1))
    with pytest.raises(ValueError, match="rollout_logprobs"):
        compose_policy_loss(make_terms(), make_config(off_policy_correction="decoupled"))
