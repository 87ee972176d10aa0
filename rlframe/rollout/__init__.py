"""Experience production: agents (single-turn, multi-turn, openai, users'), group admission
within the staleness bound, DAPO's dropped groups, ReMax's greedy baseline. The Trainer asks
:class:`ExperienceProducer` for the next Batch."""

from typing import Any, Protocol

from rlframe.core.protocol import Batch
from rlframe.rollout import multi_turn  # noqa: F401  (registers the multi_turn agent)
from rlframe.rollout.agents import AGENTS, AgentContext, collect_agent_metrics, run_single_turn
from rlframe.rollout.producer import ExperienceProducer


class Producer(Protocol):
    """What the trainer, the validator and the launcher use of the experience producer."""

    def next_batch(self) -> tuple[Batch, dict[str, float]]:
        """The step's scored Batch and the metrics of producing it."""
        ...

    def generate(self, prompts: Batch) -> Batch:
        """The prompt rows with their responses, blocking (validation)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Stop what the producer started."""


__all__ = [
    "AGENTS",
    "AgentContext",
    "ExperienceProducer",
    "Producer",
    "collect_agent_metrics",
    "run_single_turn",
]
