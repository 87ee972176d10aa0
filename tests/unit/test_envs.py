"""Environments: the tool-call parser, tool schemas, ToolEnv, the built-in envs, chat suffixes."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.envs import ENVS, TOOL_PARSERS, ChatFormat, EnvError, ToolEnv, build_tool_schema
from rlframe.envs.calculator import CalculatorEnv, calculate
from rlframe.envs.guess import GuessNumberEnv
from tests.unit.chatml_tokenizer import build_chatml_tokenizer


def test_hermes_parser_finds_every_call_and_reports_malformed_ones() -> None:
    parse = TOOL_PARSERS.get("hermes")
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": '
        '"2+3"}}\n</tool_call>\n'
        '<tool_call>{"name": "calculate", "arguments": "{\\"expression\\": \\"4*5\\"}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    parsed = parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculate", {"expression": "2+3"}),
        ("calculate", {"expression": "4*5"}),
    ]
    assert (
        len(parsed.errors) == 2
        and "not valid JSON" in parsed.errors[0]
        and "'name'" in parsed.errors[1]
    )
    assert not parse("The answer is 5.").has_calls
    # A turn that stopped right after the JSON (no closing tag) still counts.
    assert parse('<tool_call>{"name": "f", "arguments": {}}').calls[0].name == "f"
    assert TOOL_PARSERS.get("qwen") is parse


def lookup(
    city: str, units: Literal["metric", "imperial"] = "metric", days: list[int] | None = None
) -> dict:
    """Look up the weather.

    Longer explanation that is not part of the description.

    Args:
        city: the city's name,
            as written locally.
        units: unit system.
        days: days ahead.

    Returns:
        The forecast.
    """
    return {"city": city, "units": units, "days": days}


def test_tool_schema_from_signature_and_docstring() -> None:
    schema = build_tool_schema(lookup)
    assert schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the weather.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {
                        "type": "string",
                        "description": "the city's name, as written locally.",
                    },
                    "units": {
                        "type": "string",
                        "enum": ["metric", "imperial"],
                        "description": "unit system.",
                    },
                    "days": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "days ahead.",
                    },
                },
                "required": ["city"],
            },
        },
    }

    def no_hints(x):  # noqa: ANN001, ANN202
        """Doc."""

    with pytest.raises(ValueError, match="argument 'x' needs a type hint"):
        build_tool_schema(no_hints)


def test_tool_env_runs_calls_and_reports_errors() -> None:
    env = ToolEnv([lookup, calculate], max_calls_per_turn=2)
    assert [t["function"]["name"] for t in env.tools] == ["lookup", "calculate"]
    assert env.reset({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}) == [
        {"role": "user", "content": "hi"}
    ]
    obs, reward, done, info = env.step(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "(2+3)*4"}}</tool_call>'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    )
    assert not done and reward == 0
    assert obs[0] == {"role": "tool", "name": "calculate", "content": "20"}
    assert obs[1]["content"].startswith("error: unknown tool 'nope'")
    assert info == {"tool_calls": 2, "tool_errors": 1}
    obs, _, _, info = env.step(
        '<tool_call>{"name": "calculate", "arguments": {"expression": "import os"}}</tool_call>'
    )
    assert obs[0]["content"].startswith("error: ") and info["tool_errors"] == 1
    obs, _, _, info = env.step(
        '<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call>' * 3
    )
    assert json.loads(obs[0]["content"]) == {"city": "Oslo", "units": "metric", "days": None}
    assert obs[2]["content"].startswith("error: more than 2 tool calls") and info == {
        "tool_calls": 3,
        "tool_errors": 1,
    }
    # No call: the final answer, which ends the episode.
    assert env.step("It is 20.") == ([], 0.0, True, {"tool_calls": 0, "tool_errors": 0})


def test_calculator_is_safe_and_scores_answers_when_asked() -> None:
    assert calculate("2 ** 10 - 24 / 4") == "1018"
    assert calculate("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 1000", "[1, 2]", "x + 1"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = CalculatorEnv(answer_reward=1.0)
    messages = env.reset(
        {"prompt": "q", "messages": [{"role": "user", "content": "q"}], "ground_truth": "#### 18"}
    )
    assert messages[0]["role"] == "system" and messages[1]["content"] == "q"
    assert env.step("so #### 18").reward == 1.0 and env.step("#### 17").reward == 0.0
    assert CalculatorEnv().step("#### 18").reward == 0.0  # answer scoring left to reward.fn
    assert ENVS.get("calculator") is CalculatorEnv


def test_tool_env_keeps_the_conversation_s_own_system_prompt() -> None:
    """The env's system prompt opens a conversation that has none; a conversation with its
    own keeps that one alone (two system messages confuse chat templates)."""
    env = ToolEnv([lookup], system_prompt="Use the tools.")
    own = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "q"}]
    assert env.reset({"prompt": "q", "messages": own}) == own
    assert env.reset({"prompt": "q"}) == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "q"},
    ]


def test_guess_number_gives_higher_lower_feedback() -> None:
    env = GuessNumberEnv(hint_format=" {hint}:")
    env.reset({"prompt": "guess 0-9:", "ground_truth": "6"})
    assert env.step("3") == ([{"role": "user", "content": " higher:"}], 0.0, False, {})
    assert env.step(" 8 maybe").observation == [{"role": "user", "content": " lower:"}]
    assert env.step("x").observation == [{"role": "user", "content": " invalid:"}]
    assert env.step("6") == ([], 1.0, True, {})


def test_observation_suffix_aligns_at_the_end_of_turn_token() -> None:
    """prompt ids + sampled ids + observation ids == the template's ids of the whole
    conversation."""
    tokenizer = build_chatml_tokenizer()
    env = CalculatorEnv(system_prompt="Be brief.")
    chat = ChatFormat(tokenizer, tools=env.tools)
    opening = env.reset(
        {"prompt": "What is 2+3?", "messages": [{"role": "user", "content": "What is 2+3?"}]}
    )
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2+3"}}\n</tool_call>'
    answer = "It is 5.\n#### 5"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    observation = env.step(call).observation
    obs_ids, cut = chat.observation_ids(observation, 100)
    ids = (
        chat.prompt_ids(opening) + chat.encode(call) + [end] + obs_ids + chat.encode(answer) + [end]
    )
    whole = opening + [
        {"role": "assistant", "content": call},
        *observation,
        {"role": "assistant", "content": answer},
    ]
    expected = chat.encode(chat.render(whole, add_generation_prompt=False))
    # The template writes a newline after the last <|im_end|>; the sampled ids stop at it.
    assert not cut and ids == expected[: len(ids)] and expected[len(ids) :] == chat.encode("\n")
    assert tokenizer.decode(obs_ids).startswith("\n<|im_start|>user\n<tool_response>\n5\n")
    assert tokenizer.decode(obs_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_plain_template_for_tokenizers_without_one() -> None:
    tokenizer = build_tiny_tokenizer()
    chat = ChatFormat(tokenizer)
    assert chat.prompt_ids([{"role": "user", "content": "guess 0-9:"}]) == chat.encode("guess 0-9:")
    ids, _ = chat.observation_ids([{"role": "user", "content": " higher:"}], 16)
    assert ids == chat.encode(" higher:") and chat.end_of_turn == "<eos>"


def test_long_observations_are_cut_to_fit_and_tiny_limits_are_refused() -> None:
    tokenizer = build_chatml_tokenizer()
    chat = ChatFormat(tokenizer)
    ids, cut = chat.observation_ids([{"role": "tool", "content": "9" * 200}], 60)
    text = tokenizer.decode(ids)
    assert (
        cut
        and len(ids) <= 60
        and text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    )
    with pytest.raises(EnvError, match="agent.max_obs_tokens"):
        chat.observation_ids([{"role": "tool", "content": "9" * 200}], 10)
