"""An agent written to the contract before rows: it returns its collated Batch (refused)."""

from __future__ import annotations

from rlframe.core.protocol import Batch
from rlframe.rollout import AgentContext


def collated(prompts: Batch, ctx: AgentContext) -> Batch:
    raise AssertionError("refused before it runs")
