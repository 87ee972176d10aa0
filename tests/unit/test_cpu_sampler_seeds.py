"""vLLM's CPU sampler with rlframe's in-place seed draws samples exactly what vLLM's own does.

The draws run on vLLM's real ``TopKTopPSampler`` and its ``fused_gumbel_argmax`` kernel; the
reference is vLLM's own ``forward_cpu``, kept by the replacement as ``replaces``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from workers.inference.vllm_cpu import use_in_place_seed_draws

ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")


def vllm_and_ours() -> tuple[Callable[..., Any], Callable[..., Any]]:
    use_in_place_seed_draws()
    ours = ops.TopKTopPSampler.forward_cpu
    assert hasattr(ours, "replaces"), "the CPU sampler was not replaced"
    return ours.replaces, ours


def sample_steps(
    forward: Callable[..., Any], mode: str, seeded: dict[int, int], steps: int, use_k_p: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``steps`` sampling steps of 6 rows over a vocabulary of 50, ``seeded`` rows with a
    generator of their own (advanced step by step, as the engine's are)."""
    sampler = ops.TopKTopPSampler(logprobs_mode=mode)
    generators = {row: torch.Generator().manual_seed(seed) for row, seed in seeded.items()}
    data = torch.Generator().manual_seed(7)
    k = torch.tensor([50, 5, 50, 3, 50, 50]) if use_k_p else None
    p = torch.tensor([1.0, 1.0, 0.8, 1.0, 0.5, 1.0]) if use_k_p else None
    torch.manual_seed(11)  # the unseeded rows draw from the global generator
    out = []
    for _ in range(steps):
        logits = torch.randn(6, 50, generator=data) * 3
        tokens, returned = forward(sampler, logits, generators, k, p)
        out.append((tokens.clone(), None if returned is None else returned.clone()))
    return out


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs", "processed_logits"])
@pytest.mark.parametrize("use_k_p", [False, True], ids=["plain", "top-k-top-p"])
def test_in_place_draws_sample_what_vllms_sampler_samples(mode: str, use_k_p: bool) -> None:
    vllm_forward, our_forward = vllm_and_ours()
    seeded = {0: 1234, 2: 99, 5: 2**40 + 3}
    theirs = sample_steps(vllm_forward, mode, seeded, steps=12, use_k_p=use_k_p)
    ours = sample_steps(our_forward, mode, seeded, steps=12, use_k_p=use_k_p)
    for step, ((their_tokens, their_lp), (our_tokens, our_lp)) in enumerate(
        zip(theirs, ours, strict=True)
    ):
        assert torch.equal(our_tokens, their_tokens), f"step {step}: {our_tokens} != {their_tokens}"
        assert (our_lp is None) == (their_lp is None)
        if our_lp is not None:
            assert torch.equal(our_lp, their_lp)
    # The seeded rows' samples move from step to step: their generators advance.
    column = torch.stack([tokens for tokens, _ in ours])[:, 0]
    assert column.unique().numel() > 1


def test_a_seeded_request_samples_the_same_whatever_its_batch() -> None:
    """A seeded row's samples depend on its seed alone, not on its row or its neighbours."""
    _, our_forward = vllm_and_ours()
    alone = sample_steps(our_forward, "raw_logprobs", {3: 555}, steps=6, use_k_p=False)
    crowded = sample_steps(
        our_forward, "raw_logprobs", {0: 1, 3: 555, 4: 2}, steps=6, use_k_p=False
    )
    assert [t[3] for t, _ in alone] == [t[3] for t, _ in crowded]


def test_the_engines_sampler_uses_the_in_place_draws() -> None:
    """The engine binds ``forward_cpu`` when it builds its sampler (after the replacement)."""
    _, our_forward = vllm_and_ours()
    sampler = ops.TopKTopPSampler()
    assert getattr(sampler.forward, "__func__", None) is our_forward
    use_in_place_seed_draws()  # a second call leaves the replacement as it is
    assert ops.TopKTopPSampler.forward_cpu is our_forward
