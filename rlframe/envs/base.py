"""The environment protocol and its registry.

An environment plays the other side of a multi-turn episode. One instance serves one
trajectory:

    reset(sample) -> the conversation's opening messages (what the prompt is rendered from)
    step(action)  -> (observation messages, reward, done, info)

``sample`` is the prompt row: ``prompt`` (rendered text), ``messages`` (its chat turns),
``ground_truth``, ``images`` (a vision-language row's encoded images, in order; absent for a
text row) and every other column. ``action`` is the text of the model's turn, without
its end-of-turn token. Either method may be ``async``. ``tools`` (optional) lists JSON
schemas handed to the chat template as ``tools=``.

Environments are registered by name (``@ENVS.register("name")`` on a class or factory) or
named by path (``agent.env=pkg.module:factory`` / ``path/to/file.py:factory``); the factory
gets ``agent.env_kwargs``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

from rlframe.core.registry import Registry
from rlframe.models.images import place_images

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "tool" | "system" | "assistant", "content": ...}``.
The content is a string, or (for a vision-language model) a list of parts in the Hugging Face
multimodal chat format: ``{"type": "text", "text": str}`` and ``{"type": "image", "image":
<PIL image | encoded bytes>}``, placed by the chat template in order."""


class StepResult(NamedTuple):
    """What an env step returns; a plain 4-tuple in the same order is accepted too."""

    observation: list[Message]
    """Messages appended after the model's turn (tool results, feedback); ignored when done."""
    reward: float = 0.0
    """Reward of this step; an episode's env reward is the sum over its steps."""
    done: bool = False
    """The episode ends after this step."""
    info: dict[str, Any] = {}
    """Counters the rollout aggregates: ``tool_calls``, ``tool_errors`` (ints)."""


StepReturn = StepResult | tuple[list[Message], float, bool, dict[str, Any]]
"""What a step returns."""


@runtime_checkable
class Env(Protocol):
    """Either method may be ``async def`` (its coroutine is an Awaitable of the same)."""

    def reset(self, sample: dict[str, Any]) -> list[Message] | Awaitable[list[Message]]:
        """The opening messages for ``sample`` (often ``sample["messages"]``)."""
        ...

    def step(self, action: str) -> StepReturn | Awaitable[StepReturn]:
        """React to the model's turn."""
        ...


EnvFactory = Callable[..., Env]
ENVS: Registry[EnvFactory] = Registry("environment")


class EnvError(RuntimeError):
    """An environment raised, timed out or returned something malformed."""


def get_tools(env: Any) -> list[dict[str, Any]] | None:
    """The env's tool schemas for the chat template, or None when it has none."""
    tools = getattr(env, "tools", None)
    return list(tools) if tools else None


def as_step_result(value: Any, env_name: str) -> StepResult:
    """Check an env's step return value and turn it into a StepResult."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise EnvError(
            f"env {env_name}: step must return (observation messages, reward, done, info), got "
            f"{value!r:.200}"
        )
    observation, reward, done, info = value
    check_messages(observation, env_name, "step")
    if not isinstance(info, dict):
        raise EnvError(f"env {env_name}: step's info must be a dict, got {type(info).__name__}")
    return StepResult(list(observation), float(reward), bool(done), info)


def check_messages(messages: Any, env_name: str, method: str) -> list[Message]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and "role" in m for m in messages
    ):
        raise EnvError(
            f"env {env_name}: {method} must return a list of messages "
            f"({{'role': ..., 'content': ...}}), "
            f"got {messages!r:.200}"
        )
    return messages


def build_env_factory(name: str, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """A zero-argument maker of fresh environments from the registry or a path."""
    factory = ENVS.get(name)
    return lambda: factory(**kwargs)


def default_messages(sample: dict[str, Any]) -> list[Message]:
    """The prompt row's own chat turns: what most environments open with. A row's images are
    placed as the prompt placed them (at its ``<image>`` markers, else before the first user
    turn), each image part carrying its image."""
    messages = sample.get("messages")
    if messages:
        opening = [dict(m) for m in messages]
    else:
        opening = [{"role": "user", "content": sample["prompt"]}]
    images = list(sample.get("images") or [])
    if not images:
        return opening
    return place_images(opening, len(images), "env reset", payloads=images)
