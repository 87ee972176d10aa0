"""Mixture-of-experts routing terms: the router's load-balancing loss and the expert-load
metrics, from each MoE layer's router logits. Pure tensor code.

Every function takes ``router_logits``: one ``[tokens, experts]`` tensor per MoE layer (the
router's scores before the softmax, as transformers' MoE routers return them), ``top_k``
(experts per token) and ``mask`` (``[tokens]``, 1 on the tokens that count: padding 0).

Both terms are ratios of sums over the micro-batch's tokens. On several ranks each rank sees
part of the micro-step's tokens (its own rows; under sequence parallelism a slice of them), so
``group_sum`` (a sum over the training ranks, differentiable) turns a rank's sums into the
micro-step's before any ratio is taken: the loss of the union of the ranks' micro-batches, as
one rank holding them all computes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

GroupSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks whose tokens make up the micro-step (its gradient reaches
each rank's own addend); None: this rank holds every token."""


def count_assignments(logits: torch.Tensor, top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """[experts] top-k assignments each expert receives from the masked tokens. No
    gradient: a count."""
    chosen = logits.detach().topk(top_k, dim=-1).indices
    weights = mask.to(logits.device, torch.float32)[:, None].expand_as(chosen)
    counts = torch.zeros(logits.shape[-1], device=logits.device)
    return counts.scatter_add_(0, chosen.reshape(-1), weights.reshape(-1))


def compute_expert_shares(logits: torch.Tensor, top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """[experts] share of the layer's top-k assignments each expert receives (sums to 1;
    1 / experts each at perfect balance). No gradient: a count."""
    counts = count_assignments(logits, top_k, mask)
    return counts / counts.sum().clamp(min=1)


def sum_routing(
    router_logits: list[torch.Tensor], top_k: int, mask: torch.Tensor, group_sum: GroupSum | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer, over the masked tokens (of the whole group with ``group_sum``): the router
    probabilities' sum [layers, experts] (with gradient), the top-k assignment counts
    [layers, experts], the router entropies' sum [layers], and the token count [1]. One
    collective carries all four."""
    m = mask.to(router_logits[0].device, torch.float32)
    probs, counts, entropy = [], [], []
    for logits in router_logits:
        logp = torch.log_softmax(logits.float(), dim=-1)
        probs.append((logp.exp() * m[:, None]).sum(0))
        counts.append(count_assignments(logits, top_k, m))
        entropy.append((-(logp.exp() * logp).sum(-1).detach() * m).sum())
    prob_sums, count_sums, entropy_sums = (
        torch.stack(probs),
        torch.stack(counts),
        torch.stack(entropy),
    )
    tokens = m.sum()[None]
    if group_sum is None:
        return prob_sums, count_sums, entropy_sums, tokens
    flat = group_sum(
        torch.cat([prob_sums.reshape(-1), count_sums.reshape(-1), entropy_sums, tokens])
    )
    cut = prob_sums.numel()
    return (
        flat[:cut].view_as(prob_sums),
        flat[cut : 2 * cut].detach().view_as(count_sums),
        flat[2 * cut : -1].detach(),
        flat[-1:].detach(),
    )


def compute_load_balancing_loss(
    router_logits: list[torch.Tensor],
    top_k: int,
    mask: torch.Tensor,
    group_sum: GroupSum | None = None,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, averaged over layers: per layer
    ``experts * sum_e share_e * mean_prob_e``, where ``share_e`` is expert e's share of the
    top-k assignments (a count, no gradient) and ``mean_prob_e`` its mean router probability
    (the gradient flows through it). 1 at perfect balance, ``experts`` when one expert takes
    every token."""
    prob_sums, counts, _, tokens = sum_routing(router_logits, top_k, mask, group_sum)
    mean_prob = prob_sums / tokens.clamp(min=1)
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    return (prob_sums.shape[-1] * (shares * mean_prob).sum(-1)).mean()


def summarize_routing(
    router_logits: list[torch.Tensor],
    top_k: int,
    mask: torch.Tensor,
    group_sum: GroupSum | None = None,
) -> dict[str, float]:
    """Per MoE layer i: ``moe/layer{i}/expert_share_max`` and ``_min`` (the largest and the
    smallest share of the top-k assignments an expert gets; both 1 / experts at perfect
    balance) and ``moe/layer{i}/router_entropy`` (mean entropy of the router's distribution
    over experts, in nats; log(experts) when it is uniform)."""
    detached = [logits.detach() for logits in router_logits]
    _, counts, entropy_sums, tokens = sum_routing(detached, top_k, mask, group_sum)
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    entropy = entropy_sums / tokens.clamp(min=1)
    metrics: dict[str, float] = {}
    for i in range(len(router_logits)):
        metrics[f"moe/layer{i}/expert_share_max"] = float(shares[i].max())
        metrics[f"moe/layer{i}/expert_share_min"] = float(shares[i].min())
        metrics[f"moe/layer{i}/router_entropy"] = float(entropy[i])
    return metrics
