"""Training rows of an OpenAI-API episode, token in, token out.

A row is what the trainer sees: ``prompt_ids`` and a response of sampled turns (loss mask 1)
and what came between them (closing end-of-turn tokens the policy did not sample, tool
results, user feedback: loss mask 0). A call *extends* a row when its messages start with
the row's last call's messages plus the reply the server gave, and nothing else changed
(same tools). The ids of that prefix are the ones held already; only the new messages are
rendered, as the chat template's text after the end-of-turn token of the reply (see
:class:`rlframe.envs.chat.ChatFormat` for why and for the append-only check). What the
model sampled is never decoded and encoded again, so a template that renders a reply (or
its tool calls) differently from how the model wrote it changes nothing the trainer sees.

A call that extends no row (history rewritten, summarised, a sub-agent's own conversation)
starts a new row whose prompt is the whole rendered conversation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlframe.core.tokenizer import Tokenizer
from rlframe.envs.chat import ChatFormat
from rlframe.rollout.rows import TokenRow

Message = dict[str, Any]
FORMATS_KEPT = 64
"""Chat formats (one per tool set) a ``formats`` dict holds before it starts over."""


def normalize_arguments(arguments: Any) -> Any:
    """Tool-call arguments as an object where they are JSON text (templates want objects)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def content_text(content: Any) -> str:
    """A message's content as text: None is empty, a list of parts is their texts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def normalize_message(message: Message) -> Message:
    """The fields the chat template reads, in the form it reads them; other fields (the
    client's ``refusal``, ``annotations``...) are dropped so that a reply sent back as the
    client returned it compares equal to the reply the server made."""
    out: Message = {
        "role": str(message.get("role", "")),
        "content": content_text(message.get("content")),
    }
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": str(c.get("id", "")),
                "type": "function",
                "function": {
                    "name": str(c.get("function", {}).get("name", "")),
                    "arguments": normalize_arguments(c.get("function", {}).get("arguments", {})),
                },
            }
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = str(message[key])
    return out


def key_of(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


@dataclass
class Plan:
    """Where a call goes: the row it extends (``index`` >= 0) or starts (``index`` -1), and
    the ids that come before the sampled turn; nothing is changed until
    :meth:`Episode.commit`."""

    row: TokenRow
    index: int
    tools_key: str
    added: list[int]
    """Ids appended to an extended row before the turn (loss mask 0)."""

    @property
    def new_row(self) -> bool:
        return self.index < 0

    @property
    def context(self) -> list[int]:
        return self.row.context + self.added if not self.new_row else self.row.prompt_ids


class Episode:
    """The rows of one episode (one session) and the chat formats of its tool sets."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop_ids: set[int],
        formats: dict[str, ChatFormat] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.rows: list[TokenRow] = []
        self.conversations: list[tuple[str, list[Message]]] = []
        """Per row: its tools' key and the last call's messages plus the reply given (what
        an extending call starts with)."""
        self.busy: set[int] = set()
        """Rows with a call in the engine: a concurrent call cannot extend them."""
        self.new_rows_in_flight = 0
        """Calls sampling a row that is not in ``rows`` yet (it joins when they finish)."""
        self.formats = {} if formats is None else formats
        """Chat formats by tools' key; the server shares one dict among its episodes, so the
        texts they add are tokenised once (:meth:`ChatFormat.encode_text`)."""
        self.tool_calls = 0
        self.tool_errors = 0

    def chat(self, tools: list[dict[str, Any]] | None, tools_key: str) -> ChatFormat:
        chat = self.formats.get(tools_key)
        if chat is None:
            if len(self.formats) >= FORMATS_KEPT:  # an agent sending ever new tool sets
                self.formats.clear()
            chat = self.formats[tools_key] = ChatFormat(self.tokenizer, tools=tools or None)
        return chat

    def plan(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> Plan:
        """The row this call extends, newest first, or a new row."""
        tools_key = key_of(tools)
        chat = self.chat(tools, tools_key)
        for index in reversed(range(len(self.rows))):
            key, held = self.conversations[index]
            if index in self.busy or key != tools_key or len(messages) <= len(held):
                continue
            if key_of(messages[: len(held)]) != key_of(held):
                continue
            added = self.extension_ids(chat, self.rows[index], held, messages)
            if added is not None:
                return Plan(self.rows[index], index, tools_key, added)
        # Messages are normalized (text contents): no images to expand.
        prompt = chat.encode_text(chat.render(messages, add_generation_prompt=True))
        return Plan(TokenRow(prompt), -1, tools_key, [])

    def extension_ids(
        self, chat: ChatFormat, row: TokenRow, held: list[Message], messages: list[Message]
    ) -> list[int] | None:
        """Ids after the row's held ones: the end-of-turn token when the reply stopped without
        it, then the template's text for the new messages. None: the template rewrites the
        text before the reply's end-of-turn token, so the call cannot extend the row."""
        before = chat.render(held, add_generation_prompt=False)
        end = before.rfind(chat.end_of_turn)
        if end < 0:
            return None
        prefix = before[: end + len(chat.end_of_turn)]
        after = chat.render(messages, add_generation_prompt=True)
        if not after.startswith(prefix):
            return None
        close = (
            []
            if row.response_ids and row.response_ids[-1] in self.stop_ids
            else [int(self.tokenizer.convert_tokens_to_ids(chat.end_of_turn))]
        )
        return close + chat.encode_text(after[len(prefix) :])

    def begin(self, plan: Plan) -> None:
        """A call of ``plan`` goes to the engine."""
        self.busy.add(plan.index)
        self.new_rows_in_flight += int(plan.new_row)

    def end(self, plan: Plan) -> None:
        """The call of ``plan`` came back (or failed)."""
        self.busy.discard(plan.index)
        self.new_rows_in_flight -= int(plan.new_row)

    def commit(
        self,
        plan: Plan,
        messages: list[Message],
        reply: Message,
        turn: tuple[list[int], list[float], str, int],
    ) -> None:
        """Record a finished call: the ids before it, its sampled ids, and the conversation
        an extending call will start with."""
        row = plan.row
        conversation = (plan.tools_key, [*messages, normalize_message(reply)])
        if plan.new_row:
            self.rows.append(row)
            self.conversations.append(conversation)
        else:
            self.conversations[plan.index] = conversation
        row.add_observation(plan.added)
        row.add_turn(*turn)
