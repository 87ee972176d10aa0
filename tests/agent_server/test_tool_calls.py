"""Tool calls in replies (the hermes parser) and ``stop`` strings; a reply sent back as the
client gives it continues the row with the ids the model sampled, whatever the template
makes of it."""

from __future__ import annotations

import json

from rlframe.agent_server.replies import ReplyBuilder
from rlframe.agent_server.trajectory import Episode, normalize_message
from rlframe.rollout.turns import TurnResult
from tests.agent_server.calculator_tool import TOOLS
from tests.unit.chatml_tokenizer import build_chatml_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'


def test_a_tool_call_reply_sent_back_continues_the_row_with_the_sampled_ids() -> None:
    tokenizer = build_chatml_tokenizer()
    eos = tokenizer.eos_token_id
    sampled = tokenizer.encode("Let me compute. " + CALL, add_special_tokens=False) + [eos]
    turn = TurnResult("0", sampled, [-0.5] * len(sampled), "stop", 3)
    kept, reply, finish_reason = ReplyBuilder(tokenizer, "hermes").build(turn, {}, TOOLS)
    assert finish_reason == "tool_calls" and reply["content"] == "Let me compute."
    (call,) = reply["tool_calls"]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "6*7"}
    assert kept[0] == sampled and kept[3] == 3
    # tool_choice none: the text stays text.
    _, plain, _ = ReplyBuilder(tokenizer, "hermes").build(turn, {"tool_choice": "none"}, TOOLS)
    assert "tool_calls" not in plain

    episode = Episode(tokenizer, {eos})
    messages = [normalize_message({"role": "user", "content": "6*7?"})]
    first = episode.plan(messages, TOOLS)
    episode.commit(first, messages, reply, kept)
    # As the openai client sends it back: arguments as JSON text, extra null fields.
    sent_back = {**reply, "refusal": None, "function_call": None}
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "42"}
    second = episode.plan([normalize_message(m) for m in [*messages, sent_back, tool]], TOOLS)
    assert not second.new_row
    observation = "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    suffix = tokenizer.encode(observation + "<|im_start|>assistant\n", add_special_tokens=False)
    assert second.context == first.row.prompt_ids + sampled + suffix


def test_stop_strings_cut_the_turn_after_the_token_that_completes_them() -> None:
    tokenizer = build_chatml_tokenizer()
    ids = tokenizer.encode("12+30=42", add_special_tokens=False)
    turn = TurnResult("0", ids, [-1.0] * len(ids), "length", 0)
    kept, reply, finish_reason = ReplyBuilder(tokenizer, "hermes").build(
        turn, {"stop": ["=", "zz"]}, None
    )
    assert reply["content"] == "12+30" and finish_reason == "stop"
    assert kept[0] == ids[:6] and len(kept[1]) == 6
