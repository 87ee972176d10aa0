"""The reward stage: generated rows in, rewarded rows out. Owned by the experience producer.

One name per quantity, per row (all float tensors of shape ``[rows]``):

- ``rule_score``: the raw value of the rule reward ``reward.fn`` on the decoded response
  (0 where it failed under ``reward.on_error=zero`` or ``mask``). Never weighted or combined.
- ``rm_score``: the reward model's raw score.
- ``judge_score``: the generative judge's raw score (:mod:`rlframe.judges.stage`; 0
  where it failed), with ``judge_parse_failures``, ``judge_timeouts``, ``judge_errors``
  (1 where it failed so).
- ``env_reward``: the sum of an environment's step rewards (multi-turn agents only; set by
  the agent, not here).
- ``score``: the task score the run optimises, before shaping:
  ``reward.weight * rule_score + reward.model.weight * rm_score +
  reward.judge.weight * judge_score``; in a batch with an
  ``env_reward`` that task score is then weighted again and the env's reward added:
  ``agent.rule_reward_weight * task + agent.env_reward_weight * env_reward`` (the two rule
  weights multiply). An episode its env failed (``agent.on_env_error=fail_episode``) scores 0.
- ``reward``: ``score`` plus DAPO's overlong penalty (0 for a failed episode). The advantage
  reads this one.
- ``sample_mask`` (:data:`~rlframe.core.protocol.SAMPLE_MASK`): 1, or 0 for a sample taken
  out of training because its rule reward failed under ``reward.on_error=mask``, its judge
  under ``reward.judge.on_error=mask`` or its env under ``agent.on_env_error=mask``
  (:func:`mask_failed_samples`). Such a row's ``score``
  and ``reward`` are 0 and not scores, and its ``loss_mask`` is all 0, so it is in no loss
  and no token count; the advantage estimators leave it out of their group statistics.

Metrics: ``reward/rule_mean`` and ``reward/model_mean`` are the means of the raw
``rule_score`` and ``rm_score``; ``reward/score_mean`` of ``score``; ``reward/mean`` of
``reward``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from rlframe.config import Config, RewardConfig
from rlframe.config.agent import AgentConfig
from rlframe.config.judge import JUDGE_FAILURES
from rlframe.controller.roles import RewardModelGroup
from rlframe.core.protocol import SAMPLE_MASK, Batch
from rlframe.core.tokenizer import Tokenizer
from rlframe.rewards.scoring import RuleScorer


class JudgedRows(Protocol):
    """One judged batch (:class:`rlframe.judges.stage.JudgeScores`)."""

    scores: list[float]
    """0 where the row failed."""
    failures: list[str | None]
    """None, or how the judge failed on the row (``judge/<kind>``)."""

    def flags(self, kind: str) -> torch.Tensor: ...


class Judge(Protocol):
    """The judge stage (:class:`rlframe.judges.stage.JudgeStage`; the reward folder does not
    import the judges', which build on it)."""

    def start(self, batch: Batch, responses: list[str]) -> Future[JudgedRows]: ...

    def take_metrics(self) -> dict[str, float]: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class RewardStage:
    """Decode, score by rule and by reward model (in parallel), add the env's reward, shape.

    Args:
        cfg: the run's config (``reward.*``, ``agent.*`` weights, ``rollout.max_tokens``).
        tokenizer: decodes the response ids for the rule reward and the reward model.
        reward_model: the reward-model worker group (its ``compute_rm_scores``), or None.
        judge: the judge stage (``reward.judge``), or None; closed by :meth:`close`.
    """

    def __init__(
        self,
        cfg: Config,
        tokenizer: Tokenizer,
        reward_model: RewardModelGroup | None = None,
        judge: Judge | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.reward_model, self.judge = (
            cfg,
            tokenizer,
            reward_model,
            judge,
        )
        self.rule_scorer = (
            RuleScorer(resolve_reward_name(cfg), cfg.reward) if cfg.reward.uses_rule else None
        )
        # The reward model scores on its workers while the driver runs the rule reward.
        self.reward_model_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="reward-model")
            if reward_model is not None
            else None
        )

    def compute_rewards(self, batch: Batch) -> Batch:
        """Add ``score``, ``reward``, ``sample_mask`` and the decoded ``response`` (see the
        module docstring), and per row ``rule_score``, ``reward_errors``, ``reward_timeouts``
        (1 where the rule reward failed, under ``reward.on_error=zero`` or ``mask``),
        ``reward_retries`` (1 where it was scored a second time) and ``rm_score``."""
        r = self.cfg.reward
        texts = [
            decode(self.tokenizer, ids, mask)
            for ids, mask in zip(batch.tensor("response_ids"), batch.tensor("response_mask"))
        ]
        pending_rm = self.start_reward_model(batch, texts)
        pending_judge = self.judge.start(batch, texts) if self.judge is not None else None
        score = torch.zeros(len(batch))
        parts: dict[str, torch.Tensor] = {}
        if self.rule_scorer is not None:
            samples = [
                {"prompt": p, **extra}
                for p, extra in zip(batch.column("prompt"), batch.column("extra"))
            ]
            rule = self.rule_scorer.score(texts, list(batch.column("ground_truth")), samples)
            parts |= {
                "rule_score": torch.tensor(rule.scores),
                "reward_errors": torch.tensor(rule.errors, dtype=torch.float32),
                "reward_timeouts": torch.tensor(rule.timeouts, dtype=torch.float32),
                "reward_retries": torch.tensor(rule.retried, dtype=torch.float32),
            }
            score += r.weight * parts["rule_score"]
        if pending_rm is not None:
            parts["rm_score"] = pending_rm.result()
            score += r.model.weight * parts["rm_score"]
        if pending_judge is not None:
            judged = pending_judge.result()
            parts["judge_score"] = torch.tensor(judged.scores)
            parts |= {f"judge_{kind}": judged.flags(kind) for kind in JUDGE_FAILURES}
            score += r.judge.weight * parts["judge_score"]
        # Sampled tokens against their budget: observations in a multi-turn response do not count.
        penalty = compute_overlong_penalty(
            batch.tensor("loss_mask").sum(1), self.cfg.rollout.max_tokens, r
        )
        scored = Batch(
            batch.tensors | parts | {"score": score, "reward": score + penalty},
            batch.columns | {"response": texts},
            batch.meta,
        )
        return mask_failed_samples(combine_rewards(scored, self.cfg.agent), self.cfg)

    def start_reward_model(self, batch: Batch, texts: list[str]) -> Future[torch.Tensor] | None:
        """Send prompts (as chat turns) and responses to the reward-model group, in the
        background."""
        reward_model = self.reward_model
        if reward_model is None or self.reward_model_thread is None:
            return None
        request = Batch(columns={"messages": batch.column("messages"), "response": texts})
        return self.reward_model_thread.submit(
            lambda: reward_model.compute_rm_scores(request).tensor("rm_score")
        )

    def take_metrics(self) -> dict[str, float]:
        """The judge's ``judge/*`` figures since the last call (none without a judge)."""
        return self.judge.take_metrics() if self.judge is not None else {}

    def release(self) -> None:
        """The step's experience is made: a colocated judge sleeps while the policy trains."""
        if self.judge is not None:
            self.judge.release()

    def close(self) -> None:
        """Stop the reward processes and the reward-model and judge threads."""
        if self.rule_scorer is not None:
            self.rule_scorer.close()
        if self.judge is not None:
            self.judge.close()
        if self.reward_model_thread is not None:
            self.reward_model_thread.shutdown(wait=False, cancel_futures=True)


