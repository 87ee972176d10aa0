"""The schema's ``reward`` section: the rule reward, its process pool and limits, overlong
shaping, the reward model (``reward.model``) and the generative judge (``reward.judge``,
:mod:`rlframe.config.judge`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlframe.config.checks import require, require_choice, require_positive
from rlframe.config.judge import JudgeConfig
from rlframe.core.registry import absolutize

REWARD_ERROR_POLICIES = ("raise", "mask", "zero")
"""``reward.on_error``: stop the run, leave the sample out of training, or score it 0."""


@dataclass
class RewardModelConfig:
    path: str | None = None
    """A reward model to score responses with: an ``AutoModelForSequenceClassification``
    folder or hub id with one label (``Skywork/Skywork-Reward-V2-Qwen3-0.6B``...), or
    ``tiny-rm:<seed>`` for the tiny random one the CPU tests build. null: no reward model."""
    weight: float = 1.0
    """The reward model's score enters the reward as ``weight * score``."""
    worker_cls: str = "workers.reward_model.RewardModelWorker"
    """Dotted path of the reward-model worker class."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one rank."""
    max_length: int = 4096
    """Prompt + response tokens (in the reward model's tokenizer) kept; longer inputs keep
    their end."""
    dtype: str = "auto"
    """auto (bf16 on cuda, fp32 on cpu), float32 or bfloat16."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the reward model and its tokenizer."""

    def __post_init__(self) -> None:
        import math

        require(
            math.isfinite(self.weight),
            "reward.model.weight",
            f"must be a finite number, got {self.weight}",
        )
        require_positive(self.micro_batch_size, "reward.model.micro_batch_size")
        require_positive(self.max_length, "reward.model.max_length")
        allowed = ("auto", "float32", "bfloat16")
        require(
            self.dtype in allowed,
            "reward.model.dtype",
            f"must be one of {allowed}, got {self.dtype!r}",
        )
        if self.path is not None:
            self.path = absolutize_folder(self.path)


def absolutize_folder(path: str) -> str:
    """A relative folder that exists becomes absolute (workers may start elsewhere); ids and
    ``tiny-rm:N`` are kept."""
    from pathlib import Path

    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


@dataclass
class RewardConfig:
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than rollout.max_tokens - overlong_buffer lose
    up to ``overlong_penalty``, linearly over the buffer; 0 turns it off."""
    overlong_penalty: float = 1.0
    """Penalty at rollout.max_tokens (overlong shaping)."""
    fn: str = "auto"
    """Rule reward: a registered name (char_match, exact_match, math_answer, math_verify,
    code_tests), your own as ``pkg.module:function`` / ``path/to/file.py:function``, or
    ``auto``: char_match for the synthetic tasks, exact_match for prompt files."""
    weight: float = 1.0
    """The rule reward enters the reward as ``weight * score``; 0 turns it off (then
    ``reward.model.path`` must be set)."""
    num_workers: int = 2
    """Processes scoring the rule reward in parallel, each sample under ``reward.timeout_s``.
    0 scores in the driver process, one by one, with no time limit."""
    timeout_s: float = 60.0
    """Longest a rule reward may take on one sample (with num_workers >= 1) before its process is
    killed and the sample counts as timed out."""
    on_error: str = "raise"
    """A sample whose rule reward raises, returns a non-number/NaN or times out: ``raise`` stops
    the run at the first such sample (the others are cancelled), naming the function and the
    sample; ``mask`` takes the sample out of training (out of its group's statistics, the loss
    and the loss's token counts; a group left with fewer than 2 samples is replaced) and logs
    its rate as ``reward/masked``; ``zero`` scores it 0, a wrong answer in its group (which
    biases GRPO-style advantages: use ``mask`` unless a failure really means a wrong answer).
    Both count it in ``reward/errors`` / ``reward/timeouts``."""
    retry_on_error: bool = False
    """Score a failed sample once more before ``reward.on_error`` decides (for failures that
    come and go: a sandbox preempted, a judge that timed out). Off by default: a rule reward
    that failed on a sample usually fails again, and a timeout retried costs another
    ``reward.timeout_s``. Retries count in ``reward/retries``."""
    step_timeout_s: float = 1800.0
    """Longest the rule-reward stage of one step may take (with num_workers >= 1), whatever
    ``reward.timeout_s``: samples not scored by then count as timed out (``raise`` stops)."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model (off unless ``reward.model.path`` is set)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """Generative judge (off unless ``reward.judge.path`` is set)."""

    def __post_init__(self) -> None:
        import math

        # The name is checked against the registry by rlframe.run.preflight.
        self.fn = absolutize(self.fn)
        require_positive(self.overlong_penalty, "reward.overlong_penalty")
        require(
            self.overlong_buffer >= 0,
            "reward.overlong_buffer",
            f"must be >= 0, got {self.overlong_buffer}",
        )
        require(
            self.num_workers >= 0,
            "reward.num_workers",
            f"must be >= 0 (0 scores in the driver), got {self.num_workers}",
        )
        require_positive(self.timeout_s, "reward.timeout_s")
        require_positive(self.step_timeout_s, "reward.step_timeout_s")
        require_choice(self.on_error, REWARD_ERROR_POLICIES, "reward.on_error")
        require(
            math.isfinite(self.weight) and self.weight >= 0,
            "reward.weight",
            f"must be >= 0, got {self.weight}",
        )
        require(
            self.weight > 0 or self.model.path is not None or self.judge.enabled,
            "reward.weight",
            "is 0, which turns the rule reward off, and neither reward.model.path nor "
            "reward.judge.path is set: nothing would score the responses",
        )

    @property
    def uses_rule(self) -> bool:
        return self.weight > 0

    @property
    def uses_model(self) -> bool:
        return self.model.path is not None

    @property
    def uses_judge(self) -> bool:
        return self.judge.enabled
