"""The learning-rate schedule: linear warm-up, then constant or cosine decay to 10%."""

from __future__ import annotations

import math

import pytest
import torch

from workers.training.fsdp import OptimizerSpec, build_lr_lambda


def spec(schedule: str, warmup: int, total: int) -> OptimizerSpec:
    return OptimizerSpec(
        lr=1e-3,
        weight_decay=0.0,
        grad_clip=1.0,
        warmup_steps=warmup,
        lr_schedule=schedule,
        total_steps=total,
    )


def test_warmup_then_cosine_to_a_tenth() -> None:
    factor = build_lr_lambda(spec("cosine", warmup=4, total=14))
    # Warm-up: (step + 1) / 4, reaching the peak on the last warm-up step.
    assert [factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # Then 0.1 + 0.9 * (1 + cos(pi * progress)) / 2 over the 10 remaining steps.
    assert factor(4) == pytest.approx(1.0)
    assert factor(6) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.2)))
    assert factor(9) == pytest.approx(0.55)
    assert factor(14) == pytest.approx(0.1)
    assert factor(40) == pytest.approx(0.1)  # past the planned end it stays at the floor
    values = [factor(s) for s in range(4, 15)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_warmup_then_constant() -> None:
    factor = build_lr_lambda(spec("constant", warmup=2, total=10))
    assert [factor(s) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert build_lr_lambda(spec("constant", warmup=0, total=10))(0) == 1.0


def test_schedule_drives_the_optimizer_learning_rate() -> None:
    """The factor is applied by LambdaLR as the engine builds it: lr after k scheduler steps."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, build_lr_lambda(spec("cosine", warmup=2, total=6))
    )
    seen = []
    for _ in range(7):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [
        5e-4,
        1e-3,
        1e-3,
        1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))),
        5.5e-4,
        1e-3 * (0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))),
        1e-4,
    ]
    assert seen == pytest.approx(expected)
