"""An OpenAI-compatible endpoint in front of the rollout (``rollout.agent=openai``): agents
written against the ``openai`` client train unchanged. :mod:`.app` serves the API,
:mod:`.sessions` keys episodes (each call is one request of the engines' stream,
:mod:`rlframe.rollout.turns`), :mod:`.trajectory` turns calls into training rows,
:mod:`.agent` runs the episodes."""

from __future__ import annotations

from rlframe.rollout.agents import AGENTS, AgentFn


def pick_agent(name: str) -> AgentFn:
    """The rollout agent ``rollout.agent`` names: ``openai`` (this package's, imported only
    for the runs that use it: its server stack loads aiohttp), a built-in of
    :mod:`rlframe.rollout`, or a user's function by path."""
    if name == "openai":
        from rlframe.agent_server.agent import run_openai_episodes

        return run_openai_episodes
    return AGENTS.get(name)
