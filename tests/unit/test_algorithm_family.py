"""The algorithm family against hand-computed numbers: estimators, losses, KL, DAPO pieces."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from rlframe.algorithms.advantages import ADVANTAGES, AdvantageInputs, place_on_last_token
from rlframe.algorithms.losses import (
    POLICY_LOSSES,
    KLController,
    PolicyLossInputs,
    apply_kl_penalty,
    compute_kl,
)
from rlframe.config import AlgorithmConfig, RewardConfig
from rlframe.core.protocol import Batch
from rlframe.rewards.stage import compute_overlong_penalty
from rlframe.rollout.sampling import has_uniform_rewards

PLUGIN_FILE = Path(__file__).resolve().parents[1] / "plugins" / "my_algorithms.py"
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
W_POS, W_NEG = 0.4 / math.sqrt(0.24), -0.6 / math.sqrt(0.24)  # whitened 1,1,1,0,0


def advantages(
    name: str, rewards: list[float], groups: list[int], mask: torch.Tensor = MASK, **kw
) -> tuple[torch.Tensor, torch.Tensor]:
    cfg_fields = {k: kw.pop(k) for k in ("gamma", "lam") if k in kw}
    out = ADVANTAGES.get(name)(
        AdvantageInputs(
            torch.tensor(rewards), mask, torch.tensor(groups), AlgorithmConfig(**cfg_fields), **kw
        )
    )
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
    assert (out.advantages[mask == 0] == 0).all()
    return out.advantages, out.returns


def test_rloo_leaves_each_response_out_of_its_baseline() -> None:
    mask = torch.ones(4, 2)
    adv, _ = advantages("rloo", [1.0, 0.0, 0.0, 0.7], [0, 0, 0, 1], mask)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, -0.5, -0.5, 0.0]))
    equal, _ = advantages("rloo", [0.3, 0.3], [4, 4], torch.ones(2, 2))
    assert equal.abs().max() == 0


def test_reinforce_pp_returns_then_batch_whitening() -> None:
    adv, returns = advantages("reinforce_pp", [1.0, 0.0], [0, 1])
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(
        adv, torch.tensor([[W_POS] * 3, [W_NEG, W_NEG, 0.0]]), atol=1e-4, rtol=0
    )
    _, discounted = advantages("reinforce_pp", [1.0, 0.0], [0, 1], gamma=0.5)
    torch.testing.assert_close(discounted[0], torch.tensor([0.25, 0.5, 1.0]))


def test_reinforce_pp_baseline_subtracts_group_mean_first() -> None:
    adv, returns = advantages("reinforce_pp_baseline", [1.0, 0.0], [0, 0])
    torch.testing.assert_close(returns, torch.tensor([[0.5, 0.5, 0.5], [-0.5, -0.5, 0.0]]))
    torch.testing.assert_close(
        adv, torch.tensor([[W_POS] * 3, [W_NEG, W_NEG, 0.0]]), atol=1e-4, rtol=0
    )


def test_reinforce_pp_uses_token_rewards_with_kl_penalty() -> None:
    token_rewards = torch.tensor([[-0.1, -0.1, 0.9], [0.0, 0.0, 0.0]])
    _, returns = advantages("reinforce_pp", [0.7, 0.0], [0, 1], token_rewards=token_rewards)
    torch.testing.assert_close(returns[0], torch.tensor([0.7, 0.8, 0.9]))


def test_remax_subtracts_the_greedy_reward() -> None:
    out = ADVANTAGES.get("remax")(
        AdvantageInputs(
            torch.tensor([1.0, 0.0]),
            MASK,
            torch.tensor([0, 0]),
            AlgorithmConfig(),
            baseline=torch.tensor([0.25, 0.25]),
        )
    )
    torch.testing.assert_close(out.advantages, torch.tensor([[0.75] * 3, [-0.25, -0.25, 0.0]]))
    assert out.metrics == {"baseline_mean": 0.25}
    with pytest.raises(ValueError, match="greedy baseline"):
        advantages("remax", [1.0, 0.0], [0, 0])


def test_gae_by_hand() -> None:
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])  # 9.0 sits on padding: ignored
    rewards = place_on_last_token(torch.tensor([1.0, 1.0]), MASK)
    _, returns = advantages("gae", [1.0, 1.0], [0, 1], token_rewards=rewards, values=values)
    # lambda = 1: returns are the Monte-Carlo returns (1 everywhere in the response).
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    adv, returns = advantages(
        "gae", [1.0, 1.0], [0, 1], token_rewards=rewards, values=values, lam=0.5
    )
    # A2 = 1 - .7 = .3; A1 = (.7 - .6) + .5 * .3 = .25; A0 = (.6 - .5) + .5 * .25 = .225
    # second row: A1 = 1 - .4 = .6; A0 = (.4 - .2) + .5 * .6 = .5
    raw = torch.tensor([[0.225, 0.25, 0.3], [0.5, 0.6, 0.0]])
    torch.testing.assert_close(returns, (raw + values) * MASK)
    flat = raw[MASK.bool()]
    torch.testing.assert_close(
        adv[MASK.bool()], (flat - flat.mean()) / flat.std(unbiased=False), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    "name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae"]
)
def test_no_nan_with_zero_length_responses_and_groups_of_one(name: str) -> None:
    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]])
    adv, returns = advantages(
        name,
        [0.5, 0.5, 0.5],
        [0, 1, 2],
        mask,
        baseline=torch.tensor([0.5, 0.5, 0.5]),
        values=torch.zeros(3, 2),
    )
    assert adv.abs().sum() == 0 or name in ("reinforce_pp", "gae")
    assert (adv[0] == 0).all() and (returns[0] == 0).all()


def loss(
    name: str, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, **cfg
) -> tuple[torch.Tensor, torch.Tensor, dict]:
    logp = logp.clone().requires_grad_()
    out = POLICY_LOSSES.get(name)(
        PolicyLossInputs(logp, old, adv, torch.ones_like(adv), AlgorithmConfig(**cfg))
    )
    out.token_loss.sum().backward()
    return out.token_loss.detach(), logp.grad, out.metrics


def test_dual_clip_bounds_negative_advantage_losses() -> None:
    logp = torch.log(torch.tensor([[5.0, 5.0]]))
    token_loss, grad, metrics = loss(
        "ppo_clip", logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), clip_ratio_c=3.0
    )
    # A = -1, r = 5: plain PPO gives 5, dual-clip caps it at 3. A = +1: clipped at -1.2.
    torch.testing.assert_close(token_loss, torch.tensor([[3.0, -1.2]]))
    assert grad.abs().sum() == 0 and metrics["pg_clipfrac_lower"].tolist() == [[1.0, 0.0]]
    no_dual, _, _ = loss(
        "ppo_clip", logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), clip_ratio_c=0.0
    )
    torch.testing.assert_close(no_dual, torch.tensor([[5.0, -1.2]]))


def test_gspo_uses_one_ratio_per_sequence() -> None:
    logp = torch.tensor([[math.log(2.0), 0.0]])
    token_loss, grad, _ = loss(
        "gspo", logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), clip_low=0.2, clip_high=0.2
    )
    torch.testing.assert_close(
        token_loss, torch.tensor([[-1.2, -1.2]])
    )  # s = sqrt(2), clipped at 1.2
    assert grad.abs().sum() == 0
    token_loss, grad, _ = loss(
        "gspo", logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]), clip_low=0.2, clip_high=0.2
    )
    s = math.sqrt(2.0)
    torch.testing.assert_close(token_loss, torch.tensor([[s, s]]))
    torch.testing.assert_close(grad, torch.tensor([[s, s]]))  # d(-A s_t)/d logp_t = -A s


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient() -> None:
    old = torch.tensor([[-1.0, -1.0]])
    logp = old + torch.log(torch.tensor([[1.5, 0.9]]))
    token_loss, grad, metrics = loss("cispo", logp, old, torch.tensor([[1.0, 1.0]]), clip_high=0.2)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.9]]))
    torch.testing.assert_close(token_loss, -torch.tensor([[1.2, 0.9]]) * logp)
    assert metrics["pg_clipfrac"].tolist() == [[1.0, 0.0]]


def test_kl_abs_and_penalty_in_reward() -> None:
    assert compute_kl(torch.tensor([-2.0]), torch.tensor([-1.0]), "abs").item() == 1.0
    rewards, mean_kl = apply_kl_penalty(
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([[-1.0, -1.0]]),
        torch.tensor([[-2.0, -1.5]]),
        torch.ones(1, 2),
        0.1,
    )
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.95]]))
    assert mean_kl == pytest.approx(0.75)  # per-token mean of k1 = [1, 0.5]


def test_kl_controllers() -> None:
    fixed = KLController(0.1, "fixed", 0.1, 100)
    fixed.update(5.0, 10)
    assert fixed.value == 0.1
    adaptive = KLController(0.1, "adaptive", 0.1, 100)
    adaptive.update(0.5, 10)  # error 4 is clipped to 0.2
    assert adaptive.value == pytest.approx(0.1 * 1.02)
    adaptive.update(0.0, 10)
    assert adaptive.value == pytest.approx(0.1 * 1.02 * 0.98)


def test_overlong_penalty() -> None:
    cfg = RewardConfig(overlong_buffer=4, overlong_penalty=1.0)
    torch.testing.assert_close(
        compute_overlong_penalty(torch.tensor([5, 6, 8, 10]), 10, cfg),
        torch.tensor([0.0, 0.0, -0.5, -1.0]),
    )
    assert compute_overlong_penalty(torch.tensor([10]), 10, RewardConfig()).item() == 0


def test_dynamic_sampling_split() -> None:
    batch = Batch({"reward": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])})
    assert [has_uniform_rewards(g) for g in batch.split(2)] == [True, False, True]


def test_user_advantage_and_loss_load_by_path() -> None:
    adv_fn = ADVANTAGES.get("tests/plugins/my_algorithms.py:compute_sign_advantages")
    out = adv_fn(
        AdvantageInputs(
            torch.tensor([1.0, 0.0, 0.5]),
            torch.ones(3, 2),
            torch.tensor([0, 0, 0]),
            AlgorithmConfig(),
        )
    )
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([1.0, -1.0, 0.0]))
    loss_fn = POLICY_LOSSES.get("tests.plugins.my_algorithms:compute_reinforce_loss")
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss_fn(
        PolicyLossInputs(
            logp, logp.detach(), torch.tensor([[2.0, 2.0]]), torch.ones(1, 2), AlgorithmConfig()
        )
    ).token_loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -2.0]]))


def test_relative_plugin_paths_are_made_absolute_where_the_config_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's working folder differs from the driver's: the config must carry the file's
    absolute path, resolved against the folder the config was built in (not pytest's)."""
    driver_dir, worker_dir = tmp_path / "driver", tmp_path / "worker"
    (driver_dir / "plugins").mkdir(parents=True)
    worker_dir.mkdir()
    shutil.copy(PLUGIN_FILE, driver_dir / "plugins" / "mine.py")
    monkeypatch.chdir(driver_dir)
    cfg = AlgorithmConfig(
        advantage="plugins/mine.py:compute_sign_advantages",
        policy_loss="tests.plugins.my_algorithms:compute_reinforce_loss",
    )
    assert (
        cfg.advantage == f"{driver_dir.resolve() / 'plugins' / 'mine.py'}:compute_sign_advantages"
    )
    assert (
        cfg.policy_loss == "tests.plugins.my_algorithms:compute_reinforce_loss"
    )  # module paths stay as given
    monkeypatch.chdir(worker_dir)  # where the relative path names no file
    adv_fn = ADVANTAGES.get(cfg.advantage)
    out = adv_fn(
        AdvantageInputs(
            torch.tensor([1.0, 0.0]), torch.ones(2, 1), torch.tensor([0, 0]), AlgorithmConfig()
        )
    )
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([1.0, -1.0]))


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_losses_stay_finite_with_zero_length_responses(name: str, agg: str) -> None:
    from rlframe.algorithms.losses import LossScale, aggregate_loss

    mask = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    out = POLICY_LOSSES.get(name)(
        PolicyLossInputs(
            logp,
            logp.detach() - 0.1,
            torch.tensor([[0.0, 0.0], [1.0, 0.0]]),
            mask,
            AlgorithmConfig(),
        )
    )
    total = aggregate_loss(
        out.token_loss, mask, agg, LossScale(tokens=float(mask.sum()), sequences=2.0)
    )
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(logp.grad).all()
    assert (logp.grad[0] == 0).all()  # the empty response contributes nothing
