"""What the OpenAI-compatible endpoint accepts in a request, and its errors in OpenAI's
shape: :class:`APIError` (status, message, code, parameter), :func:`error_response`, and the
checks of a chat-completions body (:func:`check_params`) that turn a malformed request into a
400 before it reaches the engine."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

ACCEPTED = {
    "model", "messages", "tools", "tool_choice", "temperature", "max_tokens",
    "max_completion_tokens", "stop", "n", "stream", "seed", "user", "top_p",
    "parallel_tool_calls", "metadata", "store",
}  # fmt: skip
ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error"}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
              413: "request_too_large", 431: "request_header_fields_too_large"}  # fmt: skip


def error_type(status: int) -> str:
    """OpenAI's ``error.type`` for an HTTP status: every other 4xx is the request's fault."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_response(status: int, message: str, code: str, param: str | None = None) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code,
        }
    }
    response = web.json_response(body, status=status)
    if status == 408:  # the rest of a body that never came is not worth waiting for
        response.force_close()
    return response


MAX_JSON_DEPTH = 64
"""The deepest nesting of arrays and objects a body may have: a tool's JSON schema is a few
levels deep; 100,000 levels would exhaust the parser's (and later the template's) recursion."""


def measure_depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = (
            node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth > MAX_JSON_DEPTH:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def is_finite_number(value: Any) -> bool:
    """A JSON number (not a bool) that is a finite float: an integer of thousands of digits
    is not (float() overflows)."""
    if type(value) not in (int, float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def check_params(body: Any, temperature: float, top_p: float) -> None:
    """A chat-completions body the server can answer: known parameters, sampling the run's
    own (the trainer's log-probs assume it), well-formed messages, tools and stop strings;
    raise :class:`APIError` (a 400) naming the parameter otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_request")
    for key in body:
        if key not in ACCEPTED:
            raise APIError(400, f"unsupported parameter {key!r}", "unsupported_parameter", key)
    if body.get("n", 1) not in (1, None):
        raise APIError(400, "only n=1 is supported", "unsupported_parameter", "n")
    if body.get("stream"):
        raise APIError(400, "streaming is not supported", "unsupported_parameter", "stream")
    for key, value in (("temperature", temperature), ("top_p", top_p)):
        given = body.get(key)
        if given is not None and not is_finite_number(given):
            raise APIError(400, f"{key} must be a number", "invalid_request", key)
        if given is not None and abs(float(given) - value) > 1e-6:
            raise APIError(
                400, f"{key}={given} differs from the run's rollout.{key}={value}, which "
                "the trainer's log-probs assume", "unsupported_parameter", key,
            )  # fmt: skip
    for key in ("max_tokens", "max_completion_tokens"):
        cap = body.get(key)
        if cap is not None and (type(cap) is not int or cap < 1):
            raise APIError(400, f"{key} must be a positive integer", "invalid_request", key)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "invalid_request", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise APIError(400, "every message needs a 'role'", "invalid_request", "messages")
    for m in messages:
        check_content(m.get("content"))
        check_tool_calls(m.get("tool_calls"))
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise APIError(400, "'tools' must be a list of objects", "invalid_request", "tools")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(x, str) for x in stop))
    ):
        raise APIError(
            400, "'stop' must be a string or a list of strings", "invalid_request", "stop"
        )


def check_content(content: Any) -> None:
    """A message's ``content``: text, null (an assistant turn of tool calls), or a list of
    content parts (objects; their ``text`` is read)."""
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return
    raise APIError(
        400, "a message's 'content' must be a string, null or a list of content parts "
        f"(objects), got {type(content).__name__}", "invalid_request", "messages",
    )  # fmt: skip


def check_tool_calls(calls: Any) -> None:
    """A message's ``tool_calls``: absent, or a list of ``{"function": {"name": str,
    "arguments": str | object}}`` (what the chat template reads)."""
    if calls is None:
        return
    bad = APIError(
        400, "'tool_calls' must be a list of {'id', 'type', 'function': {'name', 'arguments'}}",
        "invalid_request", "messages",
    )  # fmt: skip
    if not isinstance(calls, list):
        raise bad
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad
        if not isinstance(function.get("arguments", {}), str | dict):
            raise bad
