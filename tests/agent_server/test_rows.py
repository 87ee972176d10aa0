"""Calls through the real openai client become rows whose ids are the chat template's
rendering of the conversation; a rewritten history forks a row; sessions stay apart."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from openai import BadRequestError, OpenAI

from rlframe.agent_server.trajectory import normalize_message
from rlframe.envs.chat import ChatFormat
from tests.agent_server.calculator_tool import TOOLS
from tests.agent_server.conftest import Served


def client_for(served: Served, key: str) -> OpenAI:
    return OpenAI(base_url=served.server.base_url, api_key=key, max_retries=0)


def play(served: Served, key: str, feedback: list[dict[str, Any]], **kw: Any) -> list[Any]:
    """The first message, then one call per feedback message; returns the final
    conversation (messages + the last reply), replies sent back as the client gave them."""
    client = client_for(served, key)
    messages: list[Any] = [{"role": "user", "content": "12+30=?"}]
    for extra in [*feedback, None]:
        reply = client.chat.completions.create(model="tiny", messages=messages, **kw)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if extra is not None:
            messages.append(extra)
    return messages


def assert_row_is_rendering(served: Served, session: Any, final: list[Any], tools: Any) -> None:
    (row,) = session.episode.rows
    chat = ChatFormat(served.tokenizer, tools=tools)
    text = chat.render([normalize_message(m) for m in final], False)
    # The row ends with the model's last end-of-turn token; what the template writes after
    # it (ChatML's newline) belongs to the next turn.
    end_of_turn = served.tokenizer.eos_token
    rendered = chat.encode(text[: text.rfind(end_of_turn) + len(end_of_turn)])
    recorded = row.prompt_ids + row.response_ids
    if row.finish_reason == "length":  # the template closes the last turn; the model did not
        recorded.append(served.tokenizer.eos_token_id)
    assert recorded == rendered
    # Loss mask 1 exactly on what the engine sampled, with its log-probs.
    assert row.turns == 3 and sum(row.loss_mask) == row.sampled
    assert all(lp < 0 for lp, m in zip(row.logprobs, row.loss_mask) if m)
    assert all(lp == 0 for lp, m in zip(row.logprobs, row.loss_mask) if not m)


def test_plain_template_rows_equal_the_rendered_conversation(plain: Served) -> None:
    session = plain.open()
    hints = [{"role": "user", "content": " higher:"}, {"role": "user", "content": " lower:"}]
    final = play(plain, session.key, hints, max_tokens=3)
    assert_row_is_rendering(plain, session, final, None)


def test_chatml_with_tools_rows_equal_the_rendered_conversation(chatml: Served) -> None:
    session = chatml.open()
    feedback = [
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "user", "content": "Now 7*6?"},
    ]
    final = play(chatml, session.key, feedback, max_tokens=8, tools=TOOLS)
    assert_row_is_rendering(chatml, session, final, TOOLS)
    row = session.episode.rows[0]
    text = chatml.tokenizer.decode(row.prompt_ids)
    assert '"name": "calculator"' in text and text.endswith("<|im_start|>assistant\n")
    # The template's newline after <|im_end|> is in the observation, not re-sampled.
    assert "<|im_end|>\n<|im_start|>user\n<tool_response>\n42" in chatml.tokenizer.decode(
        row.response_ids, skip_special_tokens=False
    )


def test_rewritten_history_forks_a_row(plain: Served) -> None:
    session = plain.open()
    client = client_for(plain, session.key)
    messages: list[Any] = [{"role": "user", "content": "3+4=?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": " lower:"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    summary = [{"role": "user", "content": "summary: 3+4 is below it?"}]
    client.chat.completions.create(model="tiny", messages=summary, max_tokens=2)
    rows = session.episode.rows
    assert [r.turns for r in rows] == [2, 1]
    chat = ChatFormat(plain.tokenizer)
    assert rows[1].prompt_ids == chat.prompt_ids(summary)
    assert rows[0].prompt_ids == chat.prompt_ids(messages[:1])


def test_a_row_past_the_episode_s_cap_gets_400(
    plain: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each restart of the conversation starts a row; the one past agent.max_rows_per_episode
    is refused with an OpenAI-shaped 400 naming the key, and extending a row still works."""
    monkeypatch.setattr(plain.server.cfg.agent, "max_rows_per_episode", 2)
    session = plain.open()
    client = client_for(plain, session.key)
    first = [{"role": "user", "content": "1+1=?"}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=2)
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "2+2=?"}], max_tokens=2
    )
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "3+3=?"}], max_tokens=2
        )
    assert refused.value.body["param"] == "messages"  # type: ignore[index]
    assert "(agent.max_rows_per_episode=2)" in refused.value.body["message"]  # type: ignore[index]
    extended = [*first, reply.choices[0].message.model_dump(), {"role": "user", "content": "?"}]
    client.chat.completions.create(model="tiny", messages=extended, max_tokens=2)
    assert [r.turns for r in session.episode.rows] == [2, 1]


def test_concurrent_sessions_stay_apart_and_share_the_engine(plain: Served) -> None:
    sessions = [plain.open(seed=i) for i in range(6)]
    plain.server.turns.take_metrics()  # counts from here
    prompts = [f"{i}{i}+{i}=?" for i in range(6)]
    finals: dict[int, list[Any]] = {}

    def run(i: int) -> None:
        client = client_for(plain, sessions[i].key)
        messages: list[Any] = [{"role": "user", "content": prompts[i]}]
        for _ in range(3):
            reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
            messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": " x:"}]
        finals[i] = messages

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    chat = ChatFormat(plain.tokenizer)
    for i, session in enumerate(sessions):
        (row,) = session.episode.rows
        assert row.turns == 3
        assert row.prompt_ids == chat.prompt_ids(finals[i][:1])
        assert plain.tokenizer.decode(row.prompt_ids) == prompts[i]
    # 18 requests, with requests of other sessions in the engine at the same time.
    metrics = plain.server.turns.take_metrics()
    assert metrics["rollout/requests/replica_0"] == 18
    assert metrics["rollout/in_flight/replica_0"] > 1
