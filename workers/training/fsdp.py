"""The training engine: an HF causal LM sharded with FSDP2, its optimizer and schedule.

Parallelism is applied by plain functions in a fixed order (see
:func:`workers.training.model_build.build_train_model`).
Every rank of the group holds one shard; gathering a full parameter is a collective, so
every rank must walk the weights in the same order (:class:`workers.sync.weight_sync.WeightSource`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlframe.algorithms.losses import LossScale, count_loss_scale
from rlframe.core.sequence_layout import SequenceLayout, count_row_tokens, plan_micro_batches
from rlframe.core.train_batch import TrainBatch
from workers.model_hooks.router_replay import RouterReplay, replay_layout
from workers.training.dtensor_gather import full_tensor
from workers.training.expert_parallel import clip_split_gradients, find_expert_parallel
from workers.training.layout_forward import (  # noqa: F401 (re-exported: the engine's API)
    compute_layout_hidden,
    compute_layout_logprobs,
    compute_layout_values,
    run_as_root_forward,
)
from workers.training.model_build import build_train_model, pick_attention, pick_dtype
from workers.training.token_logprobs import TokenLogprobs
from workers.training.ulysses import build_sequence_parallel, gather_group_rows

if TYPE_CHECKING:  # the config package needs omegaconf, which bench/gpu_check.py goes without
    from rlframe.config import ActorConfig, ModelConfig
    from rlframe.config.lora import LoraConfig


@dataclass(frozen=True)
class OptimizerSpec:
    """What an engine that trains needs to know about its optimizer and schedule."""

    lr: float
    weight_decay: float
    grad_clip: float
    """Max global gradient norm; <= 0 turns clipping off."""
    warmup_steps: int
    """Optimizer steps of linear learning-rate warm-up."""
    lr_schedule: str
    """constant, or cosine decay to 10% of the peak by ``total_steps``."""
    total_steps: int
    """Optimizer steps in the whole run."""


def build_lr_lambda(spec: OptimizerSpec) -> Callable[[int], float]:
    """Linear warm-up, then constant or cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.lr_schedule == "constant":
            return 1.0
        progress = min(
            1.0, (step - spec.warmup_steps) / max(1, spec.total_steps - spec.warmup_steps)
        )
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class FSDPEngine:
    """A model under FSDP2 (policy, reference or critic), with an optimizer when it trains."""

    def __init__(
        self,
        path: str,
        model_cfg: ModelConfig,
        optim: OptimizerSpec | None,
        device: str,
        head: str = "lm",
        lora: LoraConfig | None = None,
        sequence_parallel_size: int = 1,
        router_replay: bool = False,
        expert_parallel_size: int = 1,
    ):
        self.device = device
        compute_dtype = pick_dtype(model_cfg.dtype, device)
        self.sp = build_sequence_parallel(
            sequence_parallel_size, device, pick_attention(device, compute_dtype)
        )
        self.model = build_train_model(
            path, model_cfg, device, head, lora, self.sp, optim is None, expert_parallel_size
        )
        self.ep = find_expert_parallel(self.model)
        """The expert groups when the experts are split over ranks; None: FSDP2 alone."""
        self.replay = RouterReplay(self.model) if router_replay else None
        """Hooks that route each token to the experts a layout carries (R3); None: off."""
        self.optimizer: torch.optim.Optimizer | None = None
        # Under LoRA only the adapters require grad: the optimizer holds only them.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        if optim is not None:
            self.optimizer = torch.optim.AdamW(
                self.trainable,
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                betas=(0.9, 0.999),
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, build_lr_lambda(optim)
            )
            self.grad_clip = optim.grad_clip
        else:
            self.model.requires_grad_(False)

    def compute_token_logprobs(
        self,
        layout: SequenceLayout,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        entropy_grad: bool = False,
        extra_ids: torch.Tensor | None = None,
    ) -> TokenLogprobs:
        """Log-probs (and entropy) of the layout's selected tokens
        (see :func:`compute_layout_logprobs`), routed as the layout says under router replay."""
        with self.replaying(layout):
            return compute_layout_logprobs(
                self.model,
                layout.to(self.device),
                temperature,
                chunk,
                with_entropy,
                entropy_grad,
                self.sp,
                extra_ids,
            )

    def replaying(self, layout: SequenceLayout) -> AbstractContextManager[None]:
        """See :func:`workers.model_hooks.router_replay.replay_layout`."""
        return replay_layout(self.replay, layout)

    @contextmanager
    def routing_freely(self) -> Iterator[None]:
        """Forwards routed by the model's own routers, no replay: the LoRA reference (adapters
        off) scores as a separate reference engine does, and its rows carry no routing."""
        replay, self.replay = self.replay, None
        try:
            yield
        finally:
            self.replay = replay

    def compute_token_values(self, layout: SequenceLayout) -> torch.Tensor:
        """[N] value-head outputs at the positions that predict the selected tokens (critic)."""
        return compute_layout_values(self.model, layout.to(self.device), self.sp)

    @property
    def sequence_parallel_size(self) -> int:
        return 1 if self.sp is None else self.sp.size

    @property
    def data_parallel_size(self) -> int:
        """Groups that take different rows: the ranks over the sequence-parallel size."""
        return dist.get_world_size() // self.sequence_parallel_size

    def gather_rows(self, rows: TrainBatch, block: int) -> tuple[TrainBatch, torch.Tensor]:
        """(the rows this rank's sequence-parallel group works on, the indices of this rank's
        own rows among them); without sequence parallelism, ``rows`` themselves. See
        :func:`workers.training.ulysses.gather_group_rows`."""
        if self.sp is None:
            return rows, torch.arange(len(rows))
        return gather_group_rows(rows, self.sp, block)

    def optimizer_step(self) -> tuple[float, bool]:
        """Clip, step and zero the gradients. A non-finite gradient norm skips the step."""
        assert self.optimizer is not None, "a reference engine does not train"
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        if self.ep is None:
            norm_value = float(
                full_tensor(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm))
            )
        else:
            norm_value = clip_split_gradients(self.trainable, self.ep, max_norm)
        stepped = math.isfinite(norm_value)
        if stepped:
            self.optimizer.step()
            # A skipped step leaves the schedule where it was, as it leaves the weights.
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value, stepped

    @property
    def lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    def offload(self) -> None:
        """Move parameters and optimizer state to CPU RAM (cuda only) while vLLM runs."""
        if self.device == "cuda":
            self.move_to("cpu")
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Bring parameters and optimizer state back to the GPU before training."""
        if self.device == "cuda":
            self.move_to("cuda")

    def move_to(self, device: str) -> None:
        self.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types `to` unbound
        for state in self.optimizer.state.values() if self.optimizer else []:
            for k, v in state.items():
                # AdamW's step counts stay on the host: on the GPU, every step would read each
                # parameter's count back (one host sync per parameter).
                if isinstance(v, torch.Tensor) and k != "step":
                    state[k] = v.to(device, non_blocking=True)


def compute_global_loss_scale(mini: TrainBatch, device: str, sp_size: int = 1) -> LossScale:
    """Loss tokens (sampled by the policy) and responses with at least one of them in the
    whole mini-batch, summed over ranks (the ``sp_size`` ranks of a sequence-parallel group
    hold the same rows); see :func:`~rlframe.algorithms.losses.count_loss_scale`."""
    local = count_loss_scale(mini.loss_mask)
    counts = torch.tensor([local.tokens, local.sequences], dtype=torch.float64)
    if device == "cuda":
        counts = counts.cuda()
    dist.all_reduce(counts)
    counts /= sp_size
    return LossScale(tokens=float(counts[0]), sequences=float(counts[1]))


def agree_on_max(value: int, device: str) -> int:
    """The largest ``value`` over the ranks of the default group."""
    tensor = torch.tensor([value], dtype=torch.long, device=device if device == "cuda" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def split_micro_batches(
    rows: TrainBatch, sizes: ActorConfig, device: str, packed: bool, sp_size: int = 1
) -> list[TrainBatch]:
    """This rank's micro-batches: ``actor.micro_batch_size`` rows each, or, with
    ``actor.max_tokens_per_micro_batch``, rows filled up to that many tokens per rank (a
    sequence-parallel group of ``sp_size`` ranks takes ``sp_size`` times as many).

    Every rank of the group must run the same number of forwards (each is a chain of FSDP
    collectives), so with a token budget the ranks agree on the largest count and split
    their fullest micro-batches until they have that many. Callers give every rank the same
    number of rows, so the count never exceeds a rank's rows.
    """
    if sizes.max_tokens_per_micro_batch <= 0:
        return rows.split(sizes.micro_batch_size)
    costs = count_row_tokens(rows.prompt_mask, rows.response_mask, packed).tolist()
    budget = sizes.max_tokens_per_micro_batch * sp_size
    plan = plan_micro_batches(costs, budget)
    count = agree_on_max(len(plan), device)
    if count > len(plan):
        plan = plan_micro_batches(costs, budget, min_count=count)
    if len(plan) != count:
        raise RuntimeError(
            f"{len(rows)} rows cannot make the {count} micro-batches the other ranks run"
        )
    return [rows.rows(part) for part in plan]


def accumulate_gradients(
    mini: TrainBatch,
    sizes: ActorConfig,
    device: str,
    packed: bool,
    forward_backward: Callable[[TrainBatch, LossScale], dict[str, float]],
    sp_size: int = 1,
) -> dict[str, list[float]]:
    """Forward and backward over one mini-batch's micro-batches (gradients add up in the
    parameters); every micro-batch's loss is normalised by the whole mini-batch's counts,
    so the sum is the same whatever the split. Returns each metric's per-micro-batch values."""
    scale = compute_global_loss_scale(mini, device, sp_size)
    metrics: dict[str, list[float]] = {}
    for micro in split_micro_batches(mini, sizes, device, packed, sp_size):
        for k, v in forward_backward(micro, scale).items():
            metrics.setdefault(k, []).append(v)
    return metrics


