"""Packed rows (one sequence, positions restarting, no attention mask) give the log-probs,
gradients and values of padded rows, and sequences packed together do not see each other."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ModelConfig
from rlframe.core.sequence_layout import build_layout
from tests.workers.layout_cases import gather_grads, make_batch

pytestmark = pytest.mark.usefixtures("one_rank_group")


def build_engine(path: str, head: str = "lm"):
    from workers.training.fsdp import FSDPEngine, OptimizerSpec

    return FSDPEngine(
        path,
        ModelConfig(path=path),
        OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 1),
        "cpu",
        head=head,
    )


def logprobs_and_grads(path: str, packed: bool, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    engine = build_engine(path)
    batch = make_batch()
    layout = build_layout(batch, packed)
    logprobs = layout.to_grid(
        engine.compute_token_logprobs(layout, 1.0, chunk, with_entropy=False).logprobs
    )
    g = torch.Generator().manual_seed(5)
    (torch.randn(logprobs.shape, generator=g) * logprobs).sum().div(
        batch.loss_mask.sum()
    ).backward()
    return logprobs.detach(), gather_grads(engine.model)


@pytest.mark.parametrize("chunk", [0, 4])
def test_packed_equals_padded(model_path: str, chunk: int) -> None:
    padded, padded_grads = logprobs_and_grads(model_path, packed=False, chunk=chunk)
    packed, packed_grads = logprobs_and_grads(model_path, packed=True, chunk=chunk)
    mask = make_batch().loss_mask.bool()
    assert bool((padded[mask] < 0).all()) and bool((padded[~mask] == 0).all())
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_grads, padded_grads, atol=1e-5, rtol=1e-5)


def test_packed_layout_has_no_padding_and_no_mask() -> None:
    batch = make_batch()
    layout = build_layout(batch, packed=True)
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    assert layout.attention_mask is None
    assert layout.input_ids.shape == (1, real)
    # Positions restart at 0 once per row.
    assert int((layout.position_ids == 0).sum()) == len(batch)


@torch.no_grad()
def test_changing_one_sequence_leaves_the_others_unchanged(model_path: str) -> None:
    engine = build_engine(model_path)
    batch = make_batch()
    changed = make_batch()
    # Row 5 (A) gets another prompt and other response tokens; it is packed right before row 6 (B).
    changed.prompt_ids[5] = (changed.prompt_ids[5] + 7) % 40 * changed.prompt_mask[5]
    changed.response_ids[5] = (changed.response_ids[5] + 3) % 40 * changed.response_mask[5].long()

    def score(rows):
        layout = build_layout(rows, packed=True)
        return layout.to_grid(
            engine.compute_token_logprobs(layout, 1.0, 0, with_entropy=False).logprobs
        )

    before, after = score(batch), score(changed)
    others = torch.arange(len(batch)) != 5
    assert not torch.allclose(before[5], after[5], atol=1e-3)
    torch.testing.assert_close(after[others], before[others], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_critic_values_packed_equal_padded(model_path: str) -> None:
    engine = build_engine(model_path, head="value")
    engine.model.eval()
    batch = make_batch()
    values = {}
    for packed in (False, True):
        layout = build_layout(batch, packed)
        values[packed] = layout.to_grid(engine.compute_token_values(layout))
    assert values[False].abs().sum() > 0
    torch.testing.assert_close(values[True], values[False], atol=1e-5, rtol=1e-5)
