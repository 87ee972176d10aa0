"""The training grid of rows, for tests that run an agent or an engine call without a producer
(in a run, :meth:`rlframe.rollout.producer.ExperienceProducer.collate` is the one place rows
become a Batch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlframe.config.agent import compute_response_width
from rlframe.core.protocol import Batch
from rlframe.rollout.agents import AgentContext, AgentFn
from rlframe.rollout.rows import TokenRow, collate, sample_single_turn


def collate_rows(rows: Sequence[TokenRow], prompts: Batch, width: int, version: int = 0) -> Batch:
    """``rows`` (an agent's, each naming its prompt row by ``source``) as the grid."""
    index = [r.source if r.source >= 0 else i for i, r in enumerate(rows)]
    pad = int(prompts.meta.get("pad_token_id", 0))
    return collate(rows, prompts.rows(index), width, pad, version)


def generate_batch(generate: Callable[[Batch], Batch], prompts: Batch, width: int) -> Batch:
    """The prompt rows with one sampled turn each, as a grid of ``width`` response columns."""
    return collate_rows(sample_single_turn(generate, prompts), prompts, width)


def run_agent(agent: AgentFn, prompts: Batch, ctx: AgentContext) -> Batch:
    """An agent's rows for ``prompts`` as the grid a run's producer makes of them (its width;
    a row no call ran carries the newest version any row was sampled with)."""
    rows = agent(prompts, ctx)
    r = ctx.config.rollout
    width = compute_response_width(r.max_tokens, r.agent, ctx.config.agent)
    latest = max((row.oldest_version for row in rows if row.first_version >= 0), default=0)
    return collate_rows(rows, prompts, width, latest)
