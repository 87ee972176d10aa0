"""The experience producer: the next scored Batch of a training step, in every mode.

Groups (the ``n`` responses to one prompt) are admitted as far as
:func:`~rlframe.rollout.staleness.count_admissible` allows: each must still be trainable
within ``rollout.max_staleness`` versions of its admission. At 0 that is one step's groups at
a time, which is lockstep training; at ``k >= 1`` generation runs ahead of the trainer. The
work in flight runs one call at a time:

- ``single_turn``: every response in flight a request of the engines' stream, ended where it
  is by a weight sync (or a colocated step taking its batch) and continued after it
  (:mod:`rlframe.rollout.response_stream`); with ``rollout.partial_chunk_tokens > 0``, one
  engine call over every response in flight instead, each continued by up to that many
  tokens (:mod:`rlframe.rollout.partial`), which makes a run reproducible;
- any other agent (``multi_turn``, ``openai``, users'): the agent over every admitted group
  not yet run; an episode runs whole.

A group that finishes is scored at once: its rewards; a group that masking (a reward or env
failure under ``on_error=mask``) left short of samples is dropped and another prompt admitted
in its place (:mod:`rlframe.rollout.sampling`); with DAPO's dynamic sampling, so is a group
whose rewards are all equal; for ReMax its greedy baseline is generated.
:meth:`ExperienceProducer.next_batch` returns as soon as the step's groups are chosen
(:func:`~rlframe.rollout.staleness.select_step_groups`, earliest deadline first). With a
separate rollout pool (``overlap``) the stream, or a call in a driver thread, runs while the
trainer trains; the weight sync pauses the stream, or waits for the call (:meth:`track_sync`),
so a call runs on one weights version and what a run of calls samples does not depend on when
the sync came.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from rlframe.config import Config, StaleGroups
from rlframe.config.agent import compute_response_width
from rlframe.core.names import NEEDS_GREEDY_BASELINE, RouterReplay
from rlframe.core.protocol import Batch, read_sample_mask
from rlframe.core.tokenizer import Tokenizer, read_eos_id, read_pad_id
from rlframe.data.loader import PromptLoader, build_prompt_batch
from rlframe.data.prompts import PromptRecord
from rlframe.rewards.stage import RewardStage
from rlframe.rollout.agents import (
    AGENTS,
    AgentContext,
    AgentFn,
    check_rows,
    collect_agent_metrics,
    fill_mini_batches,
)
from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.partial import (
    Group,
    build_continuation,
    join_batch,
    list_unfinished,
    merge_call,
    restore_row,
)
from rlframe.rollout.response_stream import ResponseStream
from rlframe.rollout.rows import TokenRow, collate
from rlframe.rollout.sampling import (
    collect_masking_metrics,
    collect_sampling_metrics,
    concat_groups,
    count_masked_samples,
    has_uniform_rewards,
    is_short_of_samples,
    mask_group,
)
from rlframe.rollout.staleness import (
    GroupView,
    compute_off_policy_metrics,
    count_admissible,
    find_over_bound,
    select_step_groups,
)
from rlframe.rollout.state_json import add_missing_columns, decode_state, encode_state
from rlframe.rollout.turns import TurnServer


def run_now(fn: Callable[..., Any], *args: Any) -> Future[Any]:
    """``fn`` run here, as an answered future (no overlap: the driver waits anyway)."""
    future: Future[Any] = Future()
    future.set_result(fn(*args))
    return future


class ExperienceProducer:
    """Args:
    cfg: the run's config.
    generate: one turn for the rows of a request (the actor group's ``generate`` when
        colocated, the rollout group's when separate).
    tokenizer: the model's tokenizer.
    loader: the prompt loader.
    rewards: the reward stage; closed by :meth:`close`.
    overlap: run calls in a driver thread, ahead while the trainer trains (a separate
        rollout pool at ``max_staleness >= 1``).
    agent: the agent (default: ``rollout.agent`` from the registry).
    engine: the request stream the agents' episodes use (default: their turns gathered into
        calls of ``generate``); closed by :meth:`close`.
    """

    def __init__(
        self,
        cfg: Config,
        generate: Callable[[Batch], Batch],
        tokenizer: Tokenizer,
        loader: PromptLoader,
        rewards: RewardStage,
        overlap: bool = False,
        agent: AgentFn | None = None,
        engine: TurnServer | None = None,
    ) -> None:
        self.cfg, self.tokenizer, self.loader, self.rewards = cfg, tokenizer, loader, rewards
        self.context = AgentContext(generate, tokenizer, cfg, engine=engine)
        self.agent = agent or AGENTS.get(cfg.rollout.agent)
        """``rlframe.agent_server.pick_agent``'s choice (the run passes it); a built-in or a
        user's agent by default."""
        r, a = cfg.rollout, cfg.algorithm
        self.continues = r.agent == "single_turn"
        """Responses continue call by call; any other agent's episodes run whole."""
        self.k, self.n, self.wanted = r.max_staleness, r.n, cfg.data.batch_size
        self.wait_for_due = r.stale_groups is StaleGroups.wait
        self.use_baseline = a.advantage in NEEDS_GREEDY_BASELINE
        self.dynamic = a.dynamic_sampling
        self.replaceable = (a.max_sampling_rounds - 1) * self.wanted
        """DAPO: groups of equal rewards a step may drop and replace; later ones top it up."""
        judge = cfg.reward.judge
        self.reward_masks = cfg.reward.on_error == "mask" or (
            judge.enabled and judge.on_error == "mask"
        )
        """Rewards may mask samples: the rule reward's or the judge's failures."""
        self.env_masks = cfg.agent.on_env_error == "mask"
        self.pad_id = read_pad_id(tokenizer)
        self.meta = {"stop_token_ids": [read_eos_id(tokenizer)], "pad_token_id": self.pad_id}
        self.width = compute_response_width(r.max_tokens, r.agent, cfg.agent)
        """Columns of the grid's responses."""
        self.thread = (
            ThreadPoolExecutor(1, thread_name_prefix="rlframe-producer") if overlap else None
        )
        self.stream = self.build_stream()
        """Single-turn responses ahead of the trainer as requests of the stream (None:
        lockstep, fixed-size calls, or another agent)."""
        self.groups: list[Group] = []
        self.records: deque[PromptRecord] = deque()
        """Prompts drawn from the loader (a batch at a time) and not yet admitted."""
        self.groups_served = 0
        self.admitted = 0
        """Groups admitted since the start, dropped ones not counted."""
        self.steps_done = 0
        self.version = 0
        """The weights version the rollout engines hold (the next update starts from it)."""
        self.call: tuple[Future[tuple[Batch | list[TokenRow], float]], list[Group]] | None = None
        """The call in flight and the groups it runs."""
        self.counts = self.zero_counts()
        """This step's DAPO counts (``informative``, ``uniform``, ``replaced``) and masking
        counts (``samples`` scored, ``reward_masked``, ``env_masked``, ``masked_replaced``
        and ``masked_kept`` groups)."""
        self.timings = self.zero_timings()
        self.engine_busy_s = 0.0
        self.last_batch = time.perf_counter()

    def build_stream(self) -> ResponseStream | None:
        """At ``max_staleness >= 1`` single-turn responses stream, unless fixed-size calls
        are asked for (``partial_chunk_tokens``) or router replay needs every response's
        routing from one call (whole responses: the sync waits for the call)."""
        r, replay = self.cfg.rollout, self.cfg.algorithm.router_replay
        if not (self.continues and self.k > 0 and r.partial_chunk_tokens == 0):
            return None
        if replay is not RouterReplay.off:
            return None
        if not isinstance(self.context.turns, EngineClient):
            raise TypeError("streamed responses pause the engines: they need an EngineClient")
        return ResponseStream(self.context.turns, r.max_tokens, (read_eos_id(self.tokenizer),))

    def zero_counts(self) -> dict[str, int]:
        dapo = {"informative": 0, "uniform": 0, "replaced": 0}
        masking = ("samples", "reward_masked", "env_masked", "masked_replaced", "masked_kept")
        return dapo | dict.fromkeys(masking, 0) | {"over_bound": 0}

    def zero_timings(self) -> dict[str, float]:
        return {"gen": 0.0, "reward": 0.0} | ({"baseline": 0.0} if self.use_baseline else {})

    # -- the producer interface ------------------------------------------------------------

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The step's groups, once enough are finished and scored, and ``timing_s/gen``,
        ``timing_s/reward`` (``/baseline`` for ReMax), the judge's ``judge/*``, DAPO's
        ``rollout/kept_group_frac`` and ``rollout/uniform_dropped``, ``agent/*``; under
        ``on_error=mask`` ``reward/masked`` or ``agent/masked`` and ``rollout/masked_groups_*``
        (:func:`~rlframe.rollout.sampling.collect_masking_metrics`); at ``max_staleness >= 1`` also
        ``off_policy/*``, ``timing_s/trainer_idle`` (the driver waited for experience) and
        ``timing_s/rollout_idle`` (no call ran since the last batch)."""
        start = time.perf_counter()
        self.drop_over_bound()
        while (chosen := self.choose()) is None:
            self.advance()
        batch = fill_mini_batches(self.take(chosen), self.cfg.actor.mini_batch_size)
        self.steps_done += 1
        if self.thread is not None and self.call is None:
            self.launch_call()
        elif self.stream is not None and self.thread is None:
            self.stream.pause()  # the colocated engine sleeps while the trainer trains
        metrics = {f"timing_s/{k}": v for k, v in self.timings.items()}
        if self.dynamic:
            metrics |= collect_sampling_metrics(self.counts)
        if self.reward_masks or self.env_masks:
            metrics |= collect_masking_metrics(self.counts, self.reward_masks, self.env_masks)
        metrics |= collect_agent_metrics(batch)
        metrics |= self.context.turns.take_metrics()
        metrics |= self.rewards.take_metrics()
        self.rewards.release()  # a colocated judge sleeps while the trainer trains
        if self.k > 0:
            now = time.perf_counter()
            window, self.last_batch = now - self.last_batch, now
            busy, self.engine_busy_s = self.engine_busy_s, 0.0
            if self.stream is not None:
                busy += self.stream.take_busy_s()
            metrics |= compute_off_policy_metrics(
                batch.tensor("token_version"),
                batch.tensor("response_mask"),
                self.version,
                self.counts["over_bound"],
            )
            metrics["timing_s/trainer_idle"] = now - start
            metrics["timing_s/rollout_idle"] = max(0.0, window - busy)
        self.counts, self.timings = self.zero_counts(), self.zero_timings()
        return batch, metrics

    def generate(self, prompts: Batch) -> Batch:
        """The prompt rows with their responses, by the configured agent (blocking). A
        blocking engine call (validation, ReMax's baselines) finds the engines empty: the
        streamed responses in flight are paused, and continue at the next advance."""
        if self.stream is not None:
            self.stream.pause()
        return self.collate(prompts, self.run_agent(prompts, self.version))

    def run_agent(self, prompts: Batch, version: int) -> list[TokenRow]:
        """The agent's rows for ``prompts``; a row no engine call ran (its env failed at
        reset) carries ``version``, the one the call began with (weights only move forward,
        so no token is older)."""
        rows = check_rows(self.agent(prompts, self.context), self.cfg.rollout.agent)
        for row in rows:
            if row.first_version < 0:
                row.first_version = version
        return rows

    def collate(
        self, prompts: Batch, rows: list[TokenRow], index: list[int] | None = None
    ) -> Batch:
        """The training grid of ``rows`` with their prompt rows' keys: the one place rows
        become a Batch. ``index``: each row's prompt row (default: the row's ``source``, or
        its position)."""
        if index is None:
            index = [r.source if r.source >= 0 else i for i, r in enumerate(rows)]
        return collate(rows, prompts.rows(index), self.width, self.pad_id)

    def track_sync(self, sync_weights: Callable[[], int]) -> Callable[[], int]:
        """``sync_weights`` that first waits for the call in flight, then records the new
        version here."""

        def sync() -> int:
            if self.call is not None:
                self.call[0].result()
            if self.stream is not None:
                self.stream.pause()
            self.version = sync_weights()
            if self.stream is not None and self.thread is not None:
                self.launch_call()  # the responses in flight continue on the new weights
            return self.version

        return sync

    # -- the loop --------------------------------------------------------------------------

    def views(self) -> list[GroupView]:
        return [GroupView(g.group_id, g.start_version, g.scored is not None) for g in self.groups]

    def choose(self) -> list[int] | None:
        return select_step_groups(
            self.views(), self.wanted, self.version, self.k, self.wait_for_due
        )

    def drop_over_bound(self) -> None:
        """Drop the groups no update may use any more (``rollout.stale_groups=drop``; under
        ``wait`` none go over); their slots are admitted again. Counted in
        ``counts["over_bound"]`` (``off_policy/dropped``)."""
        if self.wait_for_due:
            return
        over = set(find_over_bound(self.views(), self.version, self.k))
        self.drop([g for g in self.groups if g.group_id in over])
        self.counts["over_bound"] += len(over)

    def drop(self, groups: list[Group]) -> None:
        for g in groups:
            g.dropped = True
        self.groups = [g for g in self.groups if not g.dropped]
        self.admitted -= len(groups)

    def advance(self) -> None:
        """Wait for the call in flight (starting one if none is), keep what it made, score
        the groups it finished."""
        started = time.perf_counter()
        # Answers a pause took in (the sync's, the state's) may have finished groups.
        finished = self.take_streamed() if self.stream is not None else []
        if not finished and not self.has_work():
            self.launch_call()
        if not finished and not self.has_work():
            raise RuntimeError(
                "the experience producer has nothing to generate and too few finished "
                f"groups ({sum(g.scored is not None for g in self.groups)} of {self.wanted})"
            )
        if self.stream is not None:
            if not finished:
                self.stream.wait()
                finished = self.take_streamed()
        else:
            assert self.call is not None
            future, todo = self.call
            out, busy = future.result()
            self.call = None
            self.engine_busy_s += busy
            finished = self.merge(todo, out)
        self.timings["gen"] += time.perf_counter() - started
        if finished:
            self.score(finished)

    def has_work(self) -> bool:
        """A call, or a streamed request, is in flight."""
        return self.call is not None or (self.stream is not None and bool(self.stream.in_flight))

    def take_streamed(self) -> list[Group]:
        """The groups whose every streamed response is complete, now done."""
        finished = [
            g
            for g in self.groups
            if not g.done and all(row.finish_reason is not None for row in g.rows)
        ]
        for g in finished:
            g.done = True
        return finished

    def launch_call(self) -> None:
        """Drop what went over the bound, admit what the bound allows, then start one call
        over the work in flight."""
        # After a sync the groups over the bound would otherwise be continued (a call, or
        # streamed requests that run to their end) and dropped by the next batch unused.
        self.drop_over_bound()
        room = count_admissible(self.admitted, self.steps_done, self.wanted, self.k)
        for _ in range(room):
            self.groups.append(self.admit())
        todo = [g for g in self.groups if not g.done]
        if self.stream is not None:
            self.stream.submit([row for g in todo for row in g.rows])
        elif todo:
            run = run_now if self.thread is None else self.thread.submit
            self.call = (run(self.run_call, todo, self.version), todo)

    def run_call(self, todo: list[Group], version: int) -> tuple[Batch | list[TokenRow], float]:
        """One call over ``todo`` (on the producer's thread with ``overlap``) and how long it
        took: an engine call continuing every response in flight, or the agent's episodes."""
        started = time.perf_counter()
        if self.continues:
            r = self.cfg.rollout
            # Chunks of one generation phase: a colocated engine stays awake through them
            # all and sleeps only when the trainer's next call needs the device.
            meta = self.meta | {"more_turns": r.partial_chunk_tokens > 0}
            request = build_continuation(
                list_unfinished(todo), r.max_tokens, r.partial_chunk_tokens, meta
            )
            out: Batch | list[TokenRow] = self.context.generate(request)
        else:
            out = self.run_agent(concat_groups([g.prompts for g in todo]), version)
        return out, time.perf_counter() - started

    def merge(self, todo: list[Group], out: Batch | list[TokenRow]) -> list[Group]:
        """Keep a call's tokens (or episodes' rows, each in the group of its prompt row);
        the groups it finished, dropped ones left out."""
        if isinstance(out, Batch):
            merge_call(list_unfinished(todo), out, self.cfg.rollout.max_tokens)
            for g in todo:
                g.done = all(row.finish_reason is not None for row in g.rows)
        else:
            owners = [(g, j) for g in todo for j in range(len(g.prompts))]
            for g in todo:
                g.rows, g.done = [], True
            for position, row in enumerate(out):
                g, row.source = owners[row.source if row.source >= 0 else position]
                g.rows.append(row)
        return [g for g in todo if g.done and not g.dropped]

    def score(self, groups: list[Group]) -> None:
        """Rewards for newly finished groups, in one reward-stage call; the drops of groups
        masking left short (:meth:`settle_masked`) and DAPO's; ReMax's greedy baselines."""
        started = time.perf_counter()
        sizes = [len(g.rows) for g in groups]
        starts = [0, *torch.tensor([len(g.prompts) for g in groups]).cumsum(0).tolist()]
        index = [start + r.source for g, start in zip(groups, starts) for r in g.rows]
        rows = [r for g in groups for r in g.rows]
        batch = self.collate(concat_groups([g.prompts for g in groups]), rows, index)
        scored = self.rewards.compute_rewards(batch)
        self.timings["reward"] += time.perf_counter() - started
        for key, count in count_masked_samples(scored, self.env_masks).items():
            self.counts[key] += count
        ends = torch.tensor(sizes).cumsum(0).tolist()
        for g, end, size in zip(groups, ends, sizes):
            g.scored = scored.rows(slice(end - size, end))
        whole = self.settle_masked(groups)
        live = [g for g in groups if not g.dropped]
        uniform = [g for g in live if self.dynamic and has_uniform_rewards(g.require_scored())]
        self.counts["uniform"] += len(uniform)
        self.counts["informative"] += len(live) - len(uniform)
        replaced = uniform[: max(0, self.replaceable - self.counts["replaced"])]
        self.counts["replaced"] += len(replaced)
        self.drop(replaced)
        kept = [g for g in groups if not g.dropped]
        if self.use_baseline and kept:
            started = time.perf_counter()
            self.add_greedy_baselines(kept)
            self.timings["baseline"] += time.perf_counter() - started
            whole += self.settle_masked(kept)  # a group whose greedy reward failed
        # DAPO may have replaced a group masked whole (its rewards are uniform: none count).
        self.counts["masked_kept"] += sum(not g.dropped for g in whole)

    def settle_masked(self, groups: list[Group]) -> list[Group]:
        """Groups that masking left short of samples
        (:func:`~rlframe.rollout.sampling.is_short_of_samples`): dropped and replaced by
        another prompt, up to ``data.batch_size`` of them a step; past that, kept with every
        row masked. Returns those."""
        short = [g for g in groups if not g.dropped and is_short_of_samples(g.require_scored())]
        replaced = short[: max(0, self.wanted - self.counts["masked_replaced"])]
        self.counts["masked_replaced"] += len(replaced)
        self.drop(replaced)
        for g in short[len(replaced) :]:
            g.scored = mask_group(g.require_scored())
        return short[len(replaced) :]

    def add_greedy_baselines(self, groups: list[Group]) -> None:
        """ReMax: the reward of one greedy episode per prompt, shared by its group."""
        prompts = concat_groups([g.prompts.rows([0]) for g in groups])
        prompts = Batch(prompts.tensors, prompts.columns, prompts.meta | {"greedy": True})
        greedy = self.rewards.compute_rewards(self.generate(prompts))
        valid = read_sample_mask(greedy)
        for g in groups:
            row = int(torch.nonzero(greedy.tensor("group") == g.group_id)[0])
            rows = g.require_scored()
            g.scored = rows.with_tensors(baseline=greedy.tensor("reward")[row].repeat(len(rows)))
            if not valid[row]:  # masked: no baseline to compare the group's samples with
                g.scored = mask_group(g.scored)

    def admit(self) -> Group:
        if not self.records:
            self.records.extend(self.loader.next_records())
        group = self.build_group(self.records.popleft(), self.groups_served, self.version)
        self.groups_served += 1
        self.admitted += 1
        return group

    def build_group(self, record: PromptRecord, group_id: int, version: int) -> Group:
        # The seeds lockstep gives this group: same prompt index, same samples at k=0.
        prompts = build_prompt_batch([record], self.n, group_id, self.pad_id, self.cfg.trainer.seed)
        prompts.meta |= self.meta
        rows = [
            TokenRow(list(record.prompt_ids), seed=int(s), source=i, images=list(record.images))
            for i, s in enumerate(prompts.column("seed"))
        ]
        return Group(group_id, record, prompts, rows, version)

    def take(self, chosen: list[int]) -> Batch:
        """The chosen groups' rows, in the order chosen; they leave the producer."""
        by_id = {g.group_id: g for g in self.groups}
        picked = [by_id[i].require_scored() for i in chosen]
        self.groups = [g for g in self.groups if g.group_id not in set(chosen)]
        return concat_groups(picked)

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the prompts are and every group in flight, after finishing the call in
        flight (nothing new starts): scored groups with their rows, unfinished responses
        with their kept tokens and their rows' images and routed experts in the blob
        table of :func:`~rlframe.rollout.state_json.encode_state`. JSON; resuming continues
        them exactly."""
        if self.call is not None:
            self.advance()
        if self.stream is not None:
            self.stream.pause()
        return encode_state(
            {
                "groups_served": self.groups_served,
                "loader": self.loader.state_dict(),
                "records": [vars(r) for r in self.records],
                "groups": [g.state_dict() for g in self.groups],
                "admitted": self.admitted,
                "steps_done": self.steps_done,
                "version": self.version,
                "counts": self.counts,
            }
        )

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        state = decode_state(saved)
        self.groups_served = int(state["groups_served"])
        self.loader.load_state_dict(state["loader"])
        self.records = deque(PromptRecord(**r) for r in state.get("records", []))
        self.admitted = int(state.get("admitted", 0))
        self.steps_done = int(state.get("steps_done", 0))
        self.version = int(state.get("version", 0))
        self.counts = self.zero_counts() | state.get("counts", {})
        self.groups = [self.restore_group(saved) for saved in state.get("groups", [])]

    def restore_group(self, saved: dict[str, Any]) -> Group:
        """A group of :meth:`state_dict`, as far as it got."""
        group = self.build_group(
            PromptRecord(**saved["record"]), saved["group_id"], saved["start_version"]
        )
        if "scored" in saved:
            group.scored = add_missing_columns(join_batch(saved["scored"]))
            group.done = True
        else:
            group.rows = [restore_row(r) for r in saved["rows"]]
            for i, row in enumerate(group.rows):  # saved before rows named their prompt row
                row.source = i if row.source < 0 else row.source
        return group

    def close(self) -> None:
        """Stop the call thread, the reward stage's processes and thread, and what the agent
        started (each resource of its context with a ``stop()``)."""
        if self.thread is not None:
            self.thread.shutdown(wait=False, cancel_futures=True)
        self.rewards.close()
        self.context.turns.close()
        for resource in self.context.resources.values():
            if hasattr(resource, "stop"):
                resource.stop()
