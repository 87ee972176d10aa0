"""A sampled turn as an OpenAI ``choices[0].message``: text, tool calls, finish reason.

The text is the sampled ids decoded, without the end-of-turn token. ``stop`` strings cut the
turn after the first token whose text completes one; the ids kept (up to and with that
token) are the ones recorded, and the reply's text ends before the stop string, as OpenAI's
does. With ``tools`` in the request (and ``tool_choice`` not ``none``), the configured
tool-call parser (``agent.tool_parser``, :mod:`rlframe.envs.tool_parsers`) reads the calls;
their text is left out of ``content``. No constrained decoding: ``tool_choice`` required or
a named function are not enforced.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from rlframe.core.tokenizer import Tokenizer, read_eos_id
from rlframe.envs.tool_parsers import TOOL_PARSERS
from rlframe.rollout.turns import TurnResult

TOOL_CALL_TEXT = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)

KeptTurn = tuple[list[int], list[float], str, int]


class ReplyBuilder:
    def __init__(self, tokenizer: Tokenizer, tool_parser: str) -> None:
        self.tokenizer = tokenizer
        self.parse = TOOL_PARSERS.get(tool_parser)
        self.stop_ids = {read_eos_id(tokenizer)}

    def decode(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def cut_at_stop(self, turn: TurnResult, stops: list[str]) -> tuple[int, str] | None:
        """(tokens kept, text before the stop string) at the first stop string, or None."""
        for k in range(1, len(turn.ids) + 1):
            text = self.decode(turn.ids[:k])
            hits = [text.find(s) for s in stops if s and s in text]
            if hits:
                return k, text[: min(hits)]
        return None

    def build(
        self, turn: TurnResult, body: dict[str, Any], tools: list[dict[str, Any]] | None
    ) -> tuple[KeptTurn, dict[str, Any], str]:
        ids, logprobs = turn.ids, turn.logprobs
        finish_reason = "length" if turn.finish_reason == "length" else "stop"
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        cut = self.cut_at_stop(turn, stops) if stops else None
        if cut is not None:
            k, text = cut
            ids, logprobs, finish_reason = ids[:k], logprobs[:k], "stop"
        else:
            text = self.decode(ids)
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if tools and body.get("tool_choice") != "none":
            parsed = self.parse(text)
            if parsed.calls:
                reply["tool_calls"] = [
                    {
                        "id": f"call_{uuid.uuid4().hex[:24]}",
                        "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                    }
                    for c in parsed.calls
                ]
                reply["content"] = TOOL_CALL_TEXT.sub("", text).strip() or None
                finish_reason = "tool_calls"
        kept = (ids, logprobs, finish_reason, turn.weights_version)
        return kept, reply, finish_reason
