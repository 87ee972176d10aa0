"""Shared pieces of the engine tests (update, LoRA, LoRA sync): configs, a ragged batch,
critic targets, gathered weights, and the gradients an optimizer step is about to apply."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.config.lora import LoraConfig, LoraSync
from rlframe.core.train_batch import TrainBatch

UPDATE_LR = 1e-3
LORA_LR = 1e-2


def make_update_config(micro: int, loss_agg: str, kl_coef: float = 0.0, ranks: int = 1) -> Config:
    """The full-model update's config: actor and critic, 16 responses per step."""
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(lr=UPDATE_LR, mini_batch_size=16, micro_batch_size=micro),
        critic=CriticConfig(enable=True, lr=UPDATE_LR),
        algorithm=AlgorithmConfig(loss_agg=loss_agg, kl_coef=kl_coef, entropy_coef=0.01),
        trainer=TrainerConfig(total_steps=1, device="cpu", procs_per_node=ranks),
    )


def make_lora_config(
    rank: int = 8, checkpointing: bool = False, chunk: int = 0, packed: bool | None = False
) -> Config:
    """A LoRA actor of ``rank`` on the tiny model, 16 responses per step."""
    return Config(
        model=ModelConfig(
            path="tiny:0",
            gradient_checkpointing=checkpointing,
            lora=LoraConfig(rank=rank, alpha=16),
        ),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(
            lr=LORA_LR,
            mini_batch_size=16,
            micro_batch_size=8,
            logprob_chunk_size=chunk,
            pack_sequences=packed,
        ),
        algorithm=AlgorithmConfig(kl_coef=0.1),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def make_lora_vllm_config(sync: LoraSync) -> Config:
    """The LoRA actor with a vLLM rollout engine that receives ``sync``."""
    cfg = make_lora_config(rank=8)
    cfg.model.lora = replace(cfg.model.lora, sync=sync)
    cfg.rollout = RolloutConfig(engine="vllm", n=4, max_tokens=5, cpu_kv_cache_gb=1)
    cfg.data.max_prompt_length = 32
    return cfg


def build_role(model_path: str, cfg: Config) -> Any:  # a workers.roles.train_role.TrainRole
    """A one-rank training role; the same seed gives the same LoRA initialisation."""
    from workers.roles.train_role import TrainRole

    torch.manual_seed(0)
    return TrainRole(cfg, model_path, "cpu", 1)


def make_batch(
    seed: int = 0, advantage_scale: float = 1.0, old: bool = True, ref: bool = True
) -> TrainBatch:
    """16 responses of ragged length (one empty) with random advantages (times
    ``advantage_scale``) and, with ``old`` and ``ref``, random old and reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 40, (16, 4), generator=g)
    response_ids = torch.randint(3, 40, (16, 5), generator=g)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1, 5, 2, 3, 3, 1, 5, 4, 2])
    response_mask = (torch.arange(5)[None] < lengths[:, None]).float()
    return TrainBatch(
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones(16, 4, dtype=torch.long),
        response_ids=response_ids,
        response_mask=response_mask,
        loss_mask=response_mask,
        advantages=torch.randn(16, 1, generator=g) * response_mask * advantage_scale,
        # Drawn in this order, each only when asked: the earlier fields do not depend on it.
        old_logprobs=-3.0 - torch.rand(16, 5, generator=g) if old else None,
        ref_logprobs=-3.0 - torch.rand(16, 5, generator=g) if ref else None,
    )


def with_critic_targets(batch: TrainBatch) -> TrainBatch:
    """Old values and returns for a critic update (values far from the returns on some tokens,
    so both branches of the clipped value loss are taken)."""
    g = torch.Generator().manual_seed(1)
    mask = batch.loss_mask
    return replace(
        batch,
        values=torch.randn(len(batch), 5, generator=g) * mask,
        returns=torch.randn(len(batch), 5, generator=g) * mask,
    )


def gather_weights(model: torch.nn.Module) -> torch.Tensor:
    """All parameters, whole (a collective on every rank when they are sharded)."""
    from workers.training.fsdp import full_tensor

    return torch.cat([full_tensor(p.detach()).reshape(-1) for p in model.parameters()])


def fill_lora_b(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    """Give every LoRA B a seeded random value (it starts at zero, which leaves A without a
    gradient): the same seed gives two models the same adapters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                local = p.to_local() if hasattr(p, "to_local") else p  # one rank: the whole
                local.copy_(torch.randn(local.shape, generator=g) * scale)


@contextlib.contextmanager
def record_step_grads(optimizer: torch.optim.Optimizer) -> Iterator[list[torch.Tensor]]:
    """Each optimizer step's gradients (clipped, accumulated over the micro-batches, whole:
    a collective on every rank when sharded), flattened into one tensor per step, taken just
    before the optimizer applies them.

    Compare these, not the weights after an AdamW step: Adam moves a weight by about
    ``lr * sign(grad)`` whatever the gradient's size, so a near-zero gradient whose sign
    flips with the summation order (another CPU, another thread count) moves its weight
    by up to ``2 * lr``."""
    from workers.training.fsdp import full_tensor

    steps: list[torch.Tensor] = []

    def record(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        steps.append(torch.cat([full_tensor(p.grad).detach().reshape(-1) for p in params]))

    handle = optimizer.register_step_pre_hook(record)
    try:
        yield steps
    finally:
        handle.remove()


def assert_same_gradient(actual: torch.Tensor, expected: torch.Tensor, ulps: float) -> None:
    """``actual`` equals ``expected`` up to ``ulps`` fp32 units of ``expected``'s largest
    element: the rounding of sums taken in another order (micro-batches, ranks, chunks).
    An error in the maths (a missing token, a wrong normalisation) moves the gradient by a
    fraction of its size, far above this."""
    scale = float(expected.abs().max())
    assert scale > 0, "no gradient to compare"
    bound = ulps * torch.finfo(torch.float32).eps * scale
    gap = float((actual - expected).abs().max())
    assert gap <= bound, (
        f"gradients differ by {gap:.3g} = {gap / scale / torch.finfo(torch.float32).eps:.0f} "
        f"ulps of the largest ({scale:.3g}); bound {ulps} ulps"
    )
