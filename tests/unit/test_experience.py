"""The experience producer on the driver: prompts -> agent -> scores, DAPO rounds, ReMax
baseline, the loader position. A scripted single-turn policy stands in for the actor group."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
)
from rlframe.data.loader import PromptLoader
from rlframe.data.prompts import PromptRecord
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.protocol import Batch
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer
from rlframe.rollout.rows import build_response

TOKENIZER = build_tiny_tokenizer()


DIGITS = torch.tensor(TOKENIZER.convert_tokens_to_ids(["0", "1"]))


def generate(prompts: Batch) -> Batch:
    """One token per row: greedy rows answer "1", sampled rows the parity of their seed."""
    picks = [1] * len(prompts) if prompts.meta.get("greedy") else [s % 2 for s in prompts["seed"]]
    return build_response([([int(DIGITS[p])], [-1.0], "stop") for p in picks], 0)


def read_digit(response: str, ground_truth: str, sample: dict) -> float:
    """The rule reward: the digit the scripted policy answered."""
    return float(response)


def make_producer(**algorithm: object) -> ExperienceProducer:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2, max_prompt_length=8),
        rollout=RolloutConfig(n=4, max_tokens=2),
        actor=ActorConfig(mini_batch_size=8, micro_batch_size=8),
        algorithm=AlgorithmConfig(**algorithm),
        reward=RewardConfig(fn="tests.unit.test_experience:read_digit", num_workers=0),
    )
    records = [
        PromptRecord(f"{i}+1=", TOKENIZER(f"{i}+1=")["input_ids"], str(i + 1), {}) for i in range(8)
    ]
    loader = PromptLoader(records, 2, seed=0)
    return ExperienceProducer(cfg, generate, TOKENIZER, loader, RewardStage(cfg, TOKENIZER))


def produce(producer: ExperienceProducer) -> tuple[Batch, dict[str, float]]:
    producer.submit()
    return producer.collect()


def test_dynamic_sampling_rounds_and_the_loader_position() -> None:
    producer = make_producer(dynamic_sampling=True, max_sampling_rounds=4)
    batch, metrics = produce(producer)
    rounds = metrics["rollout/sampling_rounds"]
    assert len(batch) == 8 and 1 <= rounds <= 4
    assert producer.groups_served == 2 * rounds  # every round drew a fresh batch of prompts
    groups = batch["group"].view(-1, 4)
    assert (groups == groups[:, :1]).all()  # whole groups, in rows of n
    informative = [bool((r != r[0]).any()) for r in batch["reward"].view(-1, 4)]
    assert informative == sorted(informative, reverse=True)  # informative groups first


def test_remax_baseline_is_the_greedy_reward_per_group() -> None:
    producer = make_producer(advantage="remax")
    batch, metrics = produce(producer)
    assert batch["baseline"].tolist() == [1.0] * 8
    assert "timing_s/baseline" in metrics and "timing_s/gen" in metrics
    assert "timing_s/reward" in metrics
    assert "rollout/sampling_rounds" not in metrics and producer.groups_served == 2


def test_submitted_batches_are_collected_in_order() -> None:
    """Submitting step t+1 before collecting step t (one step off) keeps the steps apart."""
    ahead, lockstep = make_producer(), make_producer()
    ahead.submit()
    ahead.submit()
    first, second = ahead.collect()[0], ahead.collect()[0]
    assert first["seed"].tolist() == produce(lockstep)[0]["seed"].tolist()
    assert second["seed"].tolist() == produce(lockstep)[0]["seed"].tolist()
    assert first["seed"].tolist() != second["seed"].tolist()
    with pytest.raises(RuntimeError, match="without a submit"):
        ahead.collect()


def test_state_dict_resumes_the_prompt_stream() -> None:
    producer = make_producer()
    produce(producer)
    state = producer.state_dict()
    assert state["groups_served"] == 2
    expected = produce(producer)[0]
    resumed = make_producer()
    resumed.load_state_dict(state)
    batch = produce(resumed)[0]
    assert batch["seed"].tolist() == expected["seed"].tolist()
    assert list(batch["prompt"]) == list(expected["prompt"])
    producer.submit()
    with pytest.raises(RuntimeError, match="not collected"):
        producer.state_dict()
