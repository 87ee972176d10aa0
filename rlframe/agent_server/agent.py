"""``rollout.agent=openai``: train an agent written against the OpenAI client, unchanged.

Per prompt row, one episode: a session (its own API key) is opened on the run's server
(:mod:`rlframe.agent_server.app`, started on first use, kept for the run) and the user's
function ``agent.entry`` is called as ``entry(base_url, api_key, sample)`` (sync: on a
thread; async: a task), at most ``agent.max_concurrent_envs`` at once, each within
``agent.step_timeout_s`` (for this agent: the whole episode), with ``agent.on_env_error``
deciding what a raise or a timeout does (``mask``: the episode's rows leave training;
``fail_episode``: they score 0). ``sample`` is the prompt row as ``env.reset`` of
the multi-turn agent gets it (``prompt``, ``messages``, ``ground_truth`` and the row's
columns). The function returns the episode's reward, or None for ``reward.fn`` to score
the episode's text.

Rows: the episode's calls become one training row per chain of extending calls
(:mod:`rlframe.agent_server.trajectory`); an episode that rewrote its history gives several
rows. Each row is a response of the prompt's group (same ``group`` id) with the episode's
reward, so GRPO-style advantages compare it with the group's other rows: an episode of k
rows weighs k times in its group's mean and std, and every row of it gets the same
advantage. A step then has more rows than ``data.batch_size * rollout.n``; the producer fills
it up to whole mini-batches (:func:`rlframe.rollout.agents.fill_mini_batches`), and the
trainer takes the old log-probs in a pass of their own, since the update is then more than
one mini-batch. DAPO's dynamic sampling keeps groups of ``rollout.n`` rows, so it refuses
forked rows.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from typing import Any, cast

from rlframe.agent_server.app import AgentServer
from rlframe.agent_server.sessions import Session
from rlframe.agent_server.trajectory import Episode
from rlframe.core.protocol import Batch
from rlframe.core.registry import load_function
from rlframe.envs import EnvError
from rlframe.envs.runner import CallOutcome, run_env_calls
from rlframe.rollout.agents import AgentContext
from rlframe.rollout.multi_turn import build_samples
from rlframe.rollout.rows import AgentStats, TokenRow, read_prompt_rows

SERVER = "openai_server"


def get_server(ctx: AgentContext) -> AgentServer:
    """The run's server, started on the first batch."""
    if SERVER not in ctx.resources:
        server = AgentServer(ctx.config, ctx.turns, ctx.tokenizer, ctx.config.model.path)
        server.start()
        ctx.resources[SERVER] = server
        print(f"rlframe: {server.describe()}", file=sys.stderr, flush=True)
    return cast(AgentServer, ctx.resources[SERVER])  # stored by this function only


def as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return float(value)
    raise TypeError(f"the agent returned {value!r:.100}, not a number or None")


def run_openai_episodes(prompts: Batch, ctx: AgentContext) -> list[TokenRow]:
    """The ``openai`` agent (picked by :func:`rlframe.agent_server.pick_agent`); see the
    module docstring."""
    server = get_server(ctx)
    server.sample_like(prompts.meta)
    ctx.turns.open()
    if "openai_entry" not in ctx.resources:
        ctx.resources["openai_entry"] = load_function(ctx.config.agent.entry)
    entry = ctx.resources["openai_entry"]
    stop_ids = {int(t) for t in prompts.meta["stop_token_ids"]}
    samples = build_samples(prompts)
    sessions = [
        server.sessions.open(s, int(seed), Episode(ctx.tokenizer, stop_ids, server.formats))
        for s, seed in zip(samples, prompts.column("seed"))
    ]
    calls = [(closing(entry, server, s.key), (server.base_url, s.key, s.sample)) for s in sessions]
    agent = ctx.config.agent
    try:
        outcomes = run_env_calls(
            calls, agent.step_timeout_s, agent.max_concurrent_envs, agent.max_stuck_calls
        )
    finally:
        for s in sessions:
            server.sessions.close(s.key)
            ctx.turns.end_session(s.key)
    rows = assemble(prompts, ctx, sessions, outcomes)
    if len(rows) > len(prompts) and ctx.config.algorithm.dynamic_sampling:
        raise EnvError(
            f"agent {agent.entry} rewrote its history ({len(rows)} rows from {len(prompts)} "
            "episodes): algorithm.dynamic_sampling needs one row per episode"
        )
    return rows


def closing(entry: Callable[..., Any], server: AgentServer, key: str) -> Callable[..., Any]:
    """``entry`` that ends its session when it returns or raises: the batcher then waits for
    no more calls from it (an abandoned sync call's session ends with the batch)."""
    if inspect.iscoroutinefunction(entry):

        async def run_async(*args: Any) -> Any:
            try:
                return await entry(*args)
            finally:
                server.sessions.close(key)

        return run_async

    def run(*args: Any) -> Any:
        try:
            return entry(*args)
        finally:
            server.sessions.close(key)

    return run


def episode_result(outcome: CallOutcome, row: int, ctx: AgentContext) -> tuple[float, bool, bool]:
    """(reward, whether the agent gave it, whether the episode failed)."""
    error = outcome.error
    reward = None
    if error is None:
        try:
            reward = as_reward(outcome.value)
        except TypeError as e:
            error = str(e)
    if error is not None:
        if ctx.config.agent.on_env_error == "raise":
            raise EnvError(
                f"agent {ctx.config.agent.entry} failed on sample {row}: {error}. Set "
                "agent.on_env_error=mask to leave such episodes out of training and go on."
            )
        return 0.0, True, True
    return (reward or 0.0), reward is not None, False


def assemble(
    prompts: Batch, ctx: AgentContext, sessions: list[Session], outcomes: list[CallOutcome]
) -> list[TokenRow]:
    """One row per chain of calls (at least one per episode), each naming its episode's
    prompt row as its ``source``."""
    rows: list[TokenRow] = []
    for i, (session, outcome) in enumerate(zip(sessions, outcomes)):
        reward, given, failed = episode_result(outcome, i, ctx)
        episode = session.episode
        for row in episode.rows or [empty_row(prompts, i)]:
            row.source = i
            row.agent = AgentStats(
                env_reward=reward * (1 - failed),
                env_failed=float(failed),
                agent_reward_given=float(given),
                agent_episode=i,
                agent_turns=float(row.turns),
                agent_tool_calls=float(episode.tool_calls),
                agent_tool_errors=float(episode.tool_errors),
                agent_obs_tokens=float(len(row.response_ids) - row.sampled),
            )
            row.prompt = ctx.tokenizer.decode(row.prompt_ids, skip_special_tokens=False)
            rows.append(row)
    return rows


def empty_row(prompts: Batch, i: int) -> TokenRow:
    """An episode that made no call: the loader's prompt and an empty response."""
    row = read_prompt_rows(prompts.rows([i]))[0]
    row.finish_reason = "env_error"
    return row
