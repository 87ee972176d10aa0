"""The experience producer on the driver: prompts -> agent -> scores, DAPO's group admission,
ReMax's baseline, the loader position, in lockstep and ahead (``max_staleness=1``). A
scripted single-turn policy stands in for the actor group."""

from __future__ import annotations

from collections.abc import Callable

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
from rlframe.core.protocol import Batch
from rlframe.data.loader import PromptLoader
from rlframe.data.prompts import PromptRecord
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer
from rlframe.rollout.rows import build_response

TOKENIZER = build_tiny_tokenizer()


DIGITS = torch.tensor(TOKENIZER.convert_tokens_to_ids(["0", "1"]))


def generate(prompts: Batch) -> Batch:
    """One token per row: greedy rows answer "1", sampled rows the parity of their seed."""
    picks = [1] * len(prompts) if prompts.meta.get("greedy") else [s % 2 for s in prompts["seed"]]
    return build_response([([int(DIGITS[p])], [-1.0], "stop") for p in picks], 0)


def answer_one(prompts: Batch) -> Batch:
    """Every row answers "1": every group's rewards are equal."""
    return build_response([([int(DIGITS[1])], [-1.0], "stop")] * len(prompts), 0)


EVEN = set(TOKENIZER.convert_tokens_to_ids(list("02468")))


def even_prompts_uniform(prompts: Batch) -> Batch:
    """Prompts "i+1=" with an even i answer "1" on every row (a uniform group); odd ones
    sample as :func:`generate` does."""
    picks = [
        1 if context[0] in EVEN else seed % 2
        for context, seed in zip(prompts["prompt_tokens"], prompts["seed"])
    ]
    return build_response([([int(DIGITS[p])], [-1.0], "stop") for p in picks], 0)


def read_digit(response: str, ground_truth: str, sample: dict) -> float:
    """The rule reward: the digit the scripted policy answered."""
    return float(response)


def make_producer(
    policy: Callable[[Batch], Batch] = generate, staleness: int = 0, **algorithm: object
) -> ExperienceProducer:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2, max_prompt_length=8),
        rollout=RolloutConfig(n=4, max_tokens=2, max_staleness=staleness),
        actor=ActorConfig(mini_batch_size=8, micro_batch_size=8),
        algorithm=AlgorithmConfig(**algorithm),
        reward=RewardConfig(fn="tests.unit.test_experience:read_digit", num_workers=0),
    )
    records = [
        PromptRecord(f"{i}+1=", TOKENIZER(f"{i}+1=")["input_ids"], str(i + 1), {}) for i in range(8)
    ]
    loader = PromptLoader(records, 2, seed=0)
    return ExperienceProducer(cfg, policy, TOKENIZER, loader, RewardStage(cfg, TOKENIZER))


def produce(producer: ExperienceProducer) -> tuple[Batch, dict[str, float]]:
    return producer.next_batch()


@pytest.mark.parametrize("staleness", [0, 1])
def test_dynamic_sampling_admits_a_prompt_per_dropped_group(staleness: int) -> None:
    """Half the prompts give uniform groups: each is dropped when it finishes and another
    prompt admitted, so a batch holds only groups that carry a signal, in every mode."""
    producer = make_producer(
        even_prompts_uniform, staleness, dynamic_sampling=True, max_sampling_rounds=4
    )
    dropped = 0.0
    for _ in range(3):
        batch, metrics = produce(producer)
        dropped += metrics["rollout/uniform_dropped"]
        assert len(batch) == 8
        groups = batch["group"].view(-1, 4)
        assert (groups == groups[:, :1]).all()  # whole groups, in rows of n
        assert all(bool((r != r[0]).any()) for r in batch["reward"].view(-1, 4))
        assert all(int(p[0]) % 2 == 1 for p in batch["prompt"])
    assert dropped >= 6  # one uniform group per informative one, or about
    # Every prompt drawn is admitted once: trained, dropped, or still in flight.
    assert producer.groups_served == 6 + dropped + len(producer.groups)


def test_dynamic_sampling_tops_up_with_uniform_groups_past_its_budget() -> None:
    """Two rounds' worth of prompts: the first two uniform groups are replaced, the next
    two are kept to fill the batch."""
    producer = make_producer(answer_one, dynamic_sampling=True, max_sampling_rounds=2)
    batch, metrics = produce(producer)
    assert batch["group"].tolist() == [2] * 4 + [3] * 4
    assert metrics["rollout/uniform_dropped"] == 2 and metrics["rollout/kept_group_frac"] == 0
    assert producer.groups_served == 4


@pytest.mark.parametrize("staleness", [0, 1])
def test_remax_baseline_is_the_greedy_reward_per_group(staleness: int) -> None:
    producer = make_producer(staleness=staleness, advantage="remax")
    for _ in range(2):
        batch, metrics = produce(producer)
        assert batch["baseline"].tolist() == [1.0] * 8
        assert "timing_s/baseline" in metrics and "timing_s/gen" in metrics
        assert "timing_s/reward" in metrics
        assert "rollout/uniform_dropped" not in metrics
    # Ahead (k=1), the first call ran both steps' groups.
    assert producer.groups_served == 4


def test_state_dict_resumes_the_prompt_stream() -> None:
    producer = make_producer()
    produce(producer)
    state = producer.state_dict()
    assert state["groups_served"] == 2 and state["groups"] == []
    expected = produce(producer)[0]
    resumed = make_producer()
    resumed.load_state_dict(state)
    batch = produce(resumed)[0]
    assert batch["seed"].tolist() == expected["seed"].tolist()
    assert list(batch["prompt"]) == list(expected["prompt"])


@pytest.mark.parametrize("staleness", [0, 1])
def test_close_stops_what_the_agent_started(staleness: int) -> None:
    """A resource an agent keeps in its context (the openai agent's server) is stopped with
    the producer, in every mode."""

    class Server:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    producer = make_producer(staleness=staleness)
    produce(producer)
    server = producer.context.resources["server"] = Server()
    producer.close()
    assert server.stopped
