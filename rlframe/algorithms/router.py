"""Mixture-of-experts routing terms: the router's load-balancing loss and the expert-load
metrics, from each MoE layer's router logits. Pure tensor code.

Every function takes ``router_logits``: one ``[tokens, experts]`` tensor per MoE layer (the
router's scores before the softmax, as transformers' MoE routers return them), ``top_k``
(experts per token) and ``mask`` (``[tokens]``, 1 on the tokens that count: padding 0).
"""

from __future__ import annotations

import torch


def compute_expert_shares(logits: torch.Tensor, top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """[experts] share of the layer's top-k assignments each expert receives (sums to 1;
    1 / experts each at perfect balance). No gradient: a count."""
    experts = logits.shape[-1]
    chosen = logits.topk(top_k, dim=-1).indices
    weights = mask.to(logits.device, torch.float32)[:, None].expand_as(chosen)
    counts = torch.zeros(experts, device=logits.device).scatter_add_(
        0, chosen.reshape(-1), weights.reshape(-1)
    )
    return counts / counts.sum().clamp(min=1)


def compute_load_balancing_loss(
    router_logits: list[torch.Tensor], top_k: int, mask: torch.Tensor
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, averaged over layers: per layer
    ``experts * sum_e share_e * mean_prob_e``, where ``share_e`` is expert e's share of the
    top-k assignments (a count, no gradient) and ``mean_prob_e`` its mean router probability
    (the gradient flows through it). 1 at perfect balance, ``experts`` when one expert takes
    every token."""
    losses = []
    for logits in router_logits:
        m = mask.to(logits.device, torch.float32)
        probs = torch.softmax(logits.float(), dim=-1)
        mean_prob = (probs * m[:, None]).sum(0) / m.sum().clamp(min=1)
        shares = compute_expert_shares(logits.detach(), top_k, m)
        losses.append(logits.shape[-1] * (shares * mean_prob).sum())
    return torch.stack(losses).mean()


def summarize_routing(
    router_logits: list[torch.Tensor], top_k: int, mask: torch.Tensor
) -> dict[str, float]:
    """Per MoE layer i: ``moe/layer{i}/expert_share_max`` and ``_min`` (the largest and the
    smallest share of the top-k assignments an expert gets; both 1 / experts at perfect
    balance) and ``moe/layer{i}/router_entropy`` (mean entropy of the router's distribution
    over experts, in nats; log(experts) when it is uniform)."""
    metrics: dict[str, float] = {}
    for i, logits in enumerate(router_logits):
        logits = logits.detach().float()
        m = mask.to(logits.device, torch.float32)
        shares = compute_expert_shares(logits, top_k, m)
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        metrics[f"moe/layer{i}/expert_share_max"] = float(shares.max())
        metrics[f"moe/layer{i}/expert_share_min"] = float(shares.min())
        metrics[f"moe/layer{i}/router_entropy"] = float((entropy * m).sum() / m.sum().clamp(min=1))
    return metrics
