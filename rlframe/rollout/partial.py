"""Groups in flight, and partial rollouts: responses that grow over several engine calls.

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

import torch

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.data.prompts import PromptRecord
from rlframe.rollout.rows import (
    AgentStats,
    TokenRow,
    add_turns,
    build_request,
    read_row_images,
)


def continuation_seed(row: TokenRow) -> int:
    """A call that continues a response must not replay the random stream of its first call
    (same seed, same draws): mix in how far it got. Its first call uses the seed as is, as
    lockstep would."""
    if not row.response_ids:
        return row.seed
    return hash((row.seed, len(row.response_ids))) & 0x7FFFFFFF


@dataclass
class Group:
    """The responses to one prompt, from admission until a step takes them."""

    group_id: int
    record: PromptRecord
    prompts: Batch
    """The group's ``n`` prompt rows (``build_prompt_batch`` of its one record)."""
    rows: list[TokenRow]
    """Its responses as far as they got (``single_turn`` continues them call by call; another
    agent's rows replace them when its episodes end), each naming its prompt row in
    ``prompts`` as its ``source``."""
    start_version: int
    """Weights version when the group was admitted: none of its tokens is older (weights
    only move forward), so this is its oldest version for the staleness bound."""
    done: bool = False
    """Every row finished: the group waits for its rewards."""
    scored: Batch | None = None
    """The finished group's rows, collated, with their rewards (and ReMax's baseline)."""
    dropped: bool = False

    def require_scored(self) -> Batch:
        """The rows with their rewards; ValueError (naming the group) before scoring."""
        if self.scored is None:
            raise ValueError(f"group {self.group_id} has not been scored")
        return self.scored

    def state_dict(self) -> dict[str, Any]:
        """A scored group's rows, or an unfinished one's token rows (the prompt rows are
        rebuilt from the record on load), with their images and tensors as they are:
        :func:`~rlframe.rollout.state_json.encode_state` makes it JSON."""
        state = {
            "group_id": self.group_id,
            "record": vars(self.record),
            "start_version": self.start_version,
        }
        if self.scored is not None:
            return state | {"scored": split_batch(self.scored)}
        return state | {"rows": [asdict(r) for r in self.rows]}


def restore_row(saved: dict[str, Any]) -> TokenRow:
    """A row of :meth:`Group.state_dict`; one saved before rows had typed fields keeps its
    images (``row_extras``) and its routed experts (prompt and per-token extras)."""
    saved = dict(saved)
    extras = saved.pop("row_extras", {})
    prompt_routing = saved.pop("prompt_extras", {}).get(ROUTED_EXPERTS, [])
    token_routing = saved.pop("token_extras", {}).get(ROUTED_EXPERTS, [])
    if "images" in extras:
        saved["images"] = list(extras["images"])
    routing = [t for t in [*prompt_routing, *token_routing] if t is not None]
    if routing:
        saved["routed_experts"] = torch.stack(routing)
    if isinstance(saved.get("agent"), dict):
        saved["agent"] = AgentStats(**saved["agent"])
    return TokenRow(**saved)


def split_batch(batch: Batch) -> dict[str, Any]:
    """A batch as plain parts: its tensors, its columns as lists, its meta."""
    columns = {k: v.tolist() for k, v in batch.columns.items()}
    return {"tensors": dict(batch.tensors), "columns": columns, "meta": dict(batch.meta)}


def join_batch(parts: dict[str, Any]) -> Batch:
    """The batch of :func:`split_batch`'s parts."""
    # A checkpoint saved before the blob table holds each tensor as its dtype and nested lists.
    tensors = {
        k: torch.tensor(t["data"], dtype=getattr(torch, t["dtype"])) if isinstance(t, dict) else t
        for k, t in parts["tensors"].items()
    }
    return Batch(tensors, parts["columns"], parts["meta"])


def build_continuation(
    rows: list[TokenRow], max_tokens: int, chunk: int, meta: dict[str, Any]
) -> Batch:
    """The engine call for responses in flight: each row's context (prompt + kept tokens),
    its seed and its cap (what is left of ``max_tokens``, at most ``chunk`` when > 0)."""
    left = [max_tokens - len(r.response_ids) for r in rows]
    caps = [min(chunk, n) if chunk > 0 else n for n in left]
    seeds = [continuation_seed(r) for r in rows]
    return build_request([r.context for r in rows], seeds, caps, meta, read_row_images(rows))


def merge_call(rows: list[TokenRow], out: Batch, max_tokens: int) -> None:
    """Append one call's tokens to the responses it ran. A response is complete at a stop
    token or at ``max_tokens`` in all; a call that only hit its chunk cap leaves it to go on."""
    add_turns(rows, out)
    for r in rows:
        if r.finish_reason != "stop":
            r.finish_reason = "length" if len(r.response_ids) >= max_tokens else None


def list_unfinished(groups: list[Group]) -> list[TokenRow]:
    """The responses of ``groups`` still in flight, in call order."""
    return [row for g in groups for row in g.rows if row.finish_reason is None]
