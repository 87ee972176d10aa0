"""Guess the number (0-9) as an agent written only against the ``openai`` client.

Nothing here imports rlframe: the same function runs against any OpenAI-compatible
endpoint. The opening user message is the sample's prompt; each wrong guess is answered
with a user message " higher:" / " lower:" / " invalid:" and the model guesses again, up to
``MAX_TURNS`` guesses. Reward 1 for finding the number, else 0.
"""

from __future__ import annotations

import re
import ssl
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

MAX_TURNS = 4
# One TLS context for all clients: building one per client loads the CA bundle, ~26 ms,
# which for 256 episodes a step is seconds of client set-up.
TLS = ssl.create_default_context()
LEADING_INTEGER = re.compile(r"\s*(-?\d+)")


def hint_for(guess_text: str, secret: int) -> str | None:
    """None when the guess is right, else the feedback."""
    match = LEADING_INTEGER.match(guess_text)
    if match is None:
        return " invalid:"
    guess = int(match.group(1))
    if guess == secret:
        return None
    return " higher:" if secret > guess else " lower:"


async def play(base_url: str, api_key: str, sample: dict[str, Any]) -> float:
    secret = int(sample["ground_truth"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": sample["prompt"]}]
    async with AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        http_client=DefaultAsyncHttpxClient(verify=TLS),
    ) as client:
        for _ in range(MAX_TURNS):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, max_tokens=1
            )
            guess = reply.choices[0].message.content or ""
            hint = hint_for(guess, secret)
            if hint is None:
                return 1.0
            messages += [
                {"role": "assistant", "content": guess},
                {"role": "user", "content": hint},
            ]
    return 0.0
