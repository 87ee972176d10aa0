"""A scripted engine in place of the rollout group, for the experience producer's tests
(tests/unit/test_async_producer.py, tests/ray/test_async_failures.py): it answers "1" until
prompt + response reach ``TOTAL`` tokens, then EOS, so short prompts give long responses (a
long tail), and stamps the weights version the test says the engine holds. It keeps every
request it was sent; with ``routing`` it also answers each row's routed experts, as an engine
under ``algorithm.router_replay=rollout`` does."""

from __future__ import annotations

import threading
import time
from typing import Any

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
from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.data.loader import PromptLoader
from rlframe.data.prompts import PromptRecord
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.rewards.stage import RewardStage
from rlframe.rollout import ExperienceProducer
from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.rows import build_response
from rlframe.rollout.turns import ABORTED, TurnRequest, TurnResult

TOKENIZER = build_tiny_tokenizer()
ONE = TOKENIZER.convert_tokens_to_ids("1")
TOTAL = 14
MAX_TOKENS = 12


class Engine:
    """Scripted generation with a weights version; counts the rows it ran and keeps the
    requests."""

    def __init__(self, routing: bool = False) -> None:
        self.version = 0
        self.rows = 0
        self.routing = routing
        self.requests: list[Batch] = []

    def generate(self, prompts: Batch) -> Batch:
        self.rows += len(prompts)
        self.requests.append(prompts)
        caps = prompts["max_tokens"].tolist() if "max_tokens" in prompts else None
        turns = []
        for i, context in enumerate(prompts["prompt_tokens"]):
            wanted = max(1, TOTAL - len(context))
            n = min(wanted, caps[i] if caps else MAX_TOKENS)
            ids = [ONE] * n
            if n == wanted:
                ids[-1] = TOKENIZER.eos_token_id
            turns.append((ids, [-0.5] * n, "stop" if n == wanted else "length"))
        out = build_response(turns, self.version, {"engine_s": 0.0})
        if not self.routing:
            return out
        fed = [len(c) + len(t[0]) - 1 for c, t in zip(prompts["prompt_tokens"], turns)]
        routing = [route_tokens(n, self.version) for n in fed]
        return Batch(out.tensors, out.columns | {ROUTED_EXPERTS: routing}, out.meta)


class StreamEngine:
    """The scripted engine as a replica of the request stream (``EngineClient``'s ``serve``):
    one token per running request a call, the same answers as :class:`Engine`; ``abort``
    ends every running request with its tokens so far. While :attr:`gate` is clear no
    request moves (a call returns nothing), so a test holds requests in flight."""

    def __init__(self) -> None:
        self.version = 0
        self.running: dict[str, tuple[TurnRequest, list[int]]] = {}
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, requests: list[TurnRequest]) -> list[TurnResult]:
        for r in requests:
            self.running[r.request_id] = (r, [])
        if not self.gate.is_set():
            time.sleep(0.002)  # the pump calls again at once: no busy loop while held
            return []
        done = []
        for rid, (r, ids) in list(self.running.items()):
            wanted = max(1, TOTAL - len(r.context))
            ids.append(TOKENIZER.eos_token_id if len(ids) + 1 == wanted else ONE)
            if ids[-1] == TOKENIZER.eos_token_id or len(ids) == r.max_tokens:
                reason = "stop" if ids[-1] == TOKENIZER.eos_token_id else "length"
                done.append(self.result(rid, ids, reason))
                del self.running[rid]
        return done

    def abort(self) -> list[TurnResult]:
        out = [self.result(rid, ids, ABORTED) for rid, (_, ids) in self.running.items()]
        self.running = {}
        return out

    def result(self, request_id: str, ids: list[int], reason: str) -> TurnResult:
        return TurnResult(request_id, list(ids), [-0.5] * len(ids), reason, self.version)


def route_tokens(tokens: int, version: int) -> torch.Tensor:
    """Made-up routed experts of ``tokens`` fed tokens: [tokens, 2 layers, top 2], int16,
    different per position and weights version."""
    at = torch.arange(tokens * 4, dtype=torch.int16).view(tokens, 2, 2)
    return (at + version) % 7


def count_ones(response: str, ground_truth: str, sample: dict) -> float:
    return float(len(response) > 4)


def make_producer(
    engine: Engine,
    k: int,
    chunk: int,
    mode: str = "wait",
    overlap: bool = False,
    images: list[bytes] | None = None,
    client: EngineClient | None = None,
    **algorithm: Any,
) -> ExperienceProducer:
    """A producer over ten prompts of 2 to 11 tokens (responses of 12 down to 3 tokens); with
    ``images``, prompt i shows ``images[i % len(images)]``; with ``client`` (over a
    :class:`StreamEngine`), its responses stream at ``chunk=0``."""
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
    texts = ["1" * (i % 10 + 2) for i in range(10)]
    records = [PromptRecord(t, TOKENIZER(t)["input_ids"], "", {}) for t in texts]
    for i, record in enumerate(records if images else []):
        record.images = [images[i % len(images)]]
    loader = PromptLoader(records, 2, seed=0)
    rewards = RewardStage(cfg, TOKENIZER)
    return ExperienceProducer(
        cfg, engine.generate, TOKENIZER, loader, rewards, overlap, engine=client
    )


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
