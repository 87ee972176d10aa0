"""The asynchronous experience producer (``rollout.max_staleness >= 1``).

It offers the lockstep producer's interface (:meth:`submit`, :meth:`collect`, state, close)
but keeps generation going ahead of the trainer, within the staleness bound:

- Groups are admitted ahead, as many as :func:`~rlframe.rollout.staleness.count_admissible`
  allows: each must still be trainable within ``max_staleness`` versions of its first token.
- The engine runs every response in flight in one call at a time, each call adding up to
  ``rollout.partial_chunk_tokens`` tokens (:mod:`rlframe.rollout.partial`); groups that
  finish are scored at once, while the others go on.
- :meth:`collect` returns as soon as the step's groups are chosen
  (:func:`~rlframe.rollout.staleness.select_step_groups`, earliest deadline first); the
  responses still in flight are paused with their tokens and log-probs kept, and continue
  after the sync on the new weights.
- With a separate rollout pool (``overlap``) a call is left running while the trainer
  trains; the sync that follows the update reaches the rollout workers once that call is
  done (each worker runs its calls in order), so a sync never races a generation.

The trainer learns the weights version through :meth:`track_sync`, which wraps the
launcher's ``sync_weights``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from rlframe.config import Config, StaleGroups
from rlframe.data.loader import PromptLoader, build_prompt_batch
from rlframe.data.prompts import PromptRecord
from rlframe.protocol import Batch
from rlframe.rewards.stage import RewardStage
from rlframe.rollout.agents import AGENTS, AgentContext
from rlframe.rollout.partial import Group, build_continuation, merge_call
from rlframe.rollout.rows import TokenRow, attach, collate
from rlframe.rollout.sampling import concat_groups
from rlframe.rollout.staleness import (
    GroupView,
    compute_off_policy_metrics,
    count_admissible,
    find_over_bound,
    select_step_groups,
)

if TYPE_CHECKING:
    from rlframe.controller.worker_group import CallHandle


class PendingCall(Protocol):
    """A call started and not yet waited for: a worker group's call, or a driver thread's."""

    def result(self) -> Any: ...


class AsyncProducer:
    """Args:
    cfg: the run's config (``rollout.max_staleness >= 1``).
    submit_generate: starts one generate call on the rollout engines without waiting.
    generate: the blocking generate (validation).
    tokenizer: the model's tokenizer.
    loader: the prompt loader.
    rewards: the reward stage; closed by :meth:`close`.
    overlap: leave a call running while the trainer trains (separate rollout pool).
    """

    def __init__(
        self,
        cfg: Config,
        submit_generate: Callable[[Batch], CallHandle],
        generate: Callable[[Batch], Batch],
        tokenizer: Any,
        loader: PromptLoader,
        rewards: RewardStage,
        overlap: bool,
    ) -> None:
        self.cfg, self.tokenizer, self.loader, self.rewards = cfg, tokenizer, loader, rewards
        self.submit_generate, self.overlap = submit_generate, overlap
        self.context = AgentContext(generate, tokenizer, cfg)
        self.agent = AGENTS.get(cfg.rollout.agent)
        r = cfg.rollout
        self.k, self.n, self.wanted = r.max_staleness, r.n, cfg.data.batch_size
        self.wait_for_due = r.stale_groups is StaleGroups.wait
        self.meta = {
            "stop_token_ids": [tokenizer.eos_token_id],
            "pad_token_id": tokenizer.pad_token_id,
        }
        self.groups: list[Group] = []
        self.records: deque[PromptRecord] = deque()
        """Prompts drawn from the loader (a batch at a time) and not yet admitted."""
        self.groups_served = 0
        self.admitted = 0
        """Groups admitted since the start, dropped ones not counted."""
        self.steps_done = 0
        self.version = 0
        """The weights version the rollout engines hold (the next update starts from it)."""
        self.call: tuple[PendingCall, list[Any], float] | None = None
        """The engine call in flight: its handle, the responses it runs, when it started."""
        self.engine_busy_s = 0.0
        self.last_collect = time.perf_counter()

    # -- the producer interface ------------------------------------------------------------

    def submit(self) -> None:
        """Nothing to start here: generation runs ahead on its own (see the module doc)."""

    def collect(self) -> tuple[Batch, dict[str, float]]:
        """The step's groups, chosen once enough are finished and scored; ``timing_s/gen``
        (waiting on the engine), ``timing_s/reward``, ``timing_s/trainer_idle`` (the driver
        waited for experience), ``timing_s/rollout_idle`` (the engine had nothing to do since
        the last collect) and ``off_policy/*``."""
        start = time.perf_counter()
        timings = {"gen": 0.0, "reward": 0.0}
        dropped = 0 if self.wait_for_due else self.drop_over_bound()
        while (chosen := self.choose()) is None:
            self.advance(timings)
        batch = self.take(chosen)
        self.steps_done += 1
        if self.overlap and self.call is None:
            self.launch_call()
        now = time.perf_counter()
        window, self.last_collect = now - self.last_collect, now
        busy, self.engine_busy_s = self.engine_busy_s, 0.0
        metrics = compute_off_policy_metrics(
            batch.tensor("token_version"), batch.tensor("response_mask"), self.version, dropped
        )
        metrics |= {f"timing_s/{k}": v for k, v in timings.items()}
        metrics["timing_s/trainer_idle"] = now - start
        metrics["timing_s/rollout_idle"] = max(0.0, window - busy)
        return batch, metrics

    def generate(self, prompts: Batch) -> Batch:
        """The prompt rows with their responses, blocking (validation)."""
        return self.agent(prompts, self.context)

    def track_sync(self, sync_weights: Callable[[], int]) -> Callable[[], int]:
        """``sync_weights`` that also records the new version here."""

        def sync() -> int:
            self.version = sync_weights()
            return self.version

        return sync

    # -- the loop --------------------------------------------------------------------------

    def views(self) -> list[GroupView]:
        return [GroupView(g.group_id, g.oldest_version, g.scored is not None) for g in self.groups]

    def choose(self) -> list[int] | None:
        return select_step_groups(
            self.views(), self.wanted, self.version, self.k, self.wait_for_due
        )

    def drop_over_bound(self) -> int:
        """Drop the groups no update may use any more; their slots are admitted again."""
        over = set(find_over_bound(self.views(), self.version, self.k))
        for g in self.groups:
            if g.group_id in over:
                g.dropped = True
        self.groups = [g for g in self.groups if not g.dropped]
        self.admitted -= len(over)
        return len(over)

    def advance(self, timings: dict[str, float]) -> None:
        """Wait for the call in flight (starting one if none is), keep its tokens, score the
        groups it finished."""
        if self.call is None:
            self.launch_call()
        if self.call is None:
            raise RuntimeError(
                "the asynchronous producer has nothing to generate and too few finished "
                f"groups ({sum(g.scored is not None for g in self.groups)} of {self.wanted})"
            )
        handle, todo, _ = self.call
        started = time.perf_counter()
        out = handle.result()
        self.call = None
        timings["gen"] += time.perf_counter() - started
        self.engine_busy_s += float(out.meta.get("engine_s", 0.0))
        finished = self.merge(todo, out)
        if finished:
            started = time.perf_counter()
            self.score(finished)
            timings["reward"] += time.perf_counter() - started

    def launch_call(self) -> None:
        """Admit what the bound allows, then start one call over the work in flight."""
        room = count_admissible(self.admitted, self.steps_done, self.wanted, self.k)
        for _ in range(room):
            self.groups.append(self.admit())
        self.call = self.start_call()

    def start_call(self) -> tuple[PendingCall, list[Any], float] | None:
        """One engine call over every response in flight, each continued up to the chunk."""
        todo = [
            (g, i)
            for g in self.groups
            for i, r in enumerate(g.responses)
            if r.finish_reason is None
        ]
        if not todo:
            return None
        r = self.cfg.rollout
        # One generation phase runs chunk after chunk: a colocated engine stays awake through
        # them all and sleeps only when the trainer's next call needs the device.
        meta = self.meta | {"more_turns": True}
        batch = build_continuation(todo, r.max_tokens, r.partial_chunk_tokens, meta)
        return (self.submit_generate(batch), todo, time.perf_counter())

    def merge(self, todo: list[Any], out: Batch) -> list[Group]:
        """Keep a call's tokens; the groups it finished."""
        return merge_call(todo, out, self.cfg.rollout.max_tokens)

    def admit(self) -> Group:
        if not self.records:
            self.records.extend(self.loader.next_records())
        record = self.records.popleft()
        group = self.build_group(record, self.groups_served, self.version)
        self.groups_served += 1
        self.admitted += 1
        return group

    def build_group(self, record: PromptRecord, group_id: int, version: int) -> Group:
        # The seeds lockstep gives this group: same prompt index, same samples at k=0.
        prompts = build_prompt_batch(
            [record], self.n, group_id, self.tokenizer.pad_token_id, self.cfg.trainer.seed
        )
        prompts.meta |= self.meta
        responses = [TokenRow(list(record.prompt_ids), seed=int(s)) for s in prompts.column("seed")]
        return Group(group_id, record, prompts, responses, version)

    def score(self, groups: list[Group]) -> None:
        """Rewards for newly finished groups, in one reward-stage call."""
        width, pad = self.cfg.rollout.max_tokens, self.tokenizer.pad_token_id
        batch = concat_groups([self.assemble(g, width, pad) for g in groups])
        for g, scored in zip(groups, self.rewards.compute_rewards(batch).split(self.n)):
            g.scored = scored

    def assemble(self, group: Group, width: int, pad: int) -> Batch:
        """A finished group's prompt rows and collated responses, before rewards."""
        return attach(group.prompts, collate(group.responses, width, pad))

    def take(self, chosen: list[int]) -> Batch:
        """The chosen groups' rows, in the order chosen; they leave the producer."""
        by_id = {g.group_id: g for g in self.groups}
        picked = []
        for i in chosen:
            scored = by_id[i].scored
            if scored is None:
                raise RuntimeError(f"group {i} was taken before it was scored")
            picked.append(scored)
        self.groups = [g for g in self.groups if g.group_id not in set(chosen)]
        return concat_groups(picked)

    # -- checkpoints -----------------------------------------------------------------------

    def drain(self) -> None:
        """Finish the call in flight (its tokens are kept, nothing new starts)."""
        if self.call is not None:
            self.advance({"gen": 0.0, "reward": 0.0})

    def state_dict(self) -> dict[str, Any]:
        """Where the prompts are and every group in flight with its kept tokens, after
        draining the engine call in flight: resuming continues them exactly."""
        self.drain()
        return {
            "groups_served": self.groups_served,
            "loader": self.loader.state_dict(),
            "records": [vars(r) for r in self.records],
            "groups": [g.state_dict() for g in self.groups],
            "admitted": self.admitted,
            "steps_done": self.steps_done,
            "version": self.version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups_served = int(state["groups_served"])
        self.loader.load_state_dict(state["loader"])
        self.records = deque(PromptRecord(**r) for r in state.get("records", []))
        self.admitted = int(state.get("admitted", 0))
        self.steps_done = int(state.get("steps_done", 0))
        self.version = int(state.get("version", 0))
        self.groups = []
        for saved in state.get("groups", []):
            self.groups.append(self.restore_group(saved))
        done = [g for g in self.groups if g.finished]
        if done:
            self.score(done)

    def restore_group(self, saved: dict[str, Any]) -> Group:
        """A group of :meth:`state_dict`, as far as it got."""
        group = self.build_group(
            PromptRecord(**saved["record"]), saved["group_id"], saved["start_version"]
        )
        group.responses = [TokenRow(**r) for r in saved["responses"]]
        return group

    def close(self) -> None:
        """Stop the reward stage's processes and thread."""
        self.rewards.close()
