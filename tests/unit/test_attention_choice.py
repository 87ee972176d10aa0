"""Which attention kernel a model is loaded with, by device and compute dtype: flash-attn
runs bf16/fp16 only, so an fp32 model on CUDA must get sdpa (desk check item 2)."""

from __future__ import annotations

import pytest
import torch

from workers.training.model_build import choose_attention, pick_dtype


@pytest.mark.parametrize(
    ("device", "setting", "expected"),
    [
        ("cuda", "auto", "flash_attention_2"),
        ("cuda", "bfloat16", "flash_attention_2"),
        ("cuda", "float32", "sdpa"),
        ("cpu", "bfloat16", "sdpa"),
        ("cpu", "auto", "sdpa"),
    ],
)
def test_flash_attention_only_for_half_precision_on_cuda(
    device: str, setting: str, expected: str
) -> None:
    dtype = pick_dtype(setting, device)
    assert choose_attention(device, dtype, has_flash_attn=True) == expected


def test_no_flash_attention_without_the_package() -> None:
    assert choose_attention("cuda", torch.bfloat16, has_flash_attn=False) == "sdpa"
