"""The ``agent`` section: multi-turn episodes against an environment (``rollout.agent``).

The agent itself is chosen by ``rollout.agent`` (single_turn, multi_turn, or a user's
function); this section sets the environment and the limits of an episode. Names and paths
are resolved and checked by :mod:`rlframe.run.preflight`, before Ray starts.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from rlframe.config.checks import require, require_choice, require_positive
from rlframe.core.registry import absolutize

ENV_ERROR_POLICIES = ("raise", "mask", "fail_episode")
"""``agent.on_env_error``: stop the run, leave the episode out of training, or score it 0."""


@dataclass
class AgentConfig:
    env: str = ""
    """Environment for ``rollout.agent=multi_turn``: a registered name (calculator,
    guess_number, colour_quiz) or ``pkg.module:factory`` / ``path/to/file.py:factory``."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment factory (one environment per trajectory)."""
    max_turns: int = 4
    """Model turns per episode; the episode ends after this many even if the env goes on."""
    max_tokens_per_turn: int = 0
    """Cap on one turn's sampled tokens; 0: a turn may use all that is left of
    ``rollout.max_tokens`` (the episode's budget of sampled tokens)."""
    close_cut_turns: bool = False
    """A turn that reaches ``agent.max_tokens_per_turn`` without its end-of-turn token: false
    ends the episode there; true closes the turn with the end-of-turn token (not sampled, so
    loss mask 0) and goes on with the observation."""
    max_obs_tokens: int = 256
    """Longest observation (the chat template's tokens between two model turns); longer
    tool results are cut to fit."""
    step_timeout_s: float = 60.0
    """Longest wait for one env step (or reset)."""
    on_env_error: str = "raise"
    """An env that raises or times out: ``raise`` stops the run with an error naming the env
    and the sample; ``mask`` ends that episode and takes it out of training (out of its
    group's statistics, the loss and the loss's token counts; a group left with fewer than 2
    episodes is replaced), its rate logged as ``agent/masked``; ``fail_episode`` ends it with
    reward 0, a wrong answer in its group (which biases GRPO-style advantages). Both count it
    in ``agent/env_failures``. A failed env call is never retried: it may have changed the
    env's state."""
    env_reward_weight: float = 1.0
    """Score = env_reward_weight * (sum of the env's step rewards) + rule_reward_weight *
    (the ``reward.fn`` score of the decoded response)."""
    rule_reward_weight: float = 1.0
    """Weight of the rule reward (``reward.fn``) in a multi-turn score; 0 leaves the env alone."""
    max_concurrent_envs: int = 256
    """Env steps of one turn that run at once (threads for sync envs, tasks for async ones);
    for ``rollout.agent=openai``: episodes that run at once."""
    max_stuck_calls: int = 256
    """Sync env or agent calls abandoned at ``agent.step_timeout_s`` that may still be running
    (a thread cannot be stopped; ``agent/stuck_calls``); past it the run stops with an
    error. Async calls are cancelled at their timeout and never count."""
    max_rows_per_episode: int = 8
    """Training rows one ``rollout.agent=openai`` episode may make (a call that does not
    extend an earlier conversation of the episode starts a row); past it the call gets
    HTTP 400 (``agent/rows_per_episode/max``)."""
    entry: str = ""
    """The agent of ``rollout.agent=openai``: ``pkg.module:fn`` or ``path/to/file.py:fn``,
    sync or async, called as ``fn(base_url, api_key, sample)`` once per episode; returns the
    episode's reward, or None for ``reward.fn`` to score it. ``agent.step_timeout_s`` bounds
    the whole episode."""
    server_host: str = "127.0.0.1"
    """Address the OpenAI-compatible server binds (``rollout.agent=openai``); the default
    keeps it unreachable from other machines. Any other than a loopback address needs
    ``agent.server_allow_remote=true``."""
    server_allow_remote: bool = False
    """Allow ``agent.server_host`` to be reachable from other machines (0.0.0.0, a LAN
    address): anyone who can reach it can open connections, and only an episode's key
    guards its calls."""
    server_port: int = 0
    """Port of the server; 0: an ephemeral port chosen by the OS (printed at start)."""
    server_header_timeout_s: float = 10.0
    """Longest a connection may take to send a request's headers, from its opening or from
    its previous response; it is then closed."""
    server_body_timeout_s: float = 30.0
    """Longest a request's body may take to arrive once its headers have (HTTP 408)."""
    server_max_connections: int = 1024
    """Open connections the server holds (at most half the file descriptors the process has
    left): past it, the oldest one with no request in progress is closed."""
    tool_parser: str = "hermes"
    """Tool-call parser for the server's replies (:mod:`rlframe.envs.tool_parsers`)."""
    max_pending_requests: int = 1024
    """Requests the server holds at once; more get HTTP 429."""
    max_request_bytes: int = 4 * 1024 * 1024
    """Largest request body; larger ones get HTTP 413."""

    def __post_init__(self) -> None:
        # The name is checked against the registry by rlframe.run.preflight.
        self.env = absolutize(self.env) if self.env else ""
        require(self.max_turns >= 1, "agent.max_turns", f"must be >= 1, got {self.max_turns}")
        for key, value in (
            ("max_tokens_per_turn", self.max_tokens_per_turn),
            ("env_reward_weight", self.env_reward_weight),
            ("rule_reward_weight", self.rule_reward_weight),
        ):
            require(value >= 0, f"agent.{key}", f"must be >= 0, got {value}")
        require_positive(self.max_obs_tokens, "agent.max_obs_tokens")
        require_positive(self.step_timeout_s, "agent.step_timeout_s")
        require_choice(self.on_env_error, ENV_ERROR_POLICIES, "agent.on_env_error")
        require_positive(self.max_concurrent_envs, "agent.max_concurrent_envs")
        require_positive(self.max_stuck_calls, "agent.max_stuck_calls")
        require_positive(self.max_rows_per_episode, "agent.max_rows_per_episode")
        self.entry = absolutize(self.entry) if self.entry else ""
        require(
            0 <= self.server_port < 65536,
            "agent.server_port",
            f"must be in [0, 65535], got {self.server_port}",
        )
        require_positive(self.max_pending_requests, "agent.max_pending_requests")
        require_positive(self.server_header_timeout_s, "agent.server_header_timeout_s")
        require_positive(self.server_body_timeout_s, "agent.server_body_timeout_s")
        require_positive(self.server_max_connections, "agent.server_max_connections")
        require(
            self.server_allow_remote or is_loopback(self.server_host),
            "agent.server_host",
            f"{self.server_host} is reachable from other machines, where anyone can flood "
            "the endpoint; set agent.server_allow_remote=true if that is meant",
        )
        require_positive(self.max_request_bytes, "agent.max_request_bytes")


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def url_host(host: str) -> str:
    """``host`` as a URL names it: an IPv6 address in brackets (``[::1]``), anything else as
    it is."""
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a host name
        return host


def is_multi_turn(agent: str) -> bool:
    """Whether ``rollout.agent`` interleaves observations with sampled tokens (anything but
    single_turn: a user's agent may, so its responses get the multi-turn width)."""
    return agent != "single_turn"


def compute_response_width(max_tokens: int, agent: str, cfg: AgentConfig) -> int:
    """Columns of ``response_ids``: the sampled-token budget, plus room for an observation
    between each two turns when the agent is multi-turn."""
    if not is_multi_turn(agent):
        return max_tokens
    return max_tokens + (cfg.max_turns - 1) * cfg.max_obs_tokens
