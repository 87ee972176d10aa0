"""Experience production: agents (single-turn, multi-turn, users'), DAPO's sampling rounds,
ReMax's greedy baseline. The Trainer asks :class:`ExperienceProducer` for the next Batch."""

from rlframe.rollout import multi_turn  # noqa: F401  (registers the multi_turn agent)
from rlframe.rollout.agents import AGENTS, AgentContext, run_single_turn
from rlframe.rollout.producer import ExperienceProducer, Producer, collect_agent_metrics
from rlframe.rollout.sampling import run_sampling_rounds, select_groups, split_uniform_groups

__all__ = [
    "AGENTS",
    "AgentContext",
    "ExperienceProducer",
    "Producer",
    "collect_agent_metrics",
    "run_sampling_rounds",
    "run_single_turn",
    "select_groups",
    "split_uniform_groups",
]
