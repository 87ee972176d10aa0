"""The receiver check of a weight sync: after a sync the rollout engine's log-probs of a
fixed probe sequence must match the trainer's, and must have moved when the trainer's did.

A sync that silently leaves the engine on the previous weights (an adapter never
registered, a request still naming the old adapter, a name the loader skipped) shows up
here as the engine still giving the previous version's log-probs, and the run stops with
an error that says so, instead of training on a policy that never changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PROBE_LENGTH = 24
PROBE_SEED = 20260519


def build_probe_ids(
    vocab_size: int, excluded: list[int] | None = None, length: int = PROBE_LENGTH
) -> list[int]:
    """The fixed probe: token ids drawn once from a seeded generator (the same on every rank
    and in every process), never from a tokenizer, so any model can be probed. ``excluded``
    ids are never drawn: a vision-language model's image tokens, which need an image.
    ``length``: at most :data:`PROBE_LENGTH`, fewer where the engine's context is shorter."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    allowed = torch.tensor([i for i in range(vocab_size) if i not in set(excluded or [])])
    return allowed[torch.randint(0, len(allowed), (length,), generator=g)].tolist()


VISION_TOKEN_KEYS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def list_vision_token_ids(config: object) -> list[int]:
    """The special vision tokens of a vision-language model's config ([] for a text model)."""
    ids = (getattr(config, key, None) for key in VISION_TOKEN_KEYS)
    return [int(i) for i in ids if i is not None]


def pick_probe_tolerance(dtype: torch.dtype) -> float:
    """The smallest trainer-engine gap of one probe token's log-prob that may count as the
    same weights: fp32 kernels agree to about 1e-5 (sdpa vs vLLM's attention), bf16 to about
    1e-2. Also the tolerance until noise is measured (:func:`derive_probe_tolerance`)."""
    return 1e-3 if dtype == torch.float32 else 0.1


NOISE_FACTOR = 4.0
"""Tolerance over the largest trainer-engine gap measured with the same weights: bf16 gaps
have a heavy tail and move with the weights (TRL #6789: p95 0.11, max 0.48 nats)."""
STILL_NATS = 1e-6
"""An engine that serves the same weights gives the same probe log-probs to within this."""
MOVED_NATS = 1e-5
"""A trainer probe that moved more than this was computed with other weights."""
MEAN_NOISE_FACTOR = 5.0
"""Tolerance of the probe's mean gap over the mean gap measured with the same weights. The
mean is steadier than the largest token's gap: bf16 on the tiny MoE model on CPU, 1.3e-3 with
the same weights and at most 3.8e-3 over 12 honest syncs, while two swapped experts give
0.015 and a sync lost for one step 0.023 (docs/running.md, "The sync check")."""


def pick_mean_floor(dtype: torch.dtype) -> float:
    """The part of the probe's (and the token check's) tolerance of a mean gap that the
    calibration never lowers: kernel noise that one reading may miss."""
    return 1e-3


def derive_probe_tolerance(noise: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest gap that still counts as the same weights, from ``noise``: the engine's
    probe log-probs minus the trainer's while both hold the same weights by construction
    (the checkpoint, before any update); never below the dtype's floor."""
    return max(pick_probe_tolerance(dtype), NOISE_FACTOR * float(noise.abs().max()))


def derive_mean_tolerance(noise: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest mean gap over the probe's tokens that still counts as the same weights: a
    multiple of the one measured with the same weights, plus the dtype's floor."""
    return MEAN_NOISE_FACTOR * float(noise.abs().mean()) + pick_mean_floor(dtype)


@torch.no_grad()
def compute_trainer_probe(model: nn.Module, ids: list[int], device: str) -> torch.Tensor:
    """[len(ids) - 1] log-probs of ``ids[1:]`` under the training model (temperature 1, eval
    mode: no adapter dropout). A forward of the FSDP root: a collective on every rank."""
    model.eval()
    tokens = torch.tensor([ids], device=device)
    logits = model(input_ids=tokens, use_cache=False).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, tokens[0, 1:, None])[:, 0].cpu()


@dataclass
class ProbeReading:
    """Both sides' probe log-probs at one weights version."""

    version: int
    logprobs: torch.Tensor
    """The engine's."""
    trainer: torch.Tensor
    """The trainer's."""


@dataclass
class SyncProbe:
    """What the trainer hands the receiver with a sync: the probe and its log-probs."""

    ids: list[int]
    logprobs: torch.Tensor


class StaleWeightsError(RuntimeError):
    """The rollout engine does not serve the weights the trainer just synced."""


@dataclass(frozen=True)
class ProbeVerdict:
    """The receiver check of one sync, as the driver reads it (``rollout/sync_check``)."""

    version: int
    ratio: float
    """The probe's gaps over their tolerances, the larger (above 1: the check fails)."""
    error: str | None
    """Why the sync is stale or broken; None when it passed."""


def judge_probe(
    engine: torch.Tensor,
    trainer: torch.Tensor,
    version: int,
    previous: ProbeReading | None,
    tolerance: float,
    served: str,
    mean_tolerance: float | None = None,
) -> ProbeVerdict:
    """Whether the engine's probe log-probs match the trainer's.

    ``served`` names what the engine serves (``adapter rlframe-v3 (id 3)``, ``merged
    weights``), so that the error names the stale adapter. Three rules:

    - stale: the trainer's reading moved since ``previous`` and the engine's did not. This
      needs no tolerance (an engine repeats its reading for the same weights), so one step
      at a small learning rate, far below the bf16 trainer-engine gap, is still seen.
    - broken: the engine and the trainer disagree on a token by more than ``tolerance``,
      or on average over the probe by more than ``mean_tolerance`` (when given).
    """
    gaps = (engine - trainer).abs()
    gap, mean = float(gaps.max()), float(gaps.mean())
    ratio = gap / tolerance
    if mean_tolerance is not None:
        ratio = max(ratio, mean / mean_tolerance)
    if previous is not None:
        engine_moved = float((engine - previous.logprobs).abs().max())
        trainer_moved = float((trainer - previous.trainer).abs().max())
        if engine_moved <= STILL_NATS < MOVED_NATS < trainer_moved or (
            gap > tolerance and engine_moved <= tolerance
        ):
            return ProbeVerdict(
                version,
                ratio,
                f"stale weights after the sync of version {version}: the rollout engine "
                f"serves {served}, whose probe log-probs equal version {previous.version}'s "
                f"(moved {engine_moved:.3g}), while the trainer's moved {trainer_moved:.3g} "
                f"(max gap {gap:.3g}, tolerance {tolerance:.3g})",
            )
    if ratio <= 1:
        return ProbeVerdict(version, ratio, None)
    bound = f"up to {gap:.3g} (> {tolerance:.3g})"
    if mean_tolerance is not None and mean > mean_tolerance:
        bound = f"{mean:.3g} on average (> {mean_tolerance:.3g})"
    return ProbeVerdict(
        version,
        ratio,
        f"weight sync of version {version} is broken: the rollout engine ({served}) and the "
        f"trainer disagree on the probe log-probs by {bound}",
    )


def check_probe(
    engine: torch.Tensor,
    trainer: torch.Tensor,
    version: int,
    previous: ProbeReading | None,
    tolerance: float,
    served: str,
    mean_tolerance: float | None = None,
) -> None:
    """Raise StaleWeightsError unless :func:`judge_probe` passes the sync."""
    verdict = judge_probe(engine, trainer, version, previous, tolerance, served, mean_tolerance)
    if verdict.error is not None:
        raise StaleWeightsError(verdict.error)
