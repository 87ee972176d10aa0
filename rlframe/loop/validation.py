"""Validation: sample held-out prompts with the current policy and score them.

Metrics (all under ``val/``): ``reward/mean``, ``score/mean``, ``response_length/mean``,
``pass@k`` for k = 1, 2, 4, ... up to ``val.n`` (the unbiased estimator of Chen et al.,
2021), and the same per ``data_source`` when the prompts carry that column.

Masked samples (their reward or env failed under ``on_error=mask``) are in none of them: a
prompt's pass@k is estimated from its samples that count, and prompts with fewer than k of
them are left out of pass@k's mean; ``val/masked`` is their fraction when there are some.
"""

from __future__ import annotations

from collections.abc import Callable
from math import comb

import torch

from rlframe.config import Config
from rlframe.core.protocol import Batch, read_sample_mask
from rlframe.core.tokenizer import Tokenizer, read_eos_id, read_pad_id
from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import PromptRecord
from rlframe.rewards.stage import RewardStage

# Validation samples get seeds from their own stream, apart from the training groups'.
VAL_SEED_OFFSET = 1_000_003


def estimate_pass_at_k(n: int, correct: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), given
    ``correct`` of the n are: 1 - C(n - c, k) / C(n, k). Unbiased, unlike 1 - (1 - c/n)^k."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - correct < k:
        return 1.0
    return 1.0 - comb(n - correct, k) / comb(n, k)


def list_pass_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def compute_validation_metrics(
    scores: torch.Tensor,
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    n: int,
    threshold: float,
    sources: list[str] | None = None,
    counted: torch.Tensor | None = None,
) -> dict[str, float]:
    """Metrics over prompts of ``n`` consecutive responses each (the layout of
    :func:`build_prompt_batch`), overall and per source, over the responses ``counted``
    (bool; all when None: masked ones are left out)."""
    if counted is None:
        counted = torch.ones(len(scores), dtype=torch.bool)
    metrics = summarise(scores, rewards, lengths, counted, n, threshold, "val/")
    if sources is not None:
        for source in sorted(set(sources[::n])):
            rows = torch.tensor([s == source for s in sources])
            metrics |= summarise(
                scores[rows],
                rewards[rows],
                lengths[rows],
                counted[rows],
                n,
                threshold,
                f"val/{source}/",
            )
    return metrics


def summarise(
    scores: torch.Tensor,
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    counted: torch.Tensor,
    n: int,
    threshold: float,
    prefix: str,
) -> dict[str, float]:
    # A step where no response counts reports all of them (masked ones score 0).
    rows = counted if counted.any() else torch.ones_like(counted)
    per_prompt = rows.view(-1, n).sum(1).tolist()
    correct = ((scores >= threshold) & rows).view(-1, n).sum(1).tolist()
    metrics = {
        f"{prefix}reward/mean": float(rewards[rows].float().mean()),
        f"{prefix}score/mean": float(scores[rows].float().mean()),
        f"{prefix}response_length/mean": float(lengths[rows].float().mean()),
    }
    if not counted.all():
        metrics[f"{prefix}masked"] = float((~counted).float().mean())
    for k in list_pass_ks(n):
        estimates = [
            estimate_pass_at_k(m, c, k) for m, c in zip(per_prompt, correct, strict=True) if m >= k
        ]
        if estimates:
            metrics[f"{prefix}pass@{k}"] = sum(estimates) / len(estimates)
    return metrics


def split_validation_records(
    records: list[PromptRecord], cfg: Config, tokenizer: Tokenizer
) -> tuple[list[PromptRecord], list[PromptRecord] | None]:
    """(training prompts, validation prompts or None when validation is off).

    Validation prompts come from ``data.val_files``, or for a synthetic task are the last
    ``data.val_size`` prompts, then held out of training.
    """
    from rlframe.data.prompts import load_prompt_records

    t, d = cfg.trainer, cfg.data
    if t.val_every == 0 and not t.val_before_train:
        return records, None
    if d.val_files:
        return records, load_prompt_records(
            d.val_files, d.task, tokenizer, d.max_prompt_length, t.seed
        )
    if len(records) - d.val_size < d.batch_size:
        raise ValueError(
            f"data.val_size={d.val_size} leaves fewer than data.batch_size prompts to train on"
        )
    return records[: -d.val_size], records[-d.val_size :]


class Validator:
    """Holds the validation prompts; :meth:`run` samples and rewards them. Its batches never
    enter training: they go through the producer's ``generate`` and the reward stage only.

    Args:
        records: validation prompts.
        cfg: the run's config (``val.*``, ``trainer.seed``).
        tokenizer: for the pad and EOS ids.
        generate: prompt rows -> the rows with their responses (the producer's agent).
        rewards: the reward stage (adds ``score`` and ``reward``).
    """

    def __init__(
        self,
        records: list[PromptRecord],
        cfg: Config,
        tokenizer: Tokenizer,
        generate: Callable[[Batch], Batch],
        rewards: RewardStage,
    ) -> None:
        self.cfg, self.generate, self.rewards = cfg, generate, rewards
        self.prompts = build_prompt_batch(
            records, cfg.val.n, 0, read_pad_id(tokenizer), cfg.trainer.seed + VAL_SEED_OFFSET
        )
        self.prompts.meta |= {
            "stop_token_ids": [read_eos_id(tokenizer)],
            "pad_token_id": read_pad_id(tokenizer),
            "temperature": cfg.val.temperature,
        }
        extras = list(self.prompts.column("extra"))
        has_source = all("data_source" in e for e in extras)
        self.sources = [str(e["data_source"]) for e in extras] if has_source else None

    def run(self) -> dict[str, float]:
        """Sample and reward the validation prompts with the current weights; ``val/*`` metrics."""
        batch = self.rewards.compute_rewards(self.generate(self.prompts))
        return compute_validation_metrics(
            batch.tensor("score"),
            batch.tensor("reward"),
            batch.tensor("loss_mask").sum(1),
            self.cfg.val.n,
            self.cfg.val.pass_threshold,
            self.sources,
            read_sample_mask(batch),
        )
