"""Tool calls that go wrong, by value: every malformed call and every failing call gets its
own ``error:`` tool message, in order, and is counted as a call and as an error."""

from __future__ import annotations

from rlframe.envs import TOOL_PARSERS, ToolEnv
from rlframe.envs.tool_parsers import ParsedTurn, ToolCall


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: first.
        b: second.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: numerator.
        b: denominator.
    """
    return a / b


def call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def test_malformed_calls_get_an_error_reply_each() -> None:
    env = ToolEnv([add])
    obs, reward, done, info = env.step(
        call("{not json}") + call("[1, 2]") + call('{"name": "add", "arguments": [1]}')
    )
    assert (reward, done) == (0.0, False)
    assert obs == [
        {
            "role": "tool",
            "content": "error: tool call is not valid JSON (Expecting property name enclosed "
            "in double quotes at char 1): {not json}",
        },
        {"role": "tool", "content": "error: tool call needs a string 'name': [1, 2]"},
        {
            "role": "tool",
            "content": "error: tool call 'add': 'arguments' must be an object, got [1]",
        },
    ]
    assert info == {"tool_calls": 3, "tool_errors": 3}


def test_errors_come_first_then_results_in_call_order() -> None:
    env = ToolEnv([add, divide], max_calls_per_turn=3)
    obs, _, done, info = env.step(
        call('{"name": "add", "arguments": {"a": 2, "b": 3}}')
        + call('{"name": 5}')
        + call('{"name": "divide", "arguments": {"a": 1, "b": 0}}')
        + call('{"name": "add", "arguments": {"a": 1}}')
        + call('{"name": "add", "arguments": {"a": 1, "b": 1}}')
    )
    assert not done
    assert obs == [
        {"role": "tool", "content": "error: tool call needs a string 'name': {\"name\": 5}"},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "divide", "content": "error: ZeroDivisionError: division by zero"},
        {
            "role": "tool",
            "name": "add",
            "content": "error: TypeError: add() missing 1 required positional argument: 'b'",
        },
        {"role": "tool", "name": "add", "content": "error: more than 3 tool calls in one turn"},
    ]
    assert info == {"tool_calls": 5, "tool_errors": 4}


def test_unknown_tool_lists_the_tools() -> None:
    obs, _, _, info = ToolEnv([divide, add]).step(call('{"name": "mul", "arguments": {}}'))
    assert obs == [
        {
            "role": "tool",
            "name": "mul",
            "content": "error: unknown tool 'mul'; tools: ['add', 'divide']",
        }
    ]
    assert info == {"tool_calls": 1, "tool_errors": 1}


def test_exactly_max_calls_run_and_results_are_json_or_text() -> None:
    def echo(x: str) -> str:
        """Echo.

        Args:
            x: text.
        """
        return x

    env = ToolEnv([add, echo], max_calls_per_turn=2)
    obs, _, _, info = env.step(
        call('{"name": "add", "arguments": {"a": 1, "b": 2}}')
        + call('{"name": "echo", "arguments": "{\\"x\\": \\"hi\\"}"}')
    )
    assert [m["content"] for m in obs] == ["3", "hi"]
    assert info == {"tool_calls": 2, "tool_errors": 0}


def test_a_turn_of_only_malformed_calls_is_not_a_final_answer() -> None:
    env = ToolEnv([add])
    assert env.step(call("")).done is False
    assert env.step("no call here").done is True
    parsed = TOOL_PARSERS.get("hermes")(call('{"name": "add", "arguments": {"a": 1, "b": 2}}'))
    assert parsed == ParsedTurn([ToolCall("add", {"a": 1, "b": 2})], [])
    assert TOOL_PARSERS.get("hermes")("plain text") == ParsedTurn([], [])
    assert not ParsedTurn().has_calls and ParsedTurn([], ["x"]).has_calls
