"""Validation: prompts held out of training, the Validator's sampling settings, and its
metrics by value (score and reward apart, per data_source, pass@k)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlframe.config import Config, DataConfig, ModelConfig, TrainerConfig, ValConfig
from rlframe.core.protocol import Batch
from rlframe.data.prompts import PromptRecord
from rlframe.loop.validation import (
    VAL_SEED_OFFSET,
    Validator,
    compute_validation_metrics,
    estimate_pass_at_k,
    list_pass_ks,
    split_validation_records,
)


class CharTokenizer:
    pad_token_id, eos_token_id = 0, 1


def make_records(count: int, source: str | None = None) -> list[PromptRecord]:
    extra = {} if source is None else {"data_source": source}
    return [
        PromptRecord(f"p{i}", [5 + i % 7, 3 + i % 5], str(i), dict(extra)) for i in range(count)
    ]


def make_config(tmp_path: Path, val: ValConfig | None = None, **kw: object) -> Config:
    data = {k: kw.pop(k) for k in ("val_size", "val_files", "batch_size") if k in kw}
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(**data),
        val=val or ValConfig(),
        trainer=TrainerConfig(output_dir=str(tmp_path / "run"), **kw),
    )


def test_synthetic_validation_prompts_are_the_last_ones_and_held_out(tmp_path: Path) -> None:
    records = make_records(40)
    cfg = make_config(tmp_path, val_every=5, val_size=8)
    train, val = split_validation_records(records, cfg, CharTokenizer())
    assert val is not None
    assert [r.prompt for r in val] == [f"p{i}" for i in range(32, 40)]
    assert [r.prompt for r in train] == [f"p{i}" for i in range(32)]
    # val_before_train alone turns validation on too.
    cfg = make_config(tmp_path, val_before_train=True, val_size=8)
    train, val = split_validation_records(records, cfg, CharTokenizer())
    assert val is not None and len(val) == 8 and len(train) == 32


def test_no_validation_keeps_every_prompt_for_training(tmp_path: Path) -> None:
    records = make_records(40)
    train, val = split_validation_records(records, make_config(tmp_path), CharTokenizer())
    assert val is None and train == records


def test_a_split_that_leaves_too_few_training_prompts_is_refused(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, val_every=1, val_size=33)  # data.batch_size 8
    with pytest.raises(ValueError, match="data.val_size=33"):
        split_validation_records(make_records(40), cfg, CharTokenizer())
    # Exactly batch_size left over is enough.
    cfg = make_config(tmp_path, val_every=1, val_size=32)
    train, _ = split_validation_records(make_records(40), cfg, CharTokenizer())
    assert len(train) == 8


def test_preflight_hands_the_run_training_prompts_without_the_validation_ones(
    tmp_path: Path,
) -> None:
    from rlframe.run.preflight import check_run_inputs, load_training_prompts

    cfg = make_config(tmp_path, val_every=2, val_size=16)
    inputs = check_run_inputs(cfg)
    everything = load_training_prompts(cfg, inputs.tokenizer)
    assert inputs.val_records is not None and len(inputs.val_records) == 16
    assert inputs.records == everything[:-16] and inputs.val_records == everything[-16:]


def run_validator(cfg: Config, records: list[PromptRecord], scores: list[float]) -> dict:
    seen: dict[str, Batch] = {}

    def generate(prompts: Batch) -> Batch:
        seen["prompts"] = prompts
        lengths = torch.arange(len(prompts)) % 3 + 1
        mask = (torch.arange(4)[None] < lengths[:, None]).float()
        return prompts.with_tensors(response_mask=mask, loss_mask=mask)

    def score(batch: Batch) -> Batch:
        s = torch.tensor(scores)
        # The reward differs from the score (as with a penalty or a reward model added).
        return batch.with_tensors(score=s, reward=s * 10 - 1)

    metrics = validator_metrics = Validator(
        records, cfg, CharTokenizer(), generate, SimpleNamespace(compute_rewards=score)
    ).run()
    validator_metrics["_prompts"] = seen["prompts"]  # type: ignore[assignment]
    return metrics


def test_validator_samples_greedy_by_default_with_its_own_seeds(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, val_every=1, seed=3)
    records = make_records(2)
    metrics = run_validator(cfg, records, [1.0, 0.0])
    prompts = metrics.pop("_prompts")
    assert prompts.meta["temperature"] == 0.0
    assert prompts.meta["stop_token_ids"] == [1] and prompts.meta["pad_token_id"] == 0
    assert len(prompts) == 2 and prompts["group"].tolist() == [0, 1]
    assert list(prompts["seed"]) == [hash((3 + VAL_SEED_OFFSET, g, 0)) & 0x7FFFFFFF for g in (0, 1)]
    assert VAL_SEED_OFFSET > 0
    hot = make_config(tmp_path, val=ValConfig(n=4, temperature=1.0), val_every=1)
    prompts = run_validator(hot, records, [1.0] * 8).pop("_prompts")
    assert prompts.meta["temperature"] == 1.0 and len(prompts) == 8


def test_validator_reports_score_and_reward_apart_and_per_source(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, val=ValConfig(n=2, pass_threshold=0.5), val_every=1)
    records = make_records(2, "gsm8k") + make_records(1, "math")
    # Rows: prompt 0 (gsm8k) 1.0, 0.0; prompt 1 (gsm8k) 0.25, 0.25; prompt 2 (math) 0.5, 0.75.
    scores = [1.0, 0.0, 0.25, 0.25, 0.5, 0.75]
    metrics = run_validator(cfg, records, scores)
    metrics.pop("_prompts")
    lengths = [1, 2, 3, 1, 2, 3]
    expected = {
        "val/score/mean": sum(scores) / 6,
        "val/reward/mean": sum(s * 10 - 1 for s in scores) / 6,
        "val/response_length/mean": sum(lengths) / 6,
        # c = 1, 0, 2 right (score >= 0.5) of n = 2: pass@1 = (0.5 + 0 + 1) / 3; pass@2 = 2 / 3.
        "val/pass@1": 0.5,
        "val/pass@2": 2 / 3,
        "val/gsm8k/score/mean": 1.5 / 4,
        "val/gsm8k/reward/mean": (1.5 * 10 - 4) / 4,
        "val/gsm8k/response_length/mean": 7 / 4,
        "val/gsm8k/pass@1": 0.25,
        "val/gsm8k/pass@2": 0.5,
        "val/math/score/mean": 0.625,
        "val/math/reward/mean": 5.25,
        "val/math/response_length/mean": 2.5,
        "val/math/pass@1": 1.0,
        "val/math/pass@2": 1.0,
    }
    assert metrics == pytest.approx(expected)


def test_pass_at_k_and_the_ks_reported() -> None:
    assert list_pass_ks(1) == [1] and list_pass_ks(2) == [1, 2]
    assert list_pass_ks(5) == [1, 2, 4, 5] and list_pass_ks(8) == [1, 2, 4, 8]
    # n = 5, c = 2: pass@2 = 1 - C(3,2)/C(5,2) = 0.7; c = 4: n - c < k -> 1.
    assert estimate_pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert estimate_pass_at_k(5, 3, 2) == pytest.approx(0.9)
    assert estimate_pass_at_k(5, 4, 2) == 1.0 and estimate_pass_at_k(5, 0, 2) == 0.0
    assert estimate_pass_at_k(2, 1, 2) == 1.0
    with pytest.raises(ValueError, match="pass@3 needs at least 3"):
        estimate_pass_at_k(2, 1, 3)


def test_threshold_is_inclusive() -> None:
    scores = torch.tensor([1.0, 0.999])
    metrics = compute_validation_metrics(scores, scores, torch.ones(2), 1, 1.0)
    assert metrics["val/pass@1"] == 0.5


def test_response_length_counts_sampled_tokens_not_observations(tmp_path: Path) -> None:
    """A multi-turn response: turn (2) | observation (3) | turn (1). Its length is the 3
    tokens the policy sampled (loss mask), not the 6 of the whole response."""
    cfg = make_config(tmp_path, val_every=1)
    turns = torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]])

    def generate(prompts: Batch) -> Batch:
        whole = torch.tensor([[1.0] * 6 + [0.0]])
        return prompts.with_tensors(response_mask=whole, loss_mask=turns)

    def score(batch: Batch) -> Batch:
        return batch.with_tensors(score=torch.ones(1), reward=torch.ones(1))

    validator = Validator(
        make_records(1), cfg, CharTokenizer(), generate, SimpleNamespace(compute_rewards=score)
    )
    assert validator.run()["val/response_length/mean"] == 3.0
