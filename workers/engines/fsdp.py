"""The training engine: an HF causal LM sharded with FSDP2, its optimizer and schedule.

Parallelism is applied by plain functions in a fixed order (see :func:`build_train_model`).
Every rank of the group holds one shard; gathering a full parameter is a collective, so
every rank must walk the weights in the same order (:meth:`FSDPEngine.iter_full_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rlframe.config import ActorConfig, ModelConfig


def pick_attention(device: str) -> str:
    """flash_attention_2 where flash-attn is installed on cuda, else PyTorch's sdpa."""
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return "sdpa"


def pick_dtype(cfg: ModelConfig, device: str) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def load_hf_model(path: str, cfg: ModelConfig, device: str) -> nn.Module:
    """The HF model in fp32 master weights (FSDP casts to the compute dtype)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        attn_implementation=pick_attention(device),
        trust_remote_code=cfg.trust_remote_code,
    )


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype) -> None:
    """Shard each decoder layer, then the root (embeddings, final norm, tied head).

    Per-layer units keep only one layer's full parameters alive at a time. Gradients are
    reduced in fp32 whatever the compute dtype, so small updates are not lost.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def build_train_model(path: str, cfg: ModelConfig, device: str) -> nn.Module:
    """Load, then (1) gradient checkpointing, (2) FSDP2 sharding, (3) move to the device.

    Checkpointing wraps the layers before sharding so that FSDP's hooks see the wrapped
    modules; sharding happens on CPU and ``to(device)`` then moves only the local shards.
    """
    model = load_hf_model(path, cfg, device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    apply_fsdp(model, mesh, pick_dtype(cfg, device))
    return model.to(device)


def build_lr_lambda(cfg: ActorConfig, total_steps: int):
    """Linear warm-up, then constant or cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class SequenceBatch:
    """Model inputs for prompt + response rows (prompts left-padded, responses right-padded)."""

    input_ids: torch.Tensor
    """[B, P + R] token ids."""
    attention_mask: torch.Tensor
    """[B, P + R] 1 on real tokens."""
    position_ids: torch.Tensor
    """[B, P + R] positions counted over real tokens only."""
    response_ids: torch.Tensor
    """[B, R] the response tokens whose log-probs are wanted."""


def make_sequence_batch(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> SequenceBatch:
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return SequenceBatch(input_ids, attention_mask, position_ids, response_ids)


def compute_response_logits(model: nn.Module, seq: SequenceBatch, temperature: float) -> torch.Tensor:
    """[B, R, V] logits that predict each response token, divided by the temperature.

    Dividing matches vLLM's processed log-probs, which are taken after temperature scaling.
    """
    logits = model(
        input_ids=seq.input_ids, attention_mask=seq.attention_mask, position_ids=seq.position_ids, use_cache=False
    ).logits
    r = seq.response_ids.shape[1]
    # Position t predicts token t + 1: the last prompt position predicts the first response token.
    logits = logits[:, -r - 1 : -1].float()
    return logits / temperature if temperature > 0 else logits


def gather_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without keeping the full [B, R, V] log-softmax for backward."""
    return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    """The whole parameter. FSDP2 root parameters can be plain tensors after a no_grad forward."""
    return value.full_tensor() if isinstance(value, DTensor) else value


class FSDPEngine:
    """The policy (or reference) model under FSDP2, with an optimizer when it trains."""

    def __init__(self, path: str, model_cfg: ModelConfig, actor_cfg: ActorConfig | None, device: str, total_steps: int):
        self.device = device
        self.model = build_train_model(path, model_cfg, device)
        self.optimizer: torch.optim.Optimizer | None = None
        if actor_cfg is not None:
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=actor_cfg.lr, weight_decay=actor_cfg.weight_decay, betas=(0.9, 0.999)
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, build_lr_lambda(actor_cfg, total_steps))
            self.grad_clip = actor_cfg.grad_clip
        else:
            self.model.requires_grad_(False)

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip, step and zero the gradients. A non-finite gradient norm skips the step."""
        assert self.optimizer is not None, "a reference engine does not train"
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm_value = float(full_tensor(norm))
        stepped = math.isfinite(norm_value)
        if stepped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm_value, stepped

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def iter_full_weights(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) for every ``state_dict`` entry, gathered bucket by bucket.

        ``state_dict`` (not ``named_parameters``) so that tied weights such as ``lm_head``
        appear under their own name; at most ``bucket_bytes`` of gathered tensors are alive
        beyond the one being consumed. Every rank must consume the whole iterator.
        """
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, value in self.model.state_dict().items():
            tensor = full_tensor(value).detach()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield from bucket
                bucket, size = [], 0
        yield from bucket

    def offload(self) -> None:
        """Move parameters and optimizer state to CPU RAM (cuda only) while vLLM runs."""
        if self.device != "cuda":
            return
        self.model.to("cpu")
        for state in (self.optimizer.state.values() if self.optimizer else []):
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to("cpu", non_blocking=True)
        torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring parameters and optimizer state back to the GPU before training."""
        if self.device != "cuda":
            return
        self.model.to("cuda")
        for state in (self.optimizer.state.values() if self.optimizer else []):
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to("cuda", non_blocking=True)
