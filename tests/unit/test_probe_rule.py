"""The LoRA receiver check's rules (desk check item 5), on probe readings whose sizes are
those of bf16 on a GPU: a trainer-engine gap of about 0.1 nats with a heavy tail, and one
step at lr 1e-5 moving the probe by about 1e-3, far below that gap."""

from __future__ import annotations

import pytest
import torch

from workers.sync.sync_probe import (
    ProbeReading,
    StaleWeightsError,
    check_probe,
    derive_probe_tolerance,
)

TOKENS = 23


def make_readings() -> tuple[torch.Tensor, torch.Tensor]:
    """Trainer and engine probe log-probs with the same weights, the engine's off by bf16-like
    noise (one token in the tail at 0.3 nats)."""
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(TOKENS, generator=g) * 5
    noise = torch.randn(TOKENS, generator=g) * 0.03
    noise[7] = 0.3
    return trainer, trainer + noise


def test_tolerance_grows_with_the_measured_noise() -> None:
    trainer, engine = make_readings()
    tolerance = derive_probe_tolerance(engine - trainer, torch.bfloat16)
    assert tolerance == pytest.approx(4 * 0.3)
    # Quiet fp32 kernels keep the floor.
    assert derive_probe_tolerance(torch.full((TOKENS,), 1e-6), torch.float32) == 1e-3


def test_a_fresh_sync_with_heavy_tail_noise_passes() -> None:
    trainer, engine = make_readings()
    tolerance = derive_probe_tolerance(engine - trainer, torch.bfloat16)
    previous = ProbeReading(0, engine, trainer)
    step = torch.linspace(-1e-3, 1e-3, TOKENS)  # one small step moves both sides alike
    check_probe(engine + step, trainer + step, 1, previous, tolerance, "adapter rlframe-1")


def test_a_stale_adapter_after_a_small_step_is_caught() -> None:
    trainer, engine = make_readings()
    tolerance = derive_probe_tolerance(engine - trainer, torch.bfloat16)
    previous = ProbeReading(1, engine, trainer)
    moved = trainer + torch.linspace(-1e-3, 1e-3, TOKENS)
    # The engine still serves version 1: its reading repeats, the trainer's moved 1e-3,
    # which is far inside the tolerance.
    with pytest.raises(StaleWeightsError, match=r"adapter rlframe-2.*equal version 1's"):
        check_probe(engine.clone(), moved, 2, previous, tolerance, "adapter rlframe-2")


def test_weights_that_did_not_change_are_not_stale() -> None:
    # A bf16 step below the weights' rounding changes neither side's reading.
    trainer, engine = make_readings()
    tolerance = derive_probe_tolerance(engine - trainer, torch.bfloat16)
    previous = ProbeReading(1, engine, trainer)
    check_probe(engine.clone(), trainer.clone(), 2, previous, tolerance, "merged weights")


def test_a_gap_over_the_tolerance_is_a_broken_sync() -> None:
    trainer, engine = make_readings()
    previous = ProbeReading(1, engine, trainer)
    with pytest.raises(StaleWeightsError, match="is broken"):
        check_probe(engine + 2.0, trainer + 0.01, 2, previous, 1.2, "merged weights")
