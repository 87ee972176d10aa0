"""Asynchronous training with an agent that runs whole episodes (``multi_turn``, users' agents).

:class:`~rlframe.rollout.async_producer.AsyncProducer` continues single-turn responses across
engine calls. An episode cannot be cut that way (its environment lives on the driver, between
turns), so here one "call" is the agent run over every admitted group not yet run, in a driver
thread, and an episode is never paused: it runs to its end. The rest is the parent's:
groups admitted ahead within the bound, chosen earliest deadline first, dropped or waited for
over the bound, saved with the checkpoint.

With a separate rollout pool the thread keeps the engines busy while the trainer trains; the
weight sync after the update waits for the thread's episodes to end, so an episode runs on
one weights version from its first turn to its last (as a single-turn call does), and what a
run samples does not depend on when the sync happened to arrive: resuming is exact. Each
token still carries its version (``token_version`` from the agent, or, for an agent that does
not report it, the version the call started from). Colocated, the thread runs only while the
driver waits for experience; being ahead then means that one call covers the groups of up to
``max_staleness + 1`` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlframe.protocol import Batch
from rlframe.rollout.async_producer import AsyncProducer, PendingCall
from rlframe.rollout.partial import Group
from rlframe.rollout.sampling import concat_groups


class AsyncEpisodeProducer(AsyncProducer):
    """Same arguments as :class:`AsyncProducer`; ``rollout.partial_chunk_tokens`` does not
    apply (episodes run whole)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.episodes: dict[int, Batch] = {}
        """The agent's rows of each finished group, by group id."""
        self.running: set[int] = set()
        """Groups of the call in flight."""
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rlframe-episodes")

    def start_call(self) -> tuple[PendingCall, list[Any], float] | None:
        """The agent over every admitted group not yet run, in the driver thread."""
        todo = [
            g
            for g in self.groups
            if g.group_id not in self.episodes and g.group_id not in self.running
        ]
        if not todo:
            return None
        self.running = {g.group_id for g in todo}
        prompts = concat_groups([g.prompts for g in todo])
        future = self.thread.submit(self.run_agent, prompts, self.version)
        return (future, todo, time.perf_counter())

    def track_sync(self, sync_weights: Callable[[], int]) -> Callable[[], int]:
        """The parent's, after the episodes in flight have ended (see the module doc)."""

        def sync_after_episodes() -> int:
            if self.call is not None:
                self.call[0].result()
            return sync_weights()

        return super().track_sync(sync_after_episodes)

    def run_agent(self, prompts: Batch, version: int) -> Batch:
        """The episodes, each token with its weights version, and how long the call took."""
        started = time.perf_counter()
        out = self.agent(prompts, self.context)
        if "token_version" not in out:
            # Weights only move forward: no token is older than the version the call began with.
            width = out.tensor("response_ids").shape[1]
            out = out.with_tensors(
                token_version=torch.full((len(out), width), version, dtype=torch.long),
                weights_version=torch.full((len(out),), version, dtype=torch.long),
            )
        out.meta["engine_s"] = time.perf_counter() - started
        return out

    def merge(self, todo: list[Any], out: Batch) -> list[Group]:
        """Every group of the call is finished: keep its rows, and its oldest version."""
        self.running = set()
        finished = []
        for group, rows in zip(todo, out.split(self.n)):
            if group.dropped:
                continue
            self.episodes[group.group_id] = rows
            for response, version, reason in zip(
                group.responses,
                rows.tensor("weights_version").tolist(),
                rows.column("finish_reason"),
            ):
                response.first_version = int(version)
                response.finish_reason = str(reason)
            finished.append(group)
        return finished

    def assemble(self, group: Group, width: int, pad: int) -> Batch:
        return self.episodes[group.group_id]

    def take(self, chosen: list[int]) -> Batch:
        batch = super().take(chosen)
        for group_id in chosen:
            del self.episodes[group_id]
        return batch

    def drop_over_bound(self) -> int:
        dropped = super().drop_over_bound()
        kept = {g.group_id for g in self.groups}
        self.episodes = {i: rows for i, rows in self.episodes.items() if i in kept}
        return dropped

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The parent's, with the rows of the finished episodes (after the drain, every
        admitted group is finished: an episode is never saved half run)."""
        state = super().state_dict()
        for saved in state["groups"]:
            saved["episode"] = encode_batch(self.episodes[saved["group_id"]])
        return state

    def restore_group(self, saved: dict[str, Any]) -> Group:
        group = super().restore_group(saved)
        self.episodes[group.group_id] = decode_batch(saved["episode"])
        return group

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
        super().close()


def encode_batch(batch: Batch) -> dict[str, Any]:
    """A batch as JSON: each tensor with its dtype, the columns and meta as they are."""
    return {
        "tensors": {
            k: {"dtype": str(t.dtype).removeprefix("torch."), "data": t.tolist()}
            for k, t in batch.tensors.items()
        },
        "columns": {k: v.tolist() for k, v in batch.columns.items()},
        "meta": dict(batch.meta),
    }


def decode_batch(saved: dict[str, Any]) -> Batch:
    tensors = {
        k: torch.tensor(t["data"], dtype=getattr(torch, t["dtype"]))
        for k, t in saved["tensors"].items()
    }
    return Batch(tensors, dict(saved["columns"]), dict(saved["meta"]))
