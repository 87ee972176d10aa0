"""LoRA on the real FSDP2 engine (peft, one gloo rank in this process): what trains, the
reference as adapters-off, and the merged weights the rollout engine gets."""

from __future__ import annotations

import pytest
import torch

from rlframe.config.lora import LoraConfig
from rlframe.core.train_batch import TrainBatch
from tests.workers.cases import (
    LORA_LR,
    assert_same_gradient,
    build_role,
    fill_lora_b,
    make_batch,
    make_lora_config,
    record_step_grads,
    with_critic_targets,
)

GRADIENT_ULPS = 64
"""Bound on an adapter gradient computed in another summation order, in fp32 ulps of its
largest element. Measured: at most 6.2 (3 batch seeds x 2 adapter seeds, 1 and 2 threads);
a 1e-4 relative error in the chunked log-prob backward shows as ~800."""


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from workers.training.fsdp import full_tensor

    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


def update_twice(role, batch: TrainBatch) -> None:
    """Two steps: LoRA's B starts at zero, so only from the second step on does A move too."""
    for _ in range(2):
        role.update(batch)


@pytest.fixture(scope="module")
def trained(model_path: str, one_rank_group: None):
    role = build_role(model_path, make_lora_config())
    before = full_state(role.actor.model)
    update_twice(role, make_batch())
    return role, before, full_state(role.actor.model)


def step_gradient(role, batch: TrainBatch) -> torch.Tensor:
    """The adapters' gradient of one update on ``batch``, as the optimizer received it."""
    with record_step_grads(role.actor.optimizer) as steps:
        role.update(batch)
    assert len(steps) == 1
    return steps[0]


def test_only_adapter_parameters_train(trained) -> None:
    role, before, after = trained
    adapters = [k for k in before if "lora_" in k]
    base = [k for k in before if "lora_" not in k]
    assert adapters and base
    for k in base:
        assert torch.equal(before[k], after[k]), f"frozen {k} changed"
    for k in adapters:
        assert not torch.equal(before[k], after[k]), f"adapter {k} did not train"
    # The optimizer holds exactly the adapters (AdamW keeps moments for nothing else).
    held = [p for group in role.actor.optimizer.param_groups for p in group["params"]]
    assert len(held) == len(adapters) == len(role.actor.optimizer.state)
    named = {id(p): n for n, p in role.actor.model.named_parameters()}
    assert all("lora_" in named[id(p)] for p in held)


def test_reference_is_the_base_model_with_adapters_off(
    trained, model_path: str, one_rank_group: None
) -> None:
    from workers.training.fsdp import FSDPEngine

    role, _, _ = trained
    assert role.ref is None, "LoRA must not build a second copy of the model"
    batch = make_batch(seed=3)
    ref = role.compute_ref_logprobs(batch)
    policy = role.compute_logprobs(batch)
    base_engine = FSDPEngine(model_path, role.cfg.model, None, "cpu")  # no adapters
    base = role.score_logprobs(base_engine, batch)
    mask = batch.response_mask.bool()
    assert torch.equal(ref[mask], base[mask])
    # ... and the adapters are back on afterwards: the trained policy differs from the base.
    assert float((policy - base)[mask].abs().max()) > 1e-3
    assert torch.equal(role.compute_logprobs(batch), policy)


def test_merged_weights_have_hf_names_and_the_policys_logprobs(trained, model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from rlframe.core.sequence_layout import build_layout
    from workers.training.fsdp import compute_layout_logprobs
    from workers.training.lora import iter_merged_tensors

    role, _, _ = trained
    merged = dict(iter_merged_tensors(role.actor.model))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert list(merged) == list(hf.state_dict())
    hf.load_state_dict(merged)
    batch = make_batch(seed=4)
    layout = build_layout(batch, False)
    with torch.no_grad():
        plain = compute_layout_logprobs(hf, layout, 1.0, 0, False).logprobs
    trainer = role.compute_logprobs(batch)
    mask = batch.response_mask.bool()
    # fp32: x (W + s B A) against x W + s (x A) B, summation order alone.
    torch.testing.assert_close(layout.to_grid(plain)[mask], trainer[mask], atol=2e-5, rtol=0)


def test_checkpointing_and_chunked_logprobs_change_nothing(
    model_path: str, one_rank_group: None
) -> None:
    """Gradient checkpointing, log-probs in chunks of 7 and packed sequences give the plain
    path's log-probs and gradients, up to fp32 rounding. Compared before the optimizer step,
    not after it: AdamW moves a weight by about lr whatever its gradient's size, so weights
    of near-zero gradients differ by up to 2 lr on a CPU that rounds differently (one of
    1024 by 9.4e-4 after two steps on an AMD EPYC). Every B is set non-zero first, so that
    A's gradient is not zero either."""
    plain = build_role(model_path, make_lora_config())
    other = build_role(model_path, make_lora_config(checkpointing=True, chunk=7, packed=True))
    for role in (plain, other):
        fill_lora_b(role.actor.model, seed=1)
    batch = make_batch()
    mask = batch.response_mask.bool()
    logprobs = plain.compute_logprobs(batch)[mask]
    gap = float((other.compute_logprobs(batch)[mask] - logprobs).abs().max())
    expected, actual = step_gradient(plain, batch), step_gradient(other, batch)
    a_and_b = {n for n, p in plain.actor.model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in a_and_b) and any("lora_B" in n for n in a_and_b)
    assert (expected != 0).float().mean() > 0.5, "most adapter weights must have a gradient"
    # Measured: at most 1.8 fp32 ulps of the largest log-prob (seeds and threads as below).
    assert gap < 16 * torch.finfo(torch.float32).eps * float(logprobs.abs().max()), gap
    assert_same_gradient(actual, expected, ulps=GRADIENT_ULPS)


def test_checkpoint_holds_the_adapters_and_resumes_exactly(
    trained, model_path: str, one_rank_group: None, tmp_path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    role, _, _ = trained
    role.save(str(tmp_path / "actor"))
    saved = FileSystemReader(str(tmp_path / "actor")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), "the frozen base was saved"
    optim_keys = [k for k in saved if k.startswith("optim.state.")]
    assert optim_keys and all("lora_" in k for k in optim_keys)
    resumed = build_role(model_path, make_lora_config())
    resumed.load(str(tmp_path / "actor"))
    assert resumed.weights_version == role.weights_version
    batch = make_batch(seed=5)
    role.update(batch)
    resumed.update(batch)
    a, b = full_state(role.actor.model), full_state(resumed.actor.model)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.actor.lr == role.actor.lr


def test_critic_lora_trains_adapters_and_its_value_head(
    model_path: str, one_rank_group: None
) -> None:
    from rlframe.config import CriticConfig
    from workers.critic import CriticWorker

    cfg = make_lora_config()
    cfg.critic = CriticConfig(enable=True, lr=LORA_LR, lora=LoraConfig(rank=4, alpha=8))
    critic = CriticWorker(cfg, model_path, "cpu")
    before = full_state(critic.engine.model)
    critic.update(with_critic_targets(make_batch()))
    critic.update(with_critic_targets(make_batch()))
    after = full_state(critic.engine.model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k or "score" in k for k in changed), changed
    assert any("score" in k for k in changed) and any("lora_A" in k for k in changed)
