"""Experience production: agents (single-turn, multi-turn, openai, users'), group admission
within the staleness bound, DAPO's dropped groups, ReMax's greedy baseline. The Trainer asks
:class:`ExperienceProducer` for the next Batch."""

from rlframe.rollout import multi_turn  # noqa: F401  (registers the multi_turn agent)
from rlframe.rollout.agents import AGENTS, AgentContext, collect_agent_metrics, run_single_turn
from rlframe.rollout.producer import ExperienceProducer, Producer

__all__ = [
    "AGENTS",
    "AgentContext",
    "ExperienceProducer",
    "Producer",
    "collect_agent_metrics",
    "run_single_turn",
]
