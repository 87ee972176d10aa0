"""Bad requests get OpenAI-shaped errors and the server goes on; it listens on loopback."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

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


def test_too_many_concurrent_requests_get_429(plain: Served) -> None:
    keys = [plain.open().key for _ in range(3)]
    agent = plain.server.agent
    limit, wait = agent.max_pending_requests, plain.server.batcher.wait_s
    agent.max_pending_requests, plain.server.batcher.wait_s = 1, 1.0

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
        agent.max_pending_requests, plain.server.batcher.wait_s = limit, wait
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(limited) == 2 and all(r.status_code == 429 for r in limited)
    assert sum(not isinstance(r, Exception) for r in results) == 1


def test_listens_on_loopback_only(plain: Served) -> None:
    host, port = plain.server.runner.addresses[0][:2]
    assert host == "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect(("10.255.255.255", 1))  # no packet is sent: picks the outward interface
    outward = probe.getsockname()[0]
    probe.close()
    assert not outward.startswith("127.")
    with pytest.raises(OSError):
        socket.create_connection((outward, port), timeout=2).close()
