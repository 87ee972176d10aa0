"""The request stream's wire: one turn of one sequence into a rollout engine, and back.

An episode (a coroutine on the driver) sends a :class:`TurnRequest` whenever it needs the
model, and gets its :class:`TurnResult` when the engine finishes that sequence; the engine
serves the requests of every episode at once with continuous batching
(:mod:`rlframe.rollout.engine_client` on the driver, ``RolloutRole.serve`` on the worker).
A :class:`TurnServer` is what an agent sends its requests to: the engine client, over the
workers' ``serve`` or over a blocking batch ``generate`` (:mod:`rlframe.rollout.batched_turns`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class TurnRequest:
    """Continue ``context`` by at most ``max_tokens`` sampled tokens."""

    context: list[int]
    """The whole sequence so far (prompt, earlier turns, observations)."""
    seed: int
    """Fixes this request's sampling."""
    max_tokens: int
    stop_ids: tuple[int, ...]
    """The turn ends after any of these tokens (kept in the result)."""
    temperature: float | None = None
    """None: the run's ``rollout.temperature``; 0: greedy (ReMax's baseline)."""
    images: tuple[bytes, ...] = ()
    """The encoded images whose (expanded) pads ``context`` holds, in order."""
    request_id: str = ""
    """Unique in the run; set by the client."""
    score_from: int | None = None
    """Score ``context`` instead of continuing it: the model's log-prob of each context
    token from this position on, given its prefix (a teacher's or a judge's reading of a
    sequence; temperature 1, nothing sampled). None: a sampled turn."""
    top_k: int = 0
    """With ``score_from``: also the ``top_k`` most likely tokens at each scored position."""

    def __post_init__(self) -> None:
        if self.score_from is not None and not 1 <= self.score_from < len(self.context):
            raise ValueError(
                f"score_from={self.score_from} must point inside the context (1.."
                f"{len(self.context) - 1}): position 0 has no prefix to be scored from"
            )


def build_score_request(
    ids: list[int], score_from: int, top_k: int = 0, images: tuple[bytes, ...] = ()
) -> TurnRequest:
    """A request that scores ``ids[score_from:]`` (each given its prefix) and samples nothing."""
    return TurnRequest(
        ids, 0, 1, (), temperature=1.0, images=images, score_from=score_from, top_k=top_k
    )


@dataclass
class ScoredTokens:
    """A model's reading of given tokens (a :class:`TurnRequest` with ``score_from``)."""

    logprobs: list[float]
    """``log p(ids[t] | ids[:t])`` for each scored position ``t``, in order."""
    top_ids: list[list[int]]
    """The ``top_k`` most likely ids at each scored position, most likely first ([] each
    when ``top_k`` is 0)."""
    top_logprobs: list[list[float]]
    """Their log-probs, in the same order."""


def score_with_model(model: Any, ids: list[int], start: int, top_k: int) -> ScoredTokens:
    """A transformers causal LM's reading of ``ids[start:]`` (each given its prefix, fp32
    softmax at temperature 1) and its ``top_k`` at each of those positions: what a served
    engine's scoring request returns, computed by the training stack's library."""
    tokens = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0, start - 1 : -1].float()
    logp = torch.log_softmax(logits, -1)
    given = logp.gather(1, tokens[0, start:, None])[:, 0].tolist()
    top = logp.topk(top_k, -1)
    return ScoredTokens(given, top.indices.tolist(), top.values.tolist())


ABORTED = "abort"
"""The finish reason of a request ended part-way by a pause of the stream
(:meth:`~rlframe.rollout.engine_client.EngineClient.pause`): its tokens so far, to continue."""


@dataclass
class TurnResult:
    """What the engine sampled for one :class:`TurnRequest`."""

    request_id: str
    ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the distribution it was drawn from."""
    finish_reason: str
    """``stop`` (a stop id, kept in ``ids``) or ``length`` (``max_tokens`` reached)."""
    weights_version: int
    """The version of the weights that sampled every token of the turn."""
    cached_tokens: int = 0
    """Tokens of ``context`` the engine's prefix cache held (-1: not reported)."""
    routed_experts: torch.Tensor | None = None
    """int16 [context + ids - 1, MoE layers, top_k] with ``algorithm.router_replay=rollout``."""
    rank: int = -1
    """The rollout rank that served it (the first of its tensor-parallel group; -1: not
    served through the stream)."""
    scored: ScoredTokens | None = None
    """A scoring request's reading of its context (None for a sampled turn)."""


class TurnServer(Protocol):
    """Where an agent's episodes send their turns (thread-safe)."""

    def open(self) -> None:
        """Make the engines ready for a generation phase (blocking): before the episodes."""
        ...

    def submit(self, request: TurnRequest, session: str) -> Future[TurnResult]:
        """Queue ``request`` of ``session`` (an episode: its turns go to one engine)."""
        ...

    def end_session(self, session: str) -> None:
        """``session`` sends no more requests."""
        ...

    def take_metrics(self) -> dict[str, float]:
        """``rollout/*`` figures of the requests served since the last call."""
        ...

    def close(self) -> None: ...


def settle(
    future: Future[TurnResult], result: TurnResult | None = None, error: Exception | None = None
) -> None:
    """Answer ``future`` unless its waiter gave up on it (a cancelled episode)."""
    if not future.set_running_or_notify_cancel():
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


async def sample_turn(server: TurnServer, request: TurnRequest, session: str) -> TurnResult:
    """``request`` served by ``server``, awaited from any event loop."""
    return await asyncio.wrap_future(server.submit(request, session))
