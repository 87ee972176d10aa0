"""Chunked log-probs and entropy equal the unchunked ones: values and gradients, with the
custom autograd function alone and through a real FSDP2 engine (tied and untied heads)."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ModelConfig
from rlframe.core.sequence_layout import build_layout
from rlframe.data.tiny_model import resolve_model_path
from tests.workers.layout_cases import (
    build_untied_model,
    free_port,
    gather_grads,
    make_batch,
    set_rank_env,
)
from workers.training.token_logprobs import compute_token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_function_matches_autograd(temperature: float, entropy_grad: bool) -> None:
    g = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 45, 24, 301
    hidden = torch.randn(n, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) / 4
    targets = torch.randint(0, vocab, (n,), generator=g)
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = []
    for chunk in (0, 8, 45, 1000):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = compute_token_logprobs(
            h, w, targets, temperature, chunk, with_entropy=True, entropy_grad=entropy_grad
        )
        loss = (a * out.logprobs).sum() + ((b * out.entropy).sum() if entropy_grad else 0.0)
        loss.backward()
        assert out.entropy.requires_grad == entropy_grad
        results.append((out.logprobs.detach(), out.entropy.detach(), h.grad, w.grad))
    reference = results[0]
    assert reference[2].abs().max() > 1e-3 and reference[3].abs().max() > 1e-3
    for chunked in results[1:]:
        for got, want in zip(chunked, reference):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_entropy_is_not_computed_when_not_asked() -> None:
    h, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    out = compute_token_logprobs(h, w, torch.zeros(5, dtype=torch.long), 1.0, 2, with_entropy=False)
    assert out.entropy is None
    out.logprobs.sum().backward()
    assert h.grad is not None and w.grad is not None


def test_no_grad_path_matches() -> None:
    h, w = torch.randn(30, 8), torch.randn(17, 8)
    y = torch.randint(0, 17, (30,))
    want = compute_token_logprobs(h, w, y, 0.8, 0, with_entropy=True)
    with torch.no_grad():
        got = compute_token_logprobs(h, w, y, 0.8, 7, with_entropy=True)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tied = resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("models"))
    return {"tied": tied, "untied": build_untied_model(tied, tmp_path_factory.mktemp("untied"))}


@pytest.fixture(scope="module", autouse=True)
def single_rank_group() -> None:
    set_rank_env(0, 1, free_port())


def engine_results(
    path: str, chunk: int, packed: bool, temperature: float
) -> tuple[torch.Tensor, ...]:
    """Log-probs, entropy and every parameter's gradient of a loss over both, on FSDP2."""
    import torch.distributed as dist

    from workers.training.fsdp import FSDPEngine, OptimizerSpec

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    engine = FSDPEngine(
        path, ModelConfig(path=path), OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 1), "cpu"
    )
    batch = make_batch()
    layout = build_layout(batch, packed)
    out = engine.compute_token_logprobs(
        layout, temperature, chunk, with_entropy=True, entropy_grad=True
    )
    g = torch.Generator().manual_seed(3)
    # A token-mean loss, the scale of a real one.
    loss = (torch.randn(out.logprobs.shape, generator=g) * out.logprobs + 0.1 * out.entropy).mean()
    loss.backward()
    return (
        layout.to_grid(out.logprobs.detach()),
        layout.to_grid(out.entropy.detach()),
        gather_grads(engine.model),
    )


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_engine_chunked_equals_unchunked(model_paths: dict[str, str], head: str) -> None:
    want = engine_results(model_paths[head], 0, packed=False, temperature=0.7)
    got = engine_results(model_paths[head], 5, packed=False, temperature=0.7)
    assert want[2].abs().max() > 1e-3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    # Only loss-mask tokens are projected: row 0's last response token is an observation.
    assert bool(want[0][0, 8] == 0) and bool((want[0][0, :8] < 0).all())


def test_untied_head_is_its_own_weight(model_paths: dict[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_paths["untied"])
    assert (
        model.get_output_embeddings().weight.data_ptr()
        != model.get_input_embeddings().weight.data_ptr()
    )
