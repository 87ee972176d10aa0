"""Observation tokens of a multi-turn response get exactly zero gradient.

The actor's real loss step (``TrainRole.forward_backward``: policy loss, entropy bonus,
KL penalty, mismatch weights) runs on the tiny model without FSDP: tokens with loss mask 0
must not move the weights however wrong their advantages and log-probs are, while they
still feed the later turns as context. The same step's entropy bonus is checked for its sign
here too: it is the one place the bonus enters the loss."""

from __future__ import annotations

from dataclasses import replace
from types import MethodType, SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlframe.algorithms.losses import POLICY_LOSSES, LossScale, PolicyLossInputs, aggregate_loss
from rlframe.config import AlgorithmConfig, Config, RolloutConfig
from rlframe.core.sequence_layout import build_layout
from rlframe.core.train_batch import TrainBatch
from rlframe.data.tiny_model import resolve_model_path
from workers.roles.train_role import TrainRole
from workers.training.fsdp import FSDPEngine, compute_layout_logprobs

# turn 1 | observation | turn 2 | padding
LOSS_MASK = torch.tensor(
    [[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0]]
)
RESPONSE_MASK = torch.tensor([[1.0] * 7 + [0.0], [1.0] * 6 + [0.0] * 2])


def make_batch(seed: int, obs_noise: float) -> TrainBatch:
    gen = torch.Generator().manual_seed(seed)
    rows, width = LOSS_MASK.shape
    observation = RESPONSE_MASK - LOSS_MASK
    noise = (
        torch.randn(rows, width, generator=torch.Generator().manual_seed(99))
        * obs_noise
        * observation
    )
    return TrainBatch(
        prompt_ids=torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]]),
        prompt_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
        response_ids=torch.randint(3, 50, (rows, width), generator=gen),
        response_mask=RESPONSE_MASK,
        loss_mask=LOSS_MASK,
        advantages=(torch.randn(rows, width, generator=gen) * LOSS_MASK) + noise * 50,
        old_logprobs=torch.full((rows, width), -4.0) + noise,
        ref_logprobs=torch.full((rows, width), -3.9) + noise,
        rollout_logprobs=torch.full((rows, width), -4.05) + noise,
    )


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("tiny"))


def parameter_grads(
    model_path: str, batch: TrainBatch, loss: str, **terms: float | str
) -> list[torch.Tensor]:
    """Gradients of one ``forward_backward``; ``terms`` replace the default extra terms."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    extra = {"entropy_coef": 0.01, "kl_coef": 0.1, "kl_estimator": "k3", "tis_cap": 2.0} | terms
    algorithm = AlgorithmConfig(policy_loss=loss, **extra)
    cfg = Config(rollout=RolloutConfig(temperature=1.0), algorithm=algorithm)
    # The engine's log-prob path on a plain (unsharded) model: it reads .model, .device and
    # .sp (no sequence parallelism).
    actor = SimpleNamespace(model=model, device="cpu", sp=None, replay=None)
    actor.compute_token_logprobs = MethodType(FSDPEngine.compute_token_logprobs, actor)
    actor.replaying = MethodType(FSDPEngine.replaying, actor)
    # The role's own update code on this plain model: a text policy without routers.
    worker = TrainRole.__new__(TrainRole)
    worker.cfg, worker.device, worker.world_size = cfg, "cpu", 1
    worker.actor, worker.packed = actor, False
    worker.policy_loss = POLICY_LOSSES.get(loss)
    worker.images, worker.router = None, None
    worker.forward_backward(batch, LossScale(tokens=float(LOSS_MASK.sum()), sequences=2.0))
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_observation_tokens_do_not_move_the_weights(model_path: str, loss: str) -> None:
    clean = parameter_grads(model_path, make_batch(1, obs_noise=0.0), loss)
    noisy = parameter_grads(model_path, make_batch(1, obs_noise=3.0), loss)
    assert any(g.abs().sum() > 0 for g in clean)
    for a, b in zip(clean, noisy, strict=True):
        assert torch.equal(a, b)


def test_logprob_gradient_is_zero_exactly_on_observations(model_path: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    batch = make_batch(2, obs_noise=3.0)
    layout = build_layout(batch, packed=False)
    logprobs = layout.to_grid(
        compute_layout_logprobs(model, layout, 1.0, chunk=0, with_entropy=False).logprobs
    )
    logprobs.retain_grad()
    out = POLICY_LOSSES.get("ppo_clip")(
        # Old log-probs equal to the current ones (ratio 1): no sampled token is clipped.
        PolicyLossInputs(
            logprobs,
            logprobs.detach() + batch.old_logprobs * (1 - LOSS_MASK),
            batch.advantages,
            LOSS_MASK,
            AlgorithmConfig(),
        )
    )
    aggregate_loss(
        out.token_loss, LOSS_MASK, "token-mean", LossScale(float(LOSS_MASK.sum()), 2.0)
    ).backward()
    assert torch.equal(logprobs.grad * (1 - LOSS_MASK), torch.zeros_like(logprobs))
    assert (logprobs.grad[LOSS_MASK.bool()] != 0).all()


def test_entropy_bonus_is_subtracted_from_the_loss(model_path: str) -> None:
    """Zero advantages and no KL: the step's only gradient is the entropy bonus's, which is
    -coef times the gradient of the token-mean entropy (the loss falls as entropy rises)."""
    batch = replace(make_batch(3, obs_noise=0.0), advantages=torch.zeros_like(LOSS_MASK))
    grads = parameter_grads(model_path, batch, "ppo_clip", entropy_coef=0.5, kl_coef=0.0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    layout = build_layout(batch, packed=False)
    token = compute_layout_logprobs(
        model, layout, 1.0, chunk=0, with_entropy=True, entropy_grad=True
    )
    assert token.entropy is not None
    entropy = layout.to_grid(token.entropy)
    aggregate_loss(
        entropy, LOSS_MASK, "token-mean", LossScale(float(LOSS_MASK.sum()), 2.0)
    ).backward()
    expected = [-0.5 * p.grad for p in model.parameters()]
    assert sum(float(g.abs().sum()) for g in expected) > 0
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
