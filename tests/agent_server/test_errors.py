"""Bad requests get OpenAI-shaped errors and the server goes on; it listens on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from rlframe.rollout.engine_client import EngineClient
from tests.agent_server.conftest import Served

USER = [{"role": "user", "content": "1+1=?"}]


def post(served: Served, key: str, content: bytes | str, path: str = "chat/completions") -> Any:
    return httpx.post(
        f"{served.server.base_url}/{path}",
        content=content,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        timeout=60,
    )


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error


def test_unknown_and_finished_keys_get_401(plain: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as unknown:
        OpenAI(base_url=plain.server.base_url, api_key="sk-nobody", max_retries=0).models.list()
    assert unknown.value.status_code == 401 and unknown.value.code == "invalid_api_key"
    session = plain.open()
    client = OpenAI(base_url=plain.server.base_url, api_key=session.key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    plain.server.sessions.close(session.key)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)


def test_bad_requests_get_400_404_413(plain: Served) -> None:
    key = plain.open().key
    assert_error(post(plain, key, b"{not json"), 400, "invalid_json")
    client = OpenAI(base_url=plain.server.base_url, api_key=key, max_retries=0)
    for extra, param in (
        ({"n": 2}, "n"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
        ({"stream": True}, "stream"),
        ({"temperature": 0.3}, "temperature"),
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=USER, **extra)
        assert bad.value.code == "unsupported_parameter" and bad.value.param == param
    with pytest.raises(openai.BadRequestError) as bad_cap:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=0)
    assert bad_cap.value.param == "max_tokens"
    long = [{"role": "user", "content": "1+" * 300}]  # 600 tokens > data.max_prompt_length
    with pytest.raises(openai.BadRequestError) as over:
        client.chat.completions.create(model="tiny", messages=long)
    assert over.value.code == "context_length_exceeded"
    assert_error(post(plain, key, b"x" * 70000), 413, "request_too_large")
    assert_error(post(plain, key, b"{}", path="completions"), 404, "not_found")
    # None of it hurt the session or the server.
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    assert reply.choices[0].message.role == "assistant"


def test_malformed_values_get_400_and_a_wrong_method_405(plain: Served) -> None:
    key = plain.open().key
    for body in (
        {"messages": USER, "temperature": "hot"},
        {"messages": USER, "top_p": [1]},
        {"messages": [{"role": "assistant", "content": "", "tool_calls": "call"}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 3}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                         "arguments": 3}}]}]},
    ):  # fmt: skip
        response = post(plain, key, json.dumps(body))
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["type"] == "invalid_request_error"
    got = httpx.get(
        f"{plain.server.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert_error(got, 405, "method_not_allowed")
    assert got.json()["error"]["type"] == "invalid_request_error"


def assert_clean_4xx(response: httpx.Response, param: str | None = None) -> None:
    """An OpenAI-shaped 400, one line, no traceback or colour codes in the body."""
    assert response.status_code == 400, response.text[:2000]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert param is None or error["param"] == param
    assert "Traceback" not in response.text and "\x1b" not in response.text
    assert "\n" not in error["message"]


USER_JSON = json.dumps(USER)
HOSTILE: dict[str, tuple[str, str | None]] = {
    # past the parser's recursion (the fixture's body cap is 64 KiB)
    "nested-30000": ("[" * 30000 + "]" * 30000, None),
    "nested-100": ('{"messages": %s, "metadata": %s}' % (USER_JSON, "[" * 100 + "]" * 100), None),
    "max_tokens-5001-digits": (
        '{"messages": %s, "max_tokens": %s}' % (USER_JSON, "9" * 5001),
        None,
    ),
    "temperature-400-digits": (
        json.dumps({"messages": USER, "temperature": 10**400}),
        "temperature",
    ),
    "content-null": (json.dumps({"messages": [{"role": "user", "content": None}]}), "messages"),
    "content-ints": (json.dumps({"messages": [{"role": "user", "content": [1, 2]}]}), "messages"),
    "content-object": (
        json.dumps({"messages": [{"role": "user", "content": {"text": "1+1"}}]}),
        "messages",
    ),
    "stop-ints": (json.dumps({"messages": USER, "stop": [1, 2]}), "stop"),
    "stop-int": (json.dumps({"messages": USER, "stop": 7}), "stop"),
    "tools-ints": (json.dumps({"messages": USER, "tools": [3]}), "tools"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_bodies_get_a_400_without_a_traceback(plain: Served, case: str) -> None:
    """Issue 46: JSON nested 100,000 deep, a 5,001-digit max_tokens, ``content: null`` or a
    list of ints were answered with 500s (the last two with a Ray traceback in the body)."""
    key = plain.open().key
    raw, param = HOSTILE[case]
    assert_clean_4xx(post(plain, key, raw), param)
    # The session and the server go on.
    client = OpenAI(base_url=plain.server.base_url, api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
    assert reply.choices[0].message.role == "assistant"


def test_an_engine_failure_is_a_one_line_500(
    plain: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure past the checks (the engine's, through Ray) reaches the client as one line:
    its type and first line, no traceback, no colour codes."""
    key = plain.open().key

    def fail(requests: list[Any]) -> Any:
        raise RuntimeError(
            "\x1b[36mray::RolloutWorker.serve()\x1b[39m (pid=1)\nTraceback (most recent "
            'call last):\n  File "x.py", line 1, in serve\nValueError: boom'
        )

    failing = EngineClient([fail])
    monkeypatch.setattr(plain.server, "turns", failing)
    response = post(plain, key, json.dumps({"messages": USER, "max_tokens": 1}))
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error"
    assert error["message"] == "RuntimeError: ray::RolloutWorker.serve() (pid=1)"
    assert "Traceback" not in response.text and "\x1b" not in response.text
    failing.close()


