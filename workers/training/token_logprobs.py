"""Per-token log-probs and entropy from final hidden states, without [tokens, vocab] logits.

The LM head turns N hidden states into N x V logits; for V = 151,936 (Qwen) and long
responses these are most of a training step's peak memory, and plain autograd keeps them
(and their softmax) for the backward pass. :class:`ChunkedTokenLogprobs` projects a chunk of
tokens at a time and keeps only the hidden states and the head's weight; the backward pass
recomputes each chunk's logits. Extra peak memory is O(chunk x V) instead of O(N x V), for
one more head matmul per chunk.

Numerics follow the unchunked path: logits in the compute dtype, cast to fp32, divided by
the temperature; gradients come back in the compute dtype, the head's accumulated in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor
    """[N] log p(token) under softmax(logits / temperature), fp32 ([N, K] for [N, K]
    targets: the log-probs of K ids at each position)."""
    entropy: torch.Tensor | None
    """[N] entropy of that distribution, fp32; None when it was not asked for."""
    extra: torch.Tensor | None = None
    """[N, K] log-probs of other ids at each position (a teacher's top-k), when asked for."""


def gather_targets(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[n] values of ``logp`` [n, V] at ``targets`` [n], or [n, K] at ``targets`` [n, K]."""
    if targets.dim() == 1:
        return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.gather(-1, targets)


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits divided by the temperature (vLLM's processed log-probs are taken after it)."""
    logits = logits.float()
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits


def compute_logprobs_unchunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    entropy_grad: bool,
) -> TokenLogprobs:
    """Plain autograd over the full [N, V] logits (``actor.logprob_chunk_size=0``). The
    entropy is computed off the graph unless ``entropy_grad``, so that its [N, V]
    intermediates are not kept for a backward pass that never uses them."""
    logits = scale_logits(hidden @ weight.t(), temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = gather_targets(logits, targets) - (lse if targets.dim() == 1 else lse[:, None])
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp = logits - lse.unsqueeze(-1)
            entropy = -(logp.exp() * logp).sum(-1)
    return TokenLogprobs(logprobs, entropy)


def project_chunk(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's (log-softmax [n, V], probabilities [n, V], target log-probs [n] or
    [n, K])."""
    logp = scale_logits(hidden @ weight.t(), temperature)
    logp -= torch.logsumexp(logp, dim=-1, keepdim=True)
    return logp, logp.exp(), gather_targets(logp, targets)


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) without an [n, V] temporary."""
    # torch.linalg binds its functions through _add_docstr, which the stubs leave as Any.
    return cast(torch.Tensor, torch.linalg.vecdot(a, b))


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(log-probs [N], entropy [N] or empty) of ``targets`` under ``hidden @ weight.T``,
    ``chunk`` tokens at a time; backward recomputes each chunk's softmax.

    With z the tempered logits of a token, p = softmax(z), y its target and H its entropy:
    d log p_y / dz = onehot(y) - p and dH / dz = -p * (log p + H). Targets [N, K] (K ids per
    position) give [N, K] log-probs; their gradients add up.
    """

    @staticmethod
    def forward(
        ctx: Any,  # torch's FunctionCtx, which carries this function's own attributes
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = compute_logprobs_no_grad(hidden, weight, targets, temperature, chunk, with_entropy)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        # Unused outputs (entropy without an entropy bonus) then get None, not zeros.
        ctx.set_materialize_grads(False)
        entropy = out.entropy if out.entropy is not None else out.logprobs.new_empty(0)
        return out.logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        if grad_entropy is not None and grad_entropy.numel() == 0:
            grad_entropy = None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h, y = hidden[start:end], targets[start:end]
            logp, p, _ = project_chunk(h, weight, y, ctx.temperature)
            g = (
                grad_logprobs[start:end].float()
                if grad_logprobs is not None
                else p.new_zeros(y.shape)
            )
            # One column per target: [n, 1] for [n] targets, [n, K] for K ids a position.
            g2, y2 = (g.unsqueeze(-1), y.unsqueeze(-1)) if y.dim() == 1 else (g, y)
            # dL/dz = sum_k onehot(y_k) * g_k - p * c, with c = sum_k g_k + g_H * (log p + H).
            g_sum = g2.sum(-1, keepdim=True)
            if grad_entropy is not None:
                entropy = -row_dot(p, logp)
                coef = logp.add_(entropy.unsqueeze(-1)).mul_(
                    grad_entropy[start:end].float().unsqueeze(-1)
                )
                coef.add_(g_sum)
            else:
                coef = g_sum
            del logp
            grad_z = p.mul_(coef).neg_()
            del coef
            grad_z.scatter_add_(-1, y2, g2)
            if ctx.temperature > 0 and ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_z.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_z.t(), h.float())
            del grad_z, p
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def compute_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> TokenLogprobs:
    """Log-probs (and entropy) of ``targets`` given ``hidden`` [N, H] and the head's ``weight``
    [V, H]; ``chunk`` tokens at a time with recomputation in backward, or plain autograd
    over all N at once when ``chunk`` is 0. The entropy carries a gradient only when
    ``entropy_grad`` (an entropy bonus); otherwise it is a cheap by-product for logging."""
    if chunk <= 0:
        return compute_logprobs_unchunked(
            hidden, weight, targets, temperature, with_entropy, entropy_grad
        )
    if not torch.is_grad_enabled():
        return compute_logprobs_no_grad(hidden, weight, targets, temperature, chunk, with_entropy)
    logprobs, entropy = ChunkedTokenLogprobs.apply(
        hidden, weight, targets, temperature, chunk, with_entropy
    )
    if not with_entropy:
        return TokenLogprobs(logprobs, None)
    return TokenLogprobs(logprobs, entropy if entropy_grad else entropy.detach())


@torch.no_grad()
def compute_logprobs_no_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool,
) -> TokenLogprobs:
    """The chunked forward alone (old and reference log-probs)."""
    chosen_parts: list[torch.Tensor] = []
    entropy_parts: list[torch.Tensor] = []
    for start in range(0, hidden.shape[0], chunk):
        logp, p, chosen = project_chunk(
            hidden[start : start + chunk], weight, targets[start : start + chunk], temperature
        )
        chosen_parts.append(chosen)
        if with_entropy:
            entropy_parts.append(-row_dot(p, logp))
        del logp, p
    logprobs = torch.cat(chosen_parts) if chosen_parts else hidden.new_zeros(0, dtype=torch.float32)
    entropy = (
        (torch.cat(entropy_parts) if entropy_parts else logprobs.clone()) if with_entropy else None
    )
    return TokenLogprobs(logprobs, entropy)
