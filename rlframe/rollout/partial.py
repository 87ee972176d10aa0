"""Partial rollouts on the driver: responses that grow over several engine calls.

A response in flight keeps its tokens, their log-probs and the weights version each token was
sampled with. An engine call continues it as a new request: the prompt followed by the kept
tokens, with what is left of ``rollout.max_tokens`` (capped by ``rollout.partial_chunk_tokens``).
Between two calls the weights may change (a sync); the tokens sampled after it carry the new
version. This needs nothing from the engine beyond ``generate`` (AReaL and slime continue
interrupted requests the same way), so it works for vLLM and the HF engine, in-process on
CPU and on GPU, colocated or in a separate pool.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rlframe.data.prompts import PromptRecord
from rlframe.protocol import Batch
from rlframe.rollout.rows import TokenRow, add_turns, build_request


def continuation_seed(row: TokenRow) -> int:
    """A call that continues a response must not replay the random stream of its first call
    (same seed, same draws): mix in how far it got. Its first call uses the seed as is, as
    lockstep would."""
    if not row.response_ids:
        return row.seed
    return hash((row.seed, len(row.response_ids))) & 0x7FFFFFFF


@dataclass
class Group:
    """The ``n`` responses to one prompt, and the prompt rows they answer."""

    group_id: int
    record: PromptRecord
    prompts: Batch
    """The group's prompt rows (``build_prompt_batch`` of its one record)."""
    responses: list[TokenRow]
    start_version: int
    """Weights version when the group was admitted; its oldest until a token says older."""
    scored: Batch | None = None
    """The finished group with its rewards."""
    dropped: bool = False

    @property
    def finished(self) -> bool:
        return all(r.finish_reason is not None for r in self.responses)

    @property
    def oldest_version(self) -> int:
        run = [r.first_version for r in self.responses if r.first_version >= 0]
        return min([self.start_version, *run])

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable; the prompt rows and the rewards are rebuilt on load."""
        return {
            "group_id": self.group_id,
            "record": vars(self.record),
            "responses": [asdict(r) for r in self.responses],
            "start_version": self.start_version,
        }


def build_continuation(
    todo: list[tuple[Group, int]], max_tokens: int, chunk: int, meta: dict[str, Any]
) -> Batch:
    """The engine call for responses in flight: each row's context (prompt + kept tokens),
    its seed and its cap (what is left of ``max_tokens``, at most ``chunk`` when > 0)."""
    rows = [group.responses[i] for group, i in todo]
    left = [max_tokens - len(r.response_ids) for r in rows]
    caps = [min(chunk, n) if chunk > 0 else n for n in left]
    return build_request(
        [r.context for r in rows], [continuation_seed(r) for r in rows], caps, meta
    )


def merge_call(todo: list[tuple[Group, int]], out: Batch, max_tokens: int) -> list[Group]:
    """Append one call's tokens to the responses it ran; the groups it finished.

    A response is complete at a stop token or at ``max_tokens`` in all; a call that only hit
    its chunk cap leaves it to go on. Rows of groups dropped meanwhile are ignored.
    """
    kept = [row for row, (group, _) in enumerate(todo) if not group.dropped]
    rows = [todo[row][0].responses[todo[row][1]] for row in kept]
    add_turns(rows, out.rows(kept))
    finished = []
    for row, r in zip(kept, rows):
        group = todo[row][0]
        if r.finish_reason != "stop":
            r.finish_reason = "length" if len(r.response_ids) >= max_tokens else None
        if group.finished and group.scored is None and group not in finished:
            finished.append(group)
    return finished
