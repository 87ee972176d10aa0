"""The mixture-of-experts terms of the actor's update on a real one-rank FSDP2 engine in this
process (``tiny-moe:0``): the load-balancing loss's gradient, its sign and scale, the
expert-load metrics; a dense policy's update reports none of them."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from rlframe.config import AlgorithmConfig
from rlframe.data.tiny_model import MOE_EXPERTS, resolve_model_path
from tests.workers.cases import build_role, make_batch, make_update_config

pytestmark = pytest.mark.usefixtures("one_rank_group")


@pytest.fixture(scope="module")
def moe_path() -> str:
    return resolve_model_path("tiny-moe:0")


def update_metrics(path: str, coef: float, steps: int = 1) -> list[dict[str, float]]:
    """Each step's metrics of ``steps`` updates on one batch with zero advantages: the only
    gradient left is the load-balancing loss's."""
    cfg = make_update_config(micro=8, loss_agg="token-mean")
    cfg.critic.enable = False
    cfg.actor.lr = 1e-4
    cfg.algorithm = AlgorithmConfig(router_aux_loss_coef=coef)
    role = build_role(path, cfg)
    batch = make_batch()
    batch = replace(batch, advantages=batch.advantages * 0)
    return [role.update(batch).metrics for _ in range(steps)]


def test_load_balancing_loss_is_the_only_gradient_and_evens_the_load(moe_path: str) -> None:
    off = update_metrics(moe_path, 0.0)[0]
    assert off["actor/grad_norm"] == 0.0
    on = update_metrics(moe_path, 0.5, steps=3)
    doubled = update_metrics(moe_path, 1.0)[0]
    assert on[0]["actor/grad_norm"] > 0
    assert doubled["actor/grad_norm"] == pytest.approx(2 * on[0]["actor/grad_norm"], rel=1e-5)
    # Steps down the loss (a flipped sign would unbalance the routers further).
    aux = [m["actor/router_aux_loss"] for m in on]
    print(f"load-balancing loss over three steps: {aux}")
    assert aux[2] < aux[1] < aux[0]
    assert off["actor/router_aux_loss"] == pytest.approx(aux[0], rel=1e-6)  # reported when off
    for layer in range(2):
        top = on[0][f"moe/layer{layer}/expert_share_max"]
        bottom = on[0][f"moe/layer{layer}/expert_share_min"]
        assert 0 <= bottom <= 1 / MOE_EXPERTS <= top <= 1
        assert 0 < on[0][f"moe/layer{layer}/router_entropy"] <= math.log(MOE_EXPERTS)


def test_a_dense_policy_reports_no_routing(tmp_path_factory: pytest.TempPathFactory) -> None:
    dense = resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("dense"))
    metrics = update_metrics(dense, 0.5)[0]
    assert not [k for k in metrics if k.startswith("moe/") or "router" in k]
    assert metrics["actor/grad_norm"] == 0.0  # the coefficient has nothing to act on
