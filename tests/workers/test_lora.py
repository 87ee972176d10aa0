"""LoRA on the real FSDP2 engine (peft, one gloo rank in this process): what trains, the
reference as adapters-off, and the merged weights the rollout engine gets."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.config.lora import LoraConfig
from rlframe.protocol import Batch
from tests.workers.test_update import make_batch

LR = 1e-2


def make_config(
    rank: int = 8, checkpointing: bool = False, chunk: int = 0, packed: bool | None = False
) -> Config:
    return Config(
        model=ModelConfig(
            path="tiny:0",
            gradient_checkpointing=checkpointing,
            lora=LoraConfig(rank=rank, alpha=16),
        ),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(
            lr=LR,
            mini_batch_size=16,
            micro_batch_size=8,
            logprob_chunk_size=chunk,
            pack_sequences=packed,
        ),
        algorithm=AlgorithmConfig(kl_coef=0.1),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from workers.engines.fsdp import full_tensor

    return {k: full_tensor(v).detach().clone() for k, v in model.state_dict().items()}


def build_role(model_path: str, cfg: Config):  # -> TrainRole
    from workers.train_role import TrainRole

    torch.manual_seed(0)
    return TrainRole(cfg, model_path, "cpu", 1)


def update_twice(role, batch: Batch) -> list[float]:
    """Two steps: LoRA's B starts at zero, so only from the second step on does A move too.
    Returns the gradient norms."""
    return [float(role.update(batch).metrics["actor/grad_norm"]) for _ in range(2)]


@pytest.fixture(scope="module")
def trained(model_path: str, one_rank_group: None):
    role = build_role(model_path, make_config())
    before = full_state(role.actor.model)
    norms = update_twice(role, make_batch())
    return role, before, full_state(role.actor.model), norms


def test_only_adapter_parameters_train(trained) -> None:
    role, before, after, _ = trained
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
    from workers.engines.fsdp import FSDPEngine

    role, _, _, _ = trained
    assert role.ref is None, "LoRA must not build a second copy of the model"
    batch = make_batch(seed=3)
    ref = role.compute_ref_logprobs(batch)
    policy = role.compute_logprobs(batch)
    base_engine = FSDPEngine(model_path, role.cfg.model, None, "cpu")  # no adapters
    base = role.score_logprobs(base_engine, batch)
    mask = batch["response_mask"].bool()
    assert torch.equal(ref[mask], base[mask])
    # ... and the adapters are back on afterwards: the trained policy differs from the base.
    assert float((policy - base)[mask].abs().max()) > 1e-3
    assert torch.equal(role.compute_logprobs(batch), policy)


def test_merged_weights_have_hf_names_and_the_policys_logprobs(trained, model_path: str) -> None:
    from transformers import AutoModelForCausalLM

    from rlframe.sequence_layout import build_layout
    from workers.engines.fsdp import compute_layout_logprobs
    from workers.engines.lora import iter_merged_tensors

    role, _, _, _ = trained
    merged = dict(iter_merged_tensors(role.actor.model))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    assert list(merged) == list(hf.state_dict())
    hf.load_state_dict(merged)
    batch = make_batch(seed=4)
    layout = build_layout(batch, False)
    with torch.no_grad():
        plain = compute_layout_logprobs(hf, layout, 1.0, 0, False).logprobs
    trainer = role.compute_logprobs(batch)
    mask = batch["response_mask"].bool()
    # fp32: x (W + s B A) against x W + s (x A) B, summation order alone.
    torch.testing.assert_close(layout.to_grid(plain)[mask], trainer[mask], atol=2e-5, rtol=0)


def test_checkpointing_and_chunked_logprobs_change_nothing(
    trained, model_path: str, one_rank_group: None
) -> None:
    _, _, reference, norms = trained
    role = build_role(model_path, make_config(checkpointing=True, chunk=7, packed=True))
    assert update_twice(role, make_batch()) == pytest.approx(norms, rel=1e-5)
    after = full_state(role.actor.model)
    moved = 0
    for k, v in reference.items():
        if "lora_" in k:
            # Adam divides by sqrt(v): weights with near-zero gradients amplify summation-order
            # noise, so 5% of a step of size lr (as in tests/workers/test_update.py).
            torch.testing.assert_close(after[k], v, atol=0.05 * LR, rtol=0)
            moved += 1
    assert moved


def test_checkpoint_holds_the_adapters_and_resumes_exactly(
    trained, model_path: str, one_rank_group: None, tmp_path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    role, _, _, _ = trained
    role.save(str(tmp_path / "actor"))
    saved = FileSystemReader(str(tmp_path / "actor")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), "the frozen base was saved"
    optim_keys = [k for k in saved if k.startswith("optim.state.")]
    assert optim_keys and all("lora_" in k for k in optim_keys)
    resumed = build_role(model_path, make_config())
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
    from tests.workers.test_update import with_critic_targets
    from workers.critic import CriticWorker

    cfg = make_config()
    cfg.critic = CriticConfig(enable=True, lr=LR, lora=LoraConfig(rank=4, alpha=8))
    critic = CriticWorker(cfg, model_path, "cpu")
    before = full_state(critic.engine.model)
    critic.update(with_critic_targets(make_batch()))
    critic.update(with_critic_targets(make_batch()))
    after = full_state(critic.engine.model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k or "score" in k for k in changed), changed
    assert any("score" in k for k in changed) and any("lora_A" in k for k in changed)
