"""The mixture-of-experts routing terms against numbers worked by hand: the load-balancing
loss (value and gradient), the expert shares with padding left out, the router entropy; and
the coefficient's key, checked before Ray."""

from __future__ import annotations

import math

import pytest
import torch

from rlframe.algorithms.router import (
    compute_expert_shares,
    compute_load_balancing_loss,
    summarize_routing,
)
from rlframe.config import AlgorithmConfig, Config, ConfigError
from rlframe.data.tiny_model import resolve_model_path
from rlframe.models.hf_config import read_config_json, read_model_config
from rlframe.models.moe_routing import check_router_aux_loss
from tests.harness import check_cli
from tests.unit.cli_errors import check_config_error

LN3 = math.log(3.0)


def test_balanced_routing_costs_one_and_one_expert_for_all_costs_more() -> None:
    # Two experts, top-1. Balanced: token 0 -> expert 0 (p 3/4), token 1 -> expert 1 (p 3/4):
    # shares 1/2, 1/2 and mean probabilities 1/2, 1/2 -> 2 * (1/4 + 1/4) = 1.
    balanced = torch.tensor([[LN3, 0.0], [0.0, LN3]])
    mask = torch.ones(2)
    assert float(compute_load_balancing_loss([balanced], 1, mask)) == pytest.approx(1.0)
    # Both tokens -> expert 0 (p 3/4 each): shares 1, 0 and mean probs 3/4, 1/4 -> 2 * 3/4.
    skewed = torch.tensor([[LN3, 0.0], [LN3, 0.0]], requires_grad=True)
    loss = compute_load_balancing_loss([skewed], 1, mask)
    assert float(loss.detach()) == pytest.approx(1.5)
    # The gradient flows through the mean probabilities only: loss = 2 * 1 * mean_t p0(t), so
    # d/dz0(t) = 2 * p0 (1 - p0) / 2 = 3/16, and the opposite sign on the other logit.
    loss.backward()
    assert skewed.grad is not None
    assert torch.allclose(skewed.grad, torch.tensor([[3 / 16, -3 / 16], [3 / 16, -3 / 16]]))
    # Averaged over layers.
    both = compute_load_balancing_loss([balanced, skewed.detach()], 1, mask)
    assert float(both) == pytest.approx(1.25)


def test_shares_leave_padding_out_and_count_every_top_k_choice() -> None:
    # Three experts, top-2; the third token is padding and would pick experts 1 and 2.
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 9.0, 8.0]])
    mask = torch.tensor([1.0, 1.0, 0.0])
    shares = compute_expert_shares(logits, 2, mask)
    assert torch.allclose(shares, torch.tensor([2 / 4, 1 / 4, 1 / 4]))
    metrics = summarize_routing([logits, logits], 2, mask)
    assert metrics["moe/layer1/expert_share_max"] == pytest.approx(0.5)
    assert metrics["moe/layer1/expert_share_min"] == pytest.approx(0.25)


def test_router_entropy_is_the_mean_over_real_tokens() -> None:
    # p = (3/4, 1/4): H = -(3/4 ln 3/4 + 1/4 ln 1/4); a uniform router: ln 2. Padding (huge
    # logits, entropy ~0) does not count.
    logits = torch.tensor([[LN3, 0.0], [0.0, 0.0], [50.0, 0.0]])
    mask = torch.tensor([1.0, 1.0, 0.0])
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    entropy = summarize_routing([logits], 1, mask)["moe/layer0/router_entropy"]
    assert entropy == pytest.approx((h + math.log(2)) / 2)


def test_a_negative_coefficient_stops_before_ray() -> None:
    out = check_cli("+recipe=moe_tiny", "algorithm.router_aux_loss_coef=-0.01")
    assert out.returncode != 0 and "algorithm.router_aux_loss_coef" in out.stderr


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_a_non_finite_coefficient_stops_before_ray(value: str) -> None:
    """inf passed ``>= 0`` and every step logged ``grad nan`` (issue 46); nan was refused as
    "must be >= 0". Every float key of the schema must be finite."""
    check_config_error(
        "+recipe=moe_tiny",
        f"algorithm.router_aux_loss_coef={value}",
        key="algorithm.router_aux_loss_coef",
        text=f"must be a finite number, got {float(value)}",
        before_ray=True,
    )


@pytest.mark.parametrize(
    "override", ["actor.lr=inf", "algorithm.entropy_coef=nan", "rollout.temperature=inf"]
)
def test_any_non_finite_float_key_is_refused(override: str) -> None:
    key, value = override.split("=")
    check_config_error(
        "+recipe=grpo_tiny",
        override,
        key=key,
        text=f"must be a finite number, got {float(value)}",
        before_ray=True,
    )


def test_a_coefficient_without_routers_stops_before_ray() -> None:
    """On the dense tiny:0 the load-balancing loss has nothing to balance: refused (before
    Ray, from config.json) like the other keys without effect; the MoE model takes it."""
    resolve_model_path("tiny:0")  # built: the check before Ray reads its config.json
    check_config_error(
        "+recipe=grpo_tiny",
        "algorithm.router_aux_loss_coef=0.01",
        key="algorithm.router_aux_loss_coef",
        text="has no effect on a dense model",
        before_ray=True,
    )
    dense, moe = resolve_model_path("tiny:0"), resolve_model_path("tiny-moe:0")
    cfg = Config(algorithm=AlgorithmConfig(router_aux_loss_coef=0.01))
    for read in (read_config_json, lambda path: read_model_config(path, False)):
        check_router_aux_loss(cfg, moe, read(moe))
        with pytest.raises(ConfigError, match="router_aux_loss_coef: has no effect"):
            check_router_aux_loss(cfg, dense, read(dense))
