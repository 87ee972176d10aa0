"""A generative judge's client, and the plug-ins that score with it.

The judge is a served model (:mod:`rlframe.rollout.served`): engine replicas of its own, reached
through the request stream. :class:`JudgeClient` is what a scorer holds: async calls that
render a template in the judge's chat format, generate a verdict, or read the judge's
next-token distribution, each under ``reward.judge.timeout_s``, counted for ``judge/*``.

A **scorer** scores one group (the responses to one prompt) and returns one score per
response, or, in a response's place, the exception that kept it from being scored
(:class:`JudgeParseError`, :class:`JudgeTimeout`, an engine error); raising fails every
response of the group. Built-ins (:mod:`rlframe.judges.scorers`) are registered in
:data:`JUDGE_SCORERS` by name; ``reward.judge.scorer: pkg.module:fn`` picks a user's, which
may mix the judge's verdict with rules of its own::

    async def my_scorer(group: JudgedGroup, judge: JudgeClient) -> list[float | BaseException]

A **parser** reads a score from a generated verdict (``reward.judge.parser``), registered in
:data:`JUDGE_PARSERS`: ``fn(text, verdicts) -> float``, raising :class:`JudgeParseError`.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlframe.config.checks import ConfigError
from rlframe.config.judge import JudgeConfig
from rlframe.config.served import MAX_TOP_K
from rlframe.core.registry import Registry
from rlframe.core.tokenizer import Tokenizer
from rlframe.rewards.registry import RewardError
from rlframe.rollout.turns import TurnRequest, TurnResult, TurnServer, build_score_request


class JudgeParseError(ValueError):
    """The judge's verdict holds no score (no number, no known label, no verdict token
    among its most likely next tokens, not a ranking of the group)."""


class JudgeTimeout(TimeoutError):
    """A judge call ran past ``reward.judge.timeout_s``."""


class JudgeError(RewardError):
    """The judge failed on a sample under ``reward.judge.on_error=raise``: the run stops."""


@dataclass
class JudgedGroup:
    """The responses to one prompt, as a scorer gets them."""

    prompt: str
    responses: list[str]
    ground_truth: str
    sample: dict[str, Any] = field(default_factory=dict)
    """The prompt's other columns (``task``, ``data_source``, ``messages``...)."""


JudgeScorer = Callable[[JudgedGroup, "JudgeClient"], Awaitable[list[float | BaseException]]]
JudgeParser = Callable[[str, dict[str, float]], float]
JUDGE_SCORERS: Registry[JudgeScorer] = Registry("judge scorer")
JUDGE_PARSERS: Registry[JudgeParser] = Registry("judge parser")


@dataclass
class JudgeCounters:
    """What the judge did since the last :meth:`JudgeClient.take_counters`."""

    calls: int = 0
    tokens: int = 0
    """Tokens the judge read (its contexts) and wrote (its verdicts)."""


class JudgeClient:
    """Args:
    server: the judge's request stream (the served model's ``client``).
    tokenizer: the judge's own tokenizer (not the policy's).
    cfg: ``reward.judge``.
    stop_ids: the ids that end a verdict (the judge's EOS, its end-of-turn tokens).
    """

    def __init__(
        self, server: TurnServer, tokenizer: Tokenizer, cfg: JudgeConfig, stop_ids: tuple[int, ...]
    ) -> None:
        self.server, self.tokenizer, self.config, self.stop_ids = server, tokenizer, cfg, stop_ids
        self.counters = JudgeCounters()
        self.sessions = 0
        self.verdict_ids = {label: self.encode_one(label) for label in cfg.verdicts}

    def encode_one(self, label: str) -> int:
        ids = self.tokenizer(label, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(
                "reward.judge.verdicts",
                f"{label!r} is {len(ids)} tokens of the judge's tokenizer; each verdict must be "
                "one token (the expected value reads one next-token distribution)",
            )
        return int(ids[0])

    def render(self, template: str, **fields: Any) -> str:
        """``template`` filled with ``fields``, as the judge's user turn (chat template, with
        the assistant's turn opened) when ``reward.judge.chat`` and the tokenizer has one."""
        text = template.format(**fields)
        if not (self.config.chat and getattr(self.tokenizer, "chat_template", None)):
            return text
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )

    def encode(self, text: str) -> list[int]:
        # A rendered chat template already holds its special tokens.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def call(self, request: TurnRequest) -> TurnResult:
        """One request on a session of its own, under ``reward.judge.timeout_s``."""
        self.sessions += 1
        session = f"judge-{self.sessions}"
        self.counters.calls += 1
        self.counters.tokens += len(request.context)
        try:
            result = await asyncio.wait_for(
                asyncio.wrap_future(self.server.submit(request, session)), self.config.timeout_s
            )
        except TimeoutError:
            raise JudgeTimeout(
                f"the judge did not answer within reward.judge.timeout_s={self.config.timeout_s}"
            ) from None
        finally:
            self.server.end_session(session)
        if request.score_from is None:
            self.counters.tokens += len(result.ids)
        return result

    async def generate(
        self, text: str, max_tokens: int | None = None, temperature: float | None = None
    ) -> str:
        """The judge's verdict on ``text`` (rendered already), up to ``max_tokens``
        (default ``reward.judge.max_tokens``), without its closing stop token."""
        ids = self.encode(text)
        request = TurnRequest(
            ids,
            zlib.crc32(text.encode()),  # the same text gets the same verdict
            max_tokens or self.config.max_tokens,
            self.stop_ids,
            temperature=self.config.temperature if temperature is None else temperature,
        )
        result = await self.call(request)
        out = result.ids
        if out and out[-1] in self.stop_ids:
            out = out[:-1]
        return str(self.tokenizer.decode(out, skip_special_tokens=True))

    async def read_next_token(self, text: str) -> dict[int, float]:
        """The judge's log-probs of its ``MAX_TOP_K`` most likely next tokens after ``text``
        (rendered already), by token id; nothing is generated. Tokens outside them are not
        reported (the engines return at most that many per position)."""
        ids = self.encode(text)
        # Score one placeholder token after the text: the top-k at its position is the
        # judge's distribution of the token that follows the text.
        request = build_score_request(ids + [ids[-1]], len(ids), MAX_TOP_K)
        result = await self.call(request)
        assert result.scored is not None
        return dict(zip(result.scored.top_ids[0], result.scored.top_logprobs[0], strict=True))

    def take_counters(self) -> JudgeCounters:
        counters, self.counters = self.counters, JudgeCounters()
        return counters
