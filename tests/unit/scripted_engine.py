"""A scripted engine in place of the rollout group, for the experience producer's tests
(tests/unit/test_async_producer.py, tests/ray/test_async_failures.py): it answers "1" until
prompt + response reach ``TOTAL`` tokens, then EOS, so short prompts give long responses (a
long tail), and stamps the weights version the test says the engine holds."""

from __future__ import annotations

from typing import Any

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
ONE = TOKENIZER.convert_tokens_to_ids("1")
TOTAL = 14
MAX_TOKENS = 12


class Engine:
    """Scripted generation with a weights version; counts the rows it ran."""

    def __init__(self) -> None:
        self.version = 0
        self.rows = 0

    def generate(self, prompts: Batch) -> Batch:
        self.rows += len(prompts)
        caps = prompts["max_tokens"].tolist() if "max_tokens" in prompts else None
        turns = []
        for i, context in enumerate(prompts["prompt_tokens"]):
            wanted = max(1, TOTAL - len(context))
            n = min(wanted, caps[i] if caps else MAX_TOKENS)
            ids = [ONE] * n
            if n == wanted:
                ids[-1] = TOKENIZER.eos_token_id
            turns.append((ids, [-0.5] * n, "stop" if n == wanted else "length"))
        return build_response(turns, self.version, {"engine_s": 0.0})


def count_ones(response: str, ground_truth: str, sample: dict) -> float:
    return float(len(response) > 4)


def make_producer(
    engine: Engine, k: int, chunk: int, mode: str = "wait", overlap: bool = False, **algorithm: Any
) -> ExperienceProducer:
    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=2, max_prompt_length=12),
        rollout=RolloutConfig(
            n=2,
            max_tokens=MAX_TOKENS,
            max_staleness=k,
            partial_chunk_tokens=chunk,
            stale_groups=mode,
        ),
        actor=ActorConfig(mini_batch_size=4, micro_batch_size=4),
        algorithm=AlgorithmConfig(**algorithm),
        reward=RewardConfig(fn="tests.unit.scripted_engine:count_ones", num_workers=0),
    )
    # Prompts of 2 to 11 tokens: responses of 12 down to 3 tokens.
    texts = ["1" * (i % 10 + 2) for i in range(10)]
    records = [PromptRecord(t, TOKENIZER(t)["input_ids"], "", {}) for t in texts]
    loader = PromptLoader(records, 2, seed=0)
    rewards = RewardStage(cfg, TOKENIZER)
    return ExperienceProducer(cfg, engine.generate, TOKENIZER, loader, rewards, overlap)


def run_steps(producer: ExperienceProducer, engine: Engine, steps: int) -> list[tuple[Batch, dict]]:
    """Collect, then 'update and sync' (the engine's version goes up by one)."""

    def sync() -> int:
        engine.version += 1
        return engine.version

    synced = producer.track_sync(sync)
    out = []
    for _ in range(steps):
        out.append(producer.next_batch())
        synced()
    return out
