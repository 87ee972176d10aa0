"""Environments for multi-turn rollouts: the protocol, the registry, tools and built-ins.

Importing the package registers the built-in environments (``calculator``, ``guess_number``,
``slow_guess``, ``colour_quiz``) and tool-call parsers (``hermes`` / ``qwen``).
"""

from rlframe.envs import (  # noqa: F401  (registers the built-ins)
    calculator,
    colour_quiz,
    guess,
    slow_guess,
)
from rlframe.envs.base import (
    ENVS,
    Env,
    EnvError,
    Message,
    StepResult,
    build_env_factory,
    default_messages,
    get_tools,
)
from rlframe.envs.chat import ChatFormat
from rlframe.envs.tool_parsers import TOOL_PARSERS, ParsedTurn, ToolCall
from rlframe.envs.tools import ToolEnv, build_tool_schema

__all__ = [
    "ENVS",
    "TOOL_PARSERS",
    "ChatFormat",
    "Env",
    "EnvError",
    "Message",
    "ParsedTurn",
    "StepResult",
    "ToolCall",
    "ToolEnv",
    "build_env_factory",
    "build_tool_schema",
    "default_messages",
    "get_tools",
]
