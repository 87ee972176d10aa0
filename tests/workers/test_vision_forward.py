"""A vision-language model's training forward: packed rows with images (mrope positions,
vision tokens inside the packed sequence) give the log-probs and gradients of padded rows,
chunked through the LM head; ``model.freeze_vision`` keeps the vision tower out of the
update."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ModelConfig
from rlframe.core.sequence_layout import build_layout
from rlframe.core.train_batch import FORWARD
from tests.vision_rows import make_vision_batch
from tests.workers.layout_cases import gather_grads

pytestmark = pytest.mark.usefixtures("one_rank_group")


def build_engine(path: str, freeze_vision: bool = False):
    from workers.training.fsdp import FSDPEngine, OptimizerSpec

    return FSDPEngine(
        path,
        ModelConfig(path=path, freeze_vision=freeze_vision),
        OptimizerSpec(1e-3, 0.0, 1.0, 0, "constant", 1),
        "cpu",
    )


def logprobs_and_grads(path: str, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.model_hooks.vision import build_image_encoder

    engine = build_engine(path)
    batch = FORWARD.build(make_vision_batch(path, rows=6))
    images = build_image_encoder(path, engine.model.config)
    layout = build_layout(batch, packed, images.encode(batch))
    logprobs = layout.to_grid(
        engine.compute_token_logprobs(layout, 1.0, 4, with_entropy=False).logprobs
    )
    g = torch.Generator().manual_seed(5)
    (torch.randn(logprobs.shape, generator=g) * logprobs).sum().backward()
    return logprobs.detach(), gather_grads(engine.model)


def test_packed_rows_with_images_equal_padded_rows(vl_path: str) -> None:
    padded, padded_grads = logprobs_and_grads(vl_path, packed=False)
    packed, packed_grads = logprobs_and_grads(vl_path, packed=True)
    mask = make_vision_batch(vl_path, rows=6).tensor("loss_mask").bool()
    assert bool((padded[mask] < 0).all()) and bool((padded[~mask] == 0).all())
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_grads, padded_grads, atol=1e-5, rtol=1e-5)


def test_freeze_vision_keeps_the_tower_out_of_the_update_and_the_sync(vl_path: str) -> None:
    from workers.roles.train_role import pick_sync_tensors
    from workers.sync.weight_sync import iter_full_tensors

    engine = build_engine(vl_path, freeze_vision=True)
    frozen = {n for n, p in engine.model.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in f".{n}" for n in frozen)
    assert not any(
        ".visual." in f".{n}"
        for n, p in engine.model.named_parameters()
        if p in set(engine.trainable)
    )
    synced = [
        name for name, _ in pick_sync_tensors(ModelConfig(path=vl_path).lora, True)(engine.model)
    ]
    every = [name for name, _ in iter_full_tensors(engine.model)]
    # Engine names are the checkpoint's: Qwen2-VL saves its tower as ``visual.*``.
    assert synced == [n for n in every if not n.startswith("visual.")]
    assert len(synced) < len(every) and "lm_head.weight" in synced
