"""The experience producer: the next scored Batch of a training step.

It draws prompts, runs the agent (``rollout.agent``), rewards the result with its reward
stage (:mod:`rlframe.rewards.stage`, where ``score`` and ``reward`` are defined), and, per
algorithm, runs DAPO's sampling rounds and ReMax's greedy baseline. The Trainer only calls
:meth:`ExperienceProducer.submit` and :meth:`ExperienceProducer.collect`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

from rlframe.algorithms.names import NEEDS_GREEDY_BASELINE
from rlframe.config import Config
from rlframe.data.loader import PromptLoader, build_prompt_batch
from rlframe.envs.runner import count_stuck_calls
from rlframe.protocol import Batch
from rlframe.rewards.stage import RewardStage
from rlframe.rollout.agents import AGENTS, AgentContext
from rlframe.rollout.sampling import run_sampling_rounds
from rlframe.tracking import StageTimer


class Producer(Protocol):
    """What the trainer, the validator and the launcher use of an experience producer: the
    lockstep :class:`ExperienceProducer` or the asynchronous ones
    (:mod:`rlframe.rollout.async_producer`, :mod:`rlframe.rollout.async_episodes`)."""

    def submit(self) -> None:
        """Start the next step's experience (the asynchronous producers run ahead anyway)."""

    def collect(self) -> tuple[Batch, dict[str, float]]:
        """The step's scored Batch and the metrics of producing it."""
        ...

    def generate(self, prompts: Batch) -> Batch:
        """The prompt rows with their responses, blocking (validation)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop what the producer started (the reward stage's processes)."""


PROMPT_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "group",
    "prompt",
    "ground_truth",
    "extra",
    "seed",
    "messages",
)


def collect_agent_metrics(batch: Batch) -> dict[str, float]:
    """``agent/*`` metrics of a batch from an agent that reports them (empty otherwise)."""
    if "agent_turns" not in batch:
        return {}
    metrics = {
        "agent/turns/mean": float(batch.tensor("agent_turns").mean()),
        "agent/tool_calls/mean": float(batch.tensor("agent_tool_calls").mean()),
        "agent/tool_errors": float(batch.tensor("agent_tool_errors").sum()),
        "agent/obs_tokens/mean": float(batch.tensor("agent_obs_tokens").mean()),
        "agent/obs_truncated": float(batch.tensor("agent_obs_cut").sum()),
        "agent/env_failures": float(batch.tensor("env_failed").sum()),
        "agent/env_reward/mean": float(batch.tensor("env_reward").mean()),
        "agent/stuck_calls": float(count_stuck_calls()),
    }
    if "agent_episode" in batch:  # an openai episode can make several rows
        rows = torch.bincount(batch.tensor("agent_episode"))
        rows = rows[rows > 0]
        metrics["agent/rows_per_episode/mean"] = float(rows.float().mean())
        metrics["agent/rows_per_episode/max"] = float(rows.max())
    return metrics


class ExperienceProducer:
    """Args:
    cfg: the run's config.
    generate: one turn for the rows given (the launcher's: the actor group's ``generate``
        when colocated, the rollout group's when separate).
    tokenizer: the model's tokenizer.
    loader: the prompt loader.
    rewards: the reward stage (adds ``score`` and ``reward``); closed by :meth:`close`.
    """

    def __init__(
        self,
        cfg: Config,
        generate: Callable[[Batch], Batch],
        tokenizer: Any,
        loader: PromptLoader,
        rewards: RewardStage,
    ) -> None:
        self.cfg, self.tokenizer, self.loader, self.rewards = cfg, tokenizer, loader, rewards
        self.agent = AGENTS.get(cfg.rollout.agent)
        self.context = AgentContext(generate, tokenizer, cfg)
        self.use_baseline = cfg.algorithm.advantage in NEEDS_GREEDY_BASELINE
        self.groups_served = 0
        self.pending: deque[tuple[Batch, dict[str, float]]] = deque()

    def submit(self) -> None:
        """Start producing the next step's batch, with the weights the rollout engines hold
        now. This producer makes it at once; :meth:`collect` hands batches out in the order
        they were submitted. Lockstep training is submit then collect; submitting step t+1
        before the update on step t is one-step-off-policy training."""
        self.pending.append(self.produce())

    def collect(self) -> tuple[Batch, dict[str, float]]:
        """The oldest submitted batch and its metrics (``timing_s/gen``, ``timing_s/reward``,
        ``timing_s/baseline``, DAPO's ``rollout/sampling_*``, ``agent/*``)."""
        if not self.pending:
            raise RuntimeError("ExperienceProducer.collect() without a submit() before it")
        return self.pending.popleft()

    def produce(self) -> tuple[Batch, dict[str, float]]:
        """Generated, rewarded (and for ReMax baselined) responses for one step."""
        timer = StageTimer()
        metrics: dict[str, float] = {}

        def draw() -> Batch:
            prompts = self.next_prompts()
            with timer("gen"):
                batch = self.generate(prompts)
            with timer("reward"):
                return self.rewards.compute_rewards(batch)

        a = self.cfg.algorithm
        if a.dynamic_sampling:
            n, wanted = self.cfg.rollout.n, self.cfg.data.batch_size
            batch, stats = run_sampling_rounds(draw, n, wanted, a.max_sampling_rounds)
            metrics |= stats
        else:
            batch = draw()
        metrics |= collect_agent_metrics(batch)
        if self.use_baseline:
            with timer("baseline"):
                batch = self.add_greedy_baseline(batch)
        return batch, metrics | timer.metrics()

    def generate(self, prompts: Batch) -> Batch:
        """The prompt rows with their responses, by the configured agent."""
        return self.agent(prompts, self.context)

    def state_dict(self) -> dict[str, Any]:
        """Where the prompts are: groups served so far (they seed the samples) and the loader.
        Batches in flight are not part of it, so there must be none."""
        if self.pending:
            raise RuntimeError(
                f"{len(self.pending)} submitted batch(es) not collected: a checkpoint now would "
                "skip their prompts on resume"
            )
        return {"groups_served": self.groups_served, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups_served = int(state["groups_served"])
        self.loader.load_state_dict(state["loader"])

    def close(self) -> None:
        """Stop the reward stage's processes and thread, and what the agent started."""
        self.rewards.close()
        for resource in self.context.resources.values():
            if hasattr(resource, "stop"):
                resource.stop()

    def next_prompts(self) -> Batch:
        records = self.loader.next_records()
        batch = build_prompt_batch(
            records,
            self.cfg.rollout.n,
            self.groups_served,
            self.tokenizer.pad_token_id,
            self.cfg.trainer.seed,
        )
        self.groups_served += len(records)
        batch.meta |= {
            "stop_token_ids": [self.tokenizer.eos_token_id],
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        return batch

    def add_greedy_baseline(self, batch: Batch) -> Batch:
        """ReMax: the reward of one greedy episode per prompt, shared by its group."""
        n = self.cfg.rollout.n
        prompts = batch.select([k for k in PROMPT_KEYS if k in batch]).rows(
            list(range(0, len(batch), n))
        )
        prompts.meta |= {"greedy": True}
        greedy = self.rewards.compute_rewards(self.generate(prompts))
        return batch.with_tensors(baseline=greedy.tensor("reward").repeat_interleave(n))
