"""Tool-call parsers: the model's turn text -> the tool calls in it.

A parser returns a :class:`ParsedTurn`: the calls it found and the errors of malformed ones
(an error goes back to the model as a tool message, so it can learn the format). Register
your own with ``@TOOL_PARSERS.register("name")`` or name it by path in the env's kwargs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlframe.core.registry import Registry


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call."""

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedTurn]
TOOL_PARSERS: Registry[ToolParser] = Registry("tool-call parser")

HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@TOOL_PARSERS.register("hermes")
@TOOL_PARSERS.register("qwen")
def parse_hermes_tool_calls(text: str) -> ParsedTurn:
    """Hermes / Qwen2.5 / Qwen3 format:
    ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one JSON object per tag, any
    number of tags. An unclosed last tag is parsed too (the turn may have stopped at the
    end-of-turn token right after the JSON)."""
    parsed = ParsedTurn()
    for body in HERMES_CALL.findall(text):
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            parsed.errors.append(
                f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body.strip()[:200]}"
            )
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            parsed.errors.append(f"tool call needs a string 'name': {body.strip()[:200]}")
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments JSON-encoded
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            parsed.errors.append(
                f"tool call {call['name']!r}: 'arguments' must be an object, got {arguments!r:.100}"
            )
            continue
        parsed.calls.append(ToolCall(call["name"], arguments))
    return parsed
