"""The preflight checks of the agent (:mod:`rlframe.run.preflight` runs them while the workers
start): ``rollout.agent`` loads; ``rollout.agent=openai`` has an entry function that loads
(its fixed server port is checked free before Ray, :func:`check_server_port`); a multi-turn
``agent.env`` builds and its observations fit the model's chat template. Each failure is a
:class:`~rlframe.config.ConfigError` naming the key.
"""

from __future__ import annotations

import inspect
import socket

from rlframe.config import Config, ConfigError
from rlframe.config.agent import url_host
from rlframe.config.checks import describe_load_error
from rlframe.core.tokenizer import Tokenizer


def check_agent(cfg: Config, tokenizer: Tokenizer) -> None:
    """``rollout.agent`` loads (with ``openai``, :func:`check_openai_entry`); for multi_turn,
    :func:`check_env`."""
    from rlframe.agent_server import pick_agent

    try:
        agent = pick_agent(cfg.rollout.agent)
    except Exception as e:
        raise ConfigError("rollout.agent", describe_load_error(e)) from None
    if returns_batch(agent):
        raise ConfigError(
            "rollout.agent",
            f"{cfg.rollout.agent} is declared to return a Batch: an agent returns its rows "
            "(list[rlframe.rollout.rows.TokenRow]) and the run collates them; see "
            "docs/agents.md, 'Your own agent'",
        )
    if cfg.rollout.agent == "openai":
        check_openai_entry(cfg)
    if cfg.agent.env:
        check_env(cfg, tokenizer)


def returns_batch(agent: object) -> bool:
    """Whether ``agent``'s return annotation names a Batch (the contract before rows); an
    agent without one is checked at its first batch."""
    annotation = inspect.signature(agent).return_annotation  # type: ignore[arg-type]
    name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return name.rsplit(".", 1)[-1] == "Batch"


def check_env(cfg: Config, tokenizer: Tokenizer) -> None:
    """``agent.env`` loads, one env builds from ``agent.env_kwargs``, and the chat template can
    place an observation after a model turn."""
    from rlframe.envs import ENVS, ChatFormat, EnvError, get_tools

    try:
        factory = ENVS.get(cfg.agent.env)
    except Exception as e:
        raise ConfigError("agent.env", describe_load_error(e)) from None
    try:
        env = factory(**cfg.agent.env_kwargs)
    except Exception as e:
        raise ConfigError(
            "agent.env_kwargs",
            f"{cfg.agent.env} cannot be built with {cfg.agent.env_kwargs}: {type(e).__name__}: {e}",
        ) from None
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(
                "agent.env",
                f"{cfg.agent.env} builds a {type(env).__name__}, which has no {method}() method",
            )
    try:
        ChatFormat(tokenizer, tools=get_tools(env)).observation_ids(
            [{"role": "user", "content": "x"}], cfg.agent.max_obs_tokens
        )
    except EnvError as e:
        raise ConfigError(
            "agent.env", f"the model's chat template cannot carry observations: {e}"
        ) from None
    except Exception as e:  # a template may reject a role or the tools
        raise ConfigError(
            "agent.env",
            f"the model's chat template fails on an observation message: {type(e).__name__}: {e}",
        ) from None


def check_openai_entry(cfg: Config) -> None:
    """``rollout.agent=openai`` needs ``agent.entry``, a function that loads."""
    from rlframe.core.registry import load_function

    if not cfg.agent.entry:
        raise ConfigError("agent.entry", "rollout.agent=openai needs the agent's function")
    try:
        load_function(cfg.agent.entry)
    except Exception as e:
        raise ConfigError("agent.entry", describe_load_error(e)) from None


def check_server_port(host: str, port: int) -> None:
    """A fixed ``agent.server_port`` is free on ``agent.server_host`` (0: the OS picks one)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ConfigError(
                "agent.server_port",
                f"cannot listen on {url_host(host)}:{port}: {e.strerror or e}",
            ) from None
