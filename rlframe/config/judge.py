"""The ``reward.judge`` section: a generative judge, an LLM served beside the policy that
reads each response and scores it (:mod:`rlframe.judges.client`). Its serving keys
(placement, engine, size) are those of every served model (:mod:`rlframe.config.served`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlframe.config.checks import require, require_choice, require_positive
from rlframe.config.served import ServedModelConfig
from rlframe.core.registry import absolutize

JUDGE_ERROR_POLICIES = ("mask", "raise")
"""``reward.judge.on_error``: leave the sample out of training, or stop the run. There is
no ``zero``: a judge that failed has not said the answer is wrong."""

JUDGE_FAILURES = ("parse_failures", "timeouts", "errors")
"""The ways a judge fails on a sample, as counted (``judge/<kind>``) and flagged per row
(``judge_<kind>``)."""


def default_verdicts() -> dict[str, float]:
    return {str(i): float(i) for i in range(1, 10)}


@dataclass
class JudgeConfig(ServedModelConfig):
    path: str | None = None
    """The judge: an HF folder or hub id of a causal LM (``Qwen/Qwen2.5-7B-Instruct``...), or
    ``tiny-judge:<seed>``, a tiny judge of the quickstart's answers trained on first use.
    null (default): no judge."""
    scorer: str = "expected"
    """How the judge scores: ``verdict`` (generate a verdict, parse a score from it with
    ``parser``), ``expected`` (no generation: the expected value of ``verdicts`` under the
    judge's next-token distribution), ``listwise`` (one call ranks a whole group), or your
    own async scorer as ``pkg.module:fn`` / ``file.py:fn`` (docs/judges.md)."""
    template: str | None = None
    """The judge's prompt, with ``{prompt}``, ``{response}``, ``{ground_truth}`` (listwise:
    ``{responses}``, the numbered responses, and ``{n}``). null: the scorer's built-in one."""
    chat: bool = True
    """Send the filled template as a user turn through the judge's chat template (when its
    tokenizer has one); false: as raw text."""
    verdicts: dict[str, float] = field(default_factory=default_verdicts)
    """Verdict tokens and their values: ``expected`` averages these values under the judge's
    probabilities of the tokens; the ``label`` parser maps a generated label to its value.
    Each must be one token of the judge's tokenizer. Default: ``"1"`` .. ``"9"``."""
    parser: str = "number"
    """``verdict``: how a score is read from the generated text: ``number`` (the last number
    in it), ``label`` (the last of ``verdicts`` in it), or your own ``pkg.module:fn``
    (text -> float, raising ``JudgeParseError`` when it finds none)."""
    max_tokens: int = 512
    """``verdict`` and ``listwise``: longest verdict the judge may generate."""
    temperature: float = 0.0
    """``verdict`` and ``listwise``: sampling temperature of the verdict (0: greedy)."""
    timeout_s: float = 120.0
    """Longest one judge call may take before it counts as timed out."""
    on_error: str = "mask"
    """A sample the judge failed on (its verdict did not parse, its call timed out or the
    engine failed): ``mask`` (default) takes it out of training as ``reward.on_error=mask``
    does (its group's statistics, the loss, the token counts) and counts it; ``raise`` stops
    the run with one line naming the sample. Never scored 0."""
    weight: float = 1.0
    """The judge's score enters the reward as ``weight * judge_score``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is not None:
            from pathlib import Path

            # A relative folder that exists becomes absolute (workers may start elsewhere).
            local = Path(self.path).expanduser()
            self.path = str(local.resolve()) if local.exists() else self.path
        self.scorer = absolutize(self.scorer)
        self.parser = absolutize(self.parser)
        require_choice(self.on_error, JUDGE_ERROR_POLICIES, "reward.judge.on_error")
        require_positive(self.max_tokens, "reward.judge.max_tokens")
        require_positive(self.timeout_s, "reward.judge.timeout_s")
        require(
            self.temperature >= 0,
            "reward.judge.temperature",
            f"must be >= 0 (0: greedy), got {self.temperature}",
        )
        require(
            math.isfinite(self.weight) and self.weight > 0,
            "reward.judge.weight",
            f"must be a finite number > 0, got {self.weight}",
        )
        require(
            bool(self.verdicts) and all(math.isfinite(v) for v in self.verdicts.values()),
            "reward.judge.verdicts",
            f"must map at least one verdict token to a finite value, got {self.verdicts}",
        )
        require(
            self.template is None or "{" in self.template,
            "reward.judge.template",
            "holds no field: give the judge the response with {response} (listwise: {responses})",
        )

    @property
    def enabled(self) -> bool:
        return self.path is not None
