"""The rollout-engine protocol: token ids in, token ids and their log-probs out."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from rlframe.rollout.turns import ScoredTokens


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: tuple[int, ...]
    """Generation ends after any of these tokens (the EOS), which is kept in the response."""
    max_tokens_per_row: tuple[int, ...] | None = None
    """Row i's own cap (a multi-turn episode's remaining budget); None: ``max_tokens`` for all."""
    score_from: int | None = None
    """A scoring request (:class:`~rlframe.rollout.turns.TurnRequest`): read the prompt's
    log-probs from this position on (temperature 1), sample nothing that is used."""
    top_k: int = 0
    """With ``score_from``: the most likely tokens at each scored position too."""

    def max_tokens_at(self, row: int) -> int:
        return self.max_tokens if self.max_tokens_per_row is None else self.max_tokens_per_row[row]

    def for_row(self, row: int) -> SamplingSpec:
        """The spec of one row, with that row's ``max_tokens``."""
        return replace(self, max_tokens=self.max_tokens_at(row), max_tokens_per_row=None)


@dataclass
class RolloutSample:
    response_ids: list[int]
    logprobs: list[float]
    """Log-prob of each response token under the sampling distribution (after temperature)."""
    finish_reason: str
    """``stop`` (a stop token) or ``length`` (max_tokens reached)."""
    routed_experts: torch.Tensor | None = None
    """int16 [prompt + response - 1, MoE layers, top_k]: the experts each token fed through
    the model was routed to (see rlframe.models.moe_routing); None unless the engine records
    them."""
    cached_tokens: int = -1
    """Prompt tokens the engine's prefix cache held (-1: the engine does not say)."""
    scored: ScoredTokens | None = None
    """A scoring request's reading of its prompt."""


class RolloutEngine(Protocol):
    discards_weights_on_sleep: bool
    """True when ``sleep`` throws the weights away (vLLM sleep level 2): after the next
    ``wake_up`` the weights are uninitialised memory until ``load_weights`` refills them."""

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        spec: SamplingSpec,
        images: list[list[bytes]] | None = None,
    ) -> list[RolloutSample]:
        """One response per prompt; ``seeds[i]`` fixes prompt i's sampling. ``images[i]``:
        prompt i's images (encoded bytes), whose pads prompt i holds already expanded."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        seed: int,
        spec: SamplingSpec,
        images: list[bytes] | None = None,
    ) -> None:
        """Queue one request of the stream; it joins the running batch at the next ``step``."""
        ...

    def step(self) -> list[tuple[str, RolloutSample]]:
        """One engine step over every queued and running request; the requests it finished."""
        ...

    def has_unfinished(self) -> bool:
        """Whether a request added is not finished yet."""
        ...

    def abort(self) -> list[tuple[str, RolloutSample]]:
        """End every request added and not finished, now: each with what it sampled so far
        (finish reason ``abort``; a request not started yet, or a scoring one, with
        nothing). Nothing of them is left in the engine."""
        ...

    def compute_prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` given their prefixes at temperature 1 (the sync probe)."""
        ...

    def describe_weights(self) -> str:
        """What the engine serves now, for errors (``adapter rlframe-v3 (id 3)``)."""
        ...

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place from (HF name, full tensor) pairs."""
        ...

    def sleep(self) -> None:
        """Free device memory for training (no-op where unsupported)."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``sleep`` freed: ``["weights"]``, ``["kv_cache"]`` or (None) both."""
        ...