def test_an_oversized_header_is_a_4xx_without_a_traceback(
    plain: Served, caplog: pytest.LogCaptureFixture
) -> None:
    key = plain.open().key
    with caplog.at_level(logging.DEBUG):
        response = httpx.post(
            f"{plain.server.base_url}/chat/completions",
            content=b"{}",
            headers={"Authorization": f"Bearer {key}", "X-Big": "x" * 20000},
            timeout=60,
        )
    assert 400 <= response.status_code < 500
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not loud, [r.getMessage() for r in loud]
    noted = [r.getMessage() for r in caplog.records if r.name == "rlframe.agent_server"]
    assert any("Error handling request" in m for m in noted), noted


def test_too_many_concurrent_requests_get_429(plain: Served) -> None:
    keys = [plain.open().key for _ in range(3)]
    agent = plain.server.agent
    limit, turns = agent.max_pending_requests, plain.server.turns
    engine = turns.replicas[0].serve

    def slow(requests: list[Any]) -> Any:  # the first request is still in progress at the third
        time.sleep(1.0)
        return engine(requests)

    agent.max_pending_requests, plain.server.turns = 1, EngineClient([slow])

    async def call(key: str) -> Any:
        client = openai.AsyncOpenAI(base_url=plain.server.base_url, api_key=key, max_retries=0)
        try:
            return await client.chat.completions.create(model="tiny", messages=USER, max_tokens=1)
        except openai.RateLimitError as e:
            return e

    async def all_at_once() -> list[Any]:
        return await asyncio.gather(*(call(k) for k in keys))

    try:
        results = asyncio.run(all_at_once())
    finally:
        plain.server.turns.close()
        agent.max_pending_requests, plain.server.turns = limit, turns
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(limited) == 2 and all(r.status_code == 429 for r in limited)
    assert sum(not isinstance(r, Exception) for r in results) == 1


def test_listens_on_loopback_only(plain: Served) -> None:
    assert plain.server.listener is not None
    host, port = plain.server.listener.sockets[0].getsockname()[:2]
    assert host == "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 1))  # no packet is sent: picks the outward interface
    outward = probe.getsockname()[0]
    probe.close()
    assert not outward.startswith("127.")
    with pytest.raises(OSError):
        socket.create_connection((outward, port), timeout=2).close()
