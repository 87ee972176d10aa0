"""Agents of ``rollout.agent=openai`` for the tests, written only against the openai client."""

from __future__ import annotations

import asyncio
from typing import Any

from openai import AsyncOpenAI, OpenAI


async def fork(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    """Two calls on one conversation, then a rewritten one: two rows; reward 0.5."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": sample["prompt"]}]
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
        messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": " lower:"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
        summary = [{"role": "user", "content": sample["prompt"] + " lower:"}]
        await client.chat.completions.create(model="m", messages=summary, max_tokens=1)
    return 0.5


def unscored(base_url: str, api_key: str, sample: dict[str, Any]) -> None:
    """Sync, one call, no reward: reward.fn scores it."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": sample["prompt"]}], max_tokens=1
    )


async def flaky(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    """Raises on odd secrets, hangs on 2, else one call and reward 1."""
    secret = int(sample["ground_truth"])
    if secret % 2:
        raise RuntimeError("the agent broke")
    if secret == 2:
        await asyncio.sleep(60)
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages = [{"role": "user", "content": sample["prompt"]}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    return 1.0
