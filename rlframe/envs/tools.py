"""Tools from plain Python functions, and ``ToolEnv``: an environment that runs them.

A tool is a function with type hints and a Google-style docstring; its JSON schema (what
the chat template shows the model through ``tools=``) is read from both::

    def calculate(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: e.g. "(3 + 4) * 12".
        \"\"\"
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from rlframe.envs.base import Message, StepResult, default_messages
from rlframe.envs.tool_parsers import TOOL_PARSERS, ParsedTurn, ToolCall

JSON_TYPES: dict[type, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    dict: "object",
    list: "array",
}


def describe_type(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema of a type hint: str/int/float/bool, list[X], dict[str, X], Literal[...],
    and ``X | None`` (an optional argument)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in JSON_TYPES:
        return {"type": JSON_TYPES[hint]}
    if origin is Literal:
        return {"type": JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (list, tuple):
        return (
            {"type": "array", "items": describe_type(args[0], where)} if args else {"type": "array"}
        )
    if origin is dict:
        return (
            {"type": "object", "additionalProperties": describe_type(args[1], where)}
            if args
            else {"type": "object"}
        )
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return describe_type(kept[0], where)
        return {"anyOf": [describe_type(a, where) for a in kept]}
    raise TypeError(
        f"{where}: type {hint!r} has no JSON schema; use str, int, float, bool, list, dict or "
        "Literal"
    )


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {argument: description}) from a Google-style docstring."""
    lines = doc.splitlines()
    description: list[str] = []
    arguments: dict[str, str] = {}
    section = "description"
    current = None
    indent = 99  # an argument line is one indented no deeper than the previous argument
    for line in lines:
        stripped = line.strip()
        if re.fullmatch(r"(Args|Arguments|Parameters):", stripped):
            section = "args"
            continue
        if re.fullmatch(r"[A-Z][a-z]+( [a-z]+)?:", stripped):
            section = "other"
            continue
        if section == "description":
            if not stripped and description:
                section = "after"
            elif stripped:
                description.append(stripped)
        elif section == "args" and stripped:
            match = re.match(r"(\w+)\s*(\([^)]*\))?:\s*(.*)", stripped)
            if match and (current is None or len(line) - len(line.lstrip()) <= indent):
                current = match.group(1)
                indent = len(line) - len(line.lstrip())
                arguments[current] = match.group(3)
            elif current is not None:
                arguments[current] = f"{arguments[current]} {stripped}".strip()
    return " ".join(description), arguments


def build_tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The function-calling schema of ``fn`` (OpenAI / Hugging Face ``tools=`` format)."""
    name = fn.__name__
    hints = typing.get_type_hints(fn)
    description, argument_docs = parse_docstring(inspect.getdoc(fn) or "")
    if not description:
        raise ValueError(
            f"tool {name}: give it a docstring; its first paragraph tells the model what it does"
        )
    properties: dict[str, Any] = {}
    required = []
    for arg, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {name}: *args / **kwargs have no schema; name every argument")
        if arg not in hints:
            raise ValueError(f"tool {name}: argument {arg!r} needs a type hint")
        schema = describe_type(hints[arg], f"tool {name} argument {arg!r}")
        if arg in argument_docs:
            schema["description"] = argument_docs[arg]
        properties[arg] = schema
        if param.default is inspect.Parameter.empty:
            required.append(arg)
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def format_result(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


class ToolEnv:
    """An environment whose actions are tool calls.

    Each model turn is parsed for tool calls (``parser``, default Hermes/Qwen
    ``<tool_call>{json}</tool_call>``). Calls run in order and their results (or errors) come
    back as ``tool`` messages; a turn without any call is the final answer and ends the
    episode, scored by :meth:`score_answer` (0 here: leave it to ``reward.fn``, or override).

    Args:
        tools: plain Python functions (type hints + docstring).
        parser: a registered tool-call parser or ``pkg.module:function``.
        max_calls_per_turn: calls beyond this in one turn are answered with an error.
        system_prompt: prepended as a system message when the sample has none.
    """

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        parser: str = "hermes",
        max_calls_per_turn: int = 4,
        system_prompt: str | None = None,
    ) -> None:
        self.functions = {fn.__name__: fn for fn in tools}
        self.tools = [build_tool_schema(fn) for fn in tools]
        self.parse: Callable[[str], ParsedTurn] = TOOL_PARSERS.get(parser)
        self.max_calls_per_turn = max_calls_per_turn
        self.system_prompt = system_prompt
        self.sample: dict[str, Any] = {}

    def reset(self, sample: dict[str, Any]) -> list[Message]:
        self.sample = sample
        messages = default_messages(sample)
        if self.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, action: str) -> StepResult:
        parsed = self.parse(action)
        if not parsed.has_calls:
            return StepResult(
                [], self.score_answer(action), True, {"tool_calls": 0, "tool_errors": 0}
            )
        messages = [{"role": "tool", "content": f"error: {error}"} for error in parsed.errors]
        errors = len(parsed.errors)
        for i, call in enumerate(parsed.calls):
            if i >= self.max_calls_per_turn:
                text, ok = (
                    f"error: more than {self.max_calls_per_turn} tool calls in one turn",
                    False,
                )
            else:
                text, ok = self.call_tool(call)
            messages.append({"role": "tool", "name": call.name, "content": text})
            errors += not ok
        calls = len(parsed.calls) + len(parsed.errors)
        return StepResult(messages, 0.0, False, {"tool_calls": calls, "tool_errors": errors})

    def call_tool(self, call: ToolCall) -> tuple[str, bool]:
        """(result text, whether the call succeeded). Errors go back to the model as text."""
        fn = self.functions.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; tools: {sorted(self.functions)}", False
        try:
            return format_result(fn(**call.arguments)), True
        except Exception as e:  # the model's arguments are untrusted input
            return f"error: {type(e).__name__}: {e}", False

    def score_answer(self, action: str) -> float:
        """Env reward for the final (tool-free) turn; override to score answers in the env."""
        return 0.0