def decode(tokenizer: Tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> str:
    """The response text without its closing EOS. Other special tokens stay visible, so
    a policy cannot hide junk from the reward behind tokens that decode to nothing."""
    tokens = ids[mask.bool()].tolist()
    if tokens and tokens[-1] == tokenizer.eos_token_id:
        tokens = tokens[:-1]
    return tokenizer.decode(tokens, skip_special_tokens=False)


def compute_overlong_penalty(
    lengths: torch.Tensor, max_tokens: int, cfg: RewardConfig
) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer, then falling linearly to
    -penalty at max_tokens."""
    if cfg.overlong_buffer <= 0:
        return torch.zeros(lengths.shape)
    excess = (lengths.float() - (max_tokens - cfg.overlong_buffer)).clamp(min=0)
    return -cfg.overlong_penalty * (excess / cfg.overlong_buffer).clamp(max=1)


def combine_rewards(batch: Batch, cfg: AgentConfig) -> Batch:
    """Weight the task ``score`` and add the env's reward (see the module docstring); batches
    without an ``env_reward`` (single-turn) are returned as they are. The overlong penalty
    (``reward - score`` on the way in) is kept; ``rule_score`` is left raw."""
    if "env_reward" not in batch:
        return batch
    task = batch.tensor("score").float()
    penalty = batch.tensor("reward").float() - task
    score = (
        cfg.rule_reward_weight * task + cfg.env_reward_weight * batch.tensor("env_reward").float()
    )
    if "agent_reward_given" in batch:  # rollout.agent=openai: see rlframe.agent_server.agent
        score = score_openai_episodes(batch, task, cfg)
    failed = batch.tensor("env_failed").bool()
    zero = torch.zeros_like(score)
    return batch.with_tensors(
        score=torch.where(failed, zero, score),
        reward=torch.where(failed, zero, score + penalty),
    )


def mask_failed_samples(batch: Batch, cfg: Config) -> Batch:
    """``sample_mask`` (:data:`~rlframe.core.protocol.SAMPLE_MASK`): 0 where the rule reward
    failed under ``reward.on_error=mask`` (:func:`find_rule_failures`), the judge under
    ``reward.judge.on_error=mask`` (:func:`find_judge_failures`) or the env under
    ``agent.on_env_error=mask``, else 1. A masked row leaves training here: its ``score`` and
    ``reward`` become 0 and its ``loss_mask`` all 0, so it is in no loss and no token count."""
    masked = torch.zeros(len(batch), dtype=torch.bool)
    if cfg.reward.on_error == "mask":
        masked |= find_rule_failures(batch, cfg.agent)
    if cfg.reward.judge.enabled and cfg.reward.judge.on_error == "mask":
        masked |= find_judge_failures(batch)
    if cfg.agent.on_env_error == "mask" and "env_failed" in batch:
        masked |= batch.tensor("env_failed").bool()
    loss_mask = batch.tensor("loss_mask")
    zero = torch.zeros(len(batch))
    return batch.with_tensors(
        **{SAMPLE_MASK: (~masked).float()},
        loss_mask=torch.where(masked.unsqueeze(1), torch.zeros_like(loss_mask), loss_mask),
        score=torch.where(masked, zero, batch.tensor("score").float()),
        reward=torch.where(masked, zero, batch.tensor("reward").float()),
    )


def find_rule_failures(batch: Batch, cfg: AgentConfig) -> torch.Tensor:
    """[rows] bool: rows whose reward holds a rule score that failed (``reward_errors`` or
    ``reward_timeouts``). In an env's batch the rule score enters only with
    ``agent.rule_reward_weight > 0``; an ``openai`` episode's rows take the rule score of
    the episode's last row, and only when the agent gave no reward of its own."""
    if "reward_errors" not in batch:
        return torch.zeros(len(batch), dtype=torch.bool)
    failed = batch.tensor("reward_errors").bool() | batch.tensor("reward_timeouts").bool()
    if "env_reward" not in batch:
        return failed
    if cfg.rule_reward_weight == 0:
        return torch.zeros_like(failed)
    if "agent_reward_given" not in batch:
        return failed
    episode = batch.tensor("agent_episode").long()
    last = find_last_rows(episode)
    return failed[last[episode]] & ~batch.tensor("agent_reward_given").bool()


def find_judge_failures(batch: Batch) -> torch.Tensor:
    """[rows] bool: rows the judge failed on (a parse failure, a timeout, an error)."""
    failed = torch.zeros(len(batch), dtype=torch.bool)
    for kind in JUDGE_FAILURES:
        if f"judge_{kind}" in batch:
            failed |= batch.tensor(f"judge_{kind}").bool()
    return failed


def find_last_rows(episode: torch.Tensor) -> torch.Tensor:
    """Per episode id, the index of its last row."""
    order = torch.arange(len(episode))
    return torch.zeros(int(episode.max()) + 1, dtype=torch.long).scatter_reduce(
        0, episode, order, "amax"
    )


def score_openai_episodes(batch: Batch, task: torch.Tensor, cfg: AgentConfig) -> torch.Tensor:
    """An episode's reward is the agent's (times ``agent.env_reward_weight``) when it gave
    one, else ``reward.fn``'s score of the episode's last row (times
    ``agent.rule_reward_weight``); every row of the episode gets it."""
    episode = batch.tensor("agent_episode").long()
    last = find_last_rows(episode)
    rule = cfg.rule_reward_weight * task[last[episode]]
    given = batch.tensor("agent_reward_given").bool()
    return torch.where(given, cfg.env_reward_weight * batch.tensor("env_reward").float(), rule)


def resolve_reward_name(cfg: Config) -> str:
    """``auto``: partial-credit char_match for the synthetic tasks, exact_match for files."""
    if cfg.reward.fn != "auto":
        return cfg.reward.fn
    return "exact_match" if cfg.data.train_files else "char_match"
