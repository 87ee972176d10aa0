"""Agents: how prompts become responses (``rollout.agent``).

An agent is a function ``agent(prompts: Batch, ctx: AgentContext) -> list[TokenRow]``: it
returns its rows (:class:`~rlframe.rollout.rows.TokenRow`), one per sequence, and the
experience producer collates them into the training grid, once, in one place
(:meth:`rlframe.rollout.producer.ExperienceProducer.collate`). A row's ``source`` names the
prompt row it answers (-1: the row at the same position), so an agent may return several rows
per prompt. An agent grows its rows with the engines' turns: ``ctx.turns`` is the request
stream (one turn of one episode at a time, :func:`rlframe.rollout.turns.sample_turn`),
``ctx.generate`` one blocking engine call over many rows
(:func:`~rlframe.rollout.rows.sample_turns`). What a row carries besides its tokens is typed:
``images``, ``routed_experts``, an agent's counters (:class:`~rlframe.rollout.rows.AgentStats`:
``env_reward``, ``env_failed``, the ``agent_*`` metrics of :func:`collect_agent_metrics`),
``prompt`` (the prompt text, where the agent built the prompt).

An agent that returns a Batch (the contract before rows) stops the run at its first call
with one line saying so (:func:`check_rows`).

Built-ins: ``single_turn`` (here), ``openai`` (an OpenAI-compatible server for agents
written against the ``openai`` client, :mod:`rlframe.agent_server`) and ``multi_turn``
(:mod:`rlframe.rollout.multi_turn`, which registers itself; the package imports it). Your own:
``rollout.agent=pkg.module:my_agent`` or ``path/to/file.py:my_agent``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlframe.config import Config
from rlframe.core.protocol import SAMPLE_MASK, Batch
from rlframe.core.registry import Registry
from rlframe.core.tokenizer import Tokenizer
from rlframe.envs.base import EnvError
from rlframe.envs.runner import count_stuck_calls
from rlframe.rollout.batched_turns import serve_by_generate
from rlframe.rollout.engine_client import EngineClient
from rlframe.rollout.rows import TokenRow, sample_single_turn
from rlframe.rollout.turns import TurnServer


@dataclass
class AgentContext:
    generate: Callable[[Batch], Batch]
    """The actor group's generate: one turn for each row of a request
    (:func:`rlframe.rollout.rows.build_request`; meta ``stop_token_ids``) -> its response
    (:func:`rlframe.rollout.rows.build_response`)."""
    tokenizer: Tokenizer
    """The model's tokenizer (driver side)."""
    config: Config
    resources: dict[str, Any] = field(default_factory=dict)
    """What an agent keeps across batches (the ``openai`` agent's server); each value with a
    ``stop()`` is stopped when the producer closes."""
    engine: TurnServer | None = None
    """The request stream to the engines (:class:`~rlframe.rollout.engine_client.EngineClient`
    in a run); None: turns gathered into calls of ``generate``."""
    turns: TurnServer = field(init=False)
    """Where episodes send their turns: ``engine``, or a stream whose one replica serves
    them in calls of ``generate`` (:func:`~rlframe.rollout.batched_turns.serve_by_generate`).
    Closed when the producer closes."""

    def __post_init__(self) -> None:
        self.turns = (
            self.engine
            if self.engine is not None
            else EngineClient([serve_by_generate(self.generate)])
        )


AgentFn = Callable[[Batch, AgentContext], list[TokenRow]]
AGENTS: Registry[AgentFn] = Registry("rollout agent", served_elsewhere=("openai",))
"""The built-in agents; ``openai`` is picked by :func:`rlframe.agent_server.pick_agent`."""


@AGENTS.register("single_turn")
def run_single_turn(prompts: Batch, ctx: AgentContext) -> list[TokenRow]:
    """One sampled response per row: every response token is the policy's."""
    return sample_single_turn(ctx.generate, prompts)


def check_rows(rows: object, agent: str) -> list[TokenRow]:
    """An agent's return value, which must be its rows; EnvError (one line) otherwise."""
    if isinstance(rows, list) and all(isinstance(r, TokenRow) for r in rows):
        return rows
    what = "a Batch" if isinstance(rows, Batch) else f"a {type(rows).__name__}"
    raise EnvError(
        f"rollout.agent={agent} returned {what}, not a list of TokenRow: an agent returns its "
        "rows (rlframe.rollout.rows.TokenRow) and the producer collates them; see "
        "docs/agents.md, 'Your own agent'"
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
    if "agent_obs_images" in batch:  # multi_turn: images its observations brought
        metrics["agent/obs_images/mean"] = float(batch.tensor("agent_obs_images").mean())
    if "agent_episode" in batch:  # an openai episode can make several rows
        rows = torch.bincount(batch.tensor("agent_episode"))
        rows = rows[rows > 0]
        metrics["agent/rows_per_episode/mean"] = float(rows.float().mean())
        metrics["agent/rows_per_episode/max"] = float(rows.max())
    return metrics


def fill_mini_batches(batch: Batch, mini_batch_size: int) -> Batch:
    """Copies of the last row, loss mask 0, sample mask 0 and a group each, up to whole
    mini-batches (an agent that forks rows, such as ``openai``, makes any number of them)."""
    missing = (-len(batch)) % mini_batch_size
    if missing == 0:
        return batch
    filler = batch.rows([len(batch) - 1] * missing)
    first_group = int(batch.tensor("group").max()) + 1
    filler = filler.with_tensors(
        loss_mask=torch.zeros_like(filler.tensor("loss_mask")),
        group=torch.arange(first_group, first_group + missing, dtype=batch.tensor("group").dtype),
    )
    if SAMPLE_MASK in batch:  # not samples: out of the reward metrics too
        filler = filler.with_tensors(**{SAMPLE_MASK: torch.zeros(missing)})
    return Batch.concat([batch, filler])