def run_minibatch_updates(
    engine: FSDPEngine,
    batch: TrainBatch,
    sizes: ActorConfig,
    world_size: int,
    forward_backward: Callable[[TrainBatch, LossScale], dict[str, float]],
    prefix: str,
    packed: bool,
) -> dict[str, float]:
    """Epochs x mini-batches x micro-batches of gradient accumulation, one optimizer step
    per mini-batch, with the actor's batch sizes (the critic uses the same ones). Returns
    metric means (and ``<prefix>/grad_norm``, ``<prefix>/lr``).

    Every rank makes the same number of optimizer steps: the config guarantees that each
    rank's share splits into whole mini-batches. Under sequence parallelism ``batch`` is the
    group's rows (:meth:`FSDPEngine.gather_rows`), split by data-parallel group.
    """
    engine.model.train()
    totals: dict[str, list[float]] = {}
    skipped = 0
    sp_size = engine.sequence_parallel_size
    for _ in range(sizes.epochs):
        for mini in batch.split(sizes.mini_batch_size * sp_size // world_size):
            for k, v in accumulate_gradients(
                mini, sizes, engine.device, packed, forward_backward, sp_size
            ).items():
                totals.setdefault(k, []).extend(v)
            grad_norm, stepped = engine.optimizer_step()
            totals.setdefault(f"{prefix}/grad_norm", []).append(grad_norm)
            skipped += not stepped
    metrics = {k: sum(v) / len(v) for k, v in totals.items()}
    metrics[f"{prefix}/skipped_steps"] = float(skipped)
    metrics[f"{prefix}/lr"] = engine.lr
    return metrics
