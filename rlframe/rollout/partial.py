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

from dataclasses import dataclass, field
from typing import Any

import torch

from rlframe.data.prompts import PromptRecord
from rlframe.protocol import Batch


@dataclass
class Response:
    """One response of a group, as far as it got."""

    seed: int
    """The row's sampling seed (its first call uses it as is, as lockstep would)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Weights version of each token."""
    first_version: int = -1
    """Version of the first call that ran it (-1: not run yet)."""
    finish_reason: str | None = None
    """``stop`` or ``length`` once complete; None while it goes on."""

    def continuation_seed(self) -> int:
        """A call that continues the response must not replay the random stream of its first
        call (same seed, same draws): mix in how far it got."""
        if not self.tokens:
            return self.seed
        return hash((self.seed, len(self.tokens))) & 0x7FFFFFFF


@dataclass
class Group:
    """The ``n`` responses to one prompt, and the prompt rows they answer."""

    group_id: int
    record: PromptRecord
    prompts: Batch
    """The group's prompt rows (``build_prompt_batch`` of its one record)."""
    responses: list[Response]
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
            "responses": [vars(r) for r in self.responses],
            "start_version": self.start_version,
        }


def build_continuation(
    todo: list[tuple[Group, int]], max_tokens: int, chunk: int, pad_id: int, meta: dict[str, Any]
) -> Batch:
    """The engine call for responses in flight: prompt + kept tokens, left-padded, each with
    its seed and its cap (what is left of ``max_tokens``, at most ``chunk`` when > 0)."""
    contexts, seeds, caps = [], [], []
    for group, i in todo:
        r = group.responses[i]
        contexts.append(list(group.record.prompt_ids) + r.tokens)
        seeds.append(r.continuation_seed())
        left = max_tokens - len(r.tokens)
        caps.append(min(chunk, left) if chunk > 0 else left)
    width = max(len(c) for c in contexts)
    ids = torch.full((len(todo), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(todo), width, dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    return Batch(
        {"prompt_ids": ids, "prompt_mask": mask, "max_tokens": torch.tensor(caps)},
        {"seed": seeds},
        dict(meta),
    )


def merge_call(todo: list[tuple[Group, int]], out: Batch, max_tokens: int) -> list[Group]:
    """Append one call's tokens to the responses it ran; the groups it finished.

    A response is complete at a stop token or at ``max_tokens`` in all; a call that only hit
    its chunk cap leaves it to go on. Rows of groups dropped meanwhile are ignored.
    """
    finished = []
    for row, (group, i) in enumerate(todo):
        if group.dropped:
            continue
        r = group.responses[i]
        n = int(out["response_mask"][row].sum())
        version = int(out["weights_version"][row])
        r.tokens += out["response_ids"][row, :n].tolist()
        r.logprobs += out["rollout_logprobs"][row, :n].tolist()
        r.versions += [version] * n
        if r.first_version < 0:
            r.first_version = version
        if out["finish_reason"][row] == "stop":
            r.finish_reason = "stop"
        elif len(r.tokens) >= max_tokens:
            r.finish_reason = "length"
        if group.finished and group.scored is None and group not in finished:
            finished.append(group)
    return finished


def assemble_group(group: Group, width: int, pad_id: int) -> Batch:
    """The finished group as the rows lockstep's agent returns (prompt and response columns),
    plus ``token_version`` ``[rows, width]`` and, per row, ``weights_version`` = its oldest."""
    rows = len(group.responses)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros(rows, width)
    mask = torch.zeros(rows, width)
    versions = torch.zeros(rows, width, dtype=torch.long)
    for i, r in enumerate(group.responses):
        n = len(r.tokens)
        ids[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
        logprobs[i, :n] = torch.tensor(r.logprobs)
        mask[i, :n] = 1
        # Padding (and an empty response) carries the version its first call ran with.
        versions[i] = r.first_version
        versions[i, :n] = torch.tensor(r.versions, dtype=torch.long)
    oldest = versions.min(1).values
    response = Batch(
        {
            "response_ids": ids,
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "rollout_logprobs": logprobs,
            "weights_version": oldest,
            "token_version": versions,
        },
        {"finish_reason": [r.finish_reason for r in group.responses]},
        {"weights_version": int(oldest.min())},
    )
    return group.prompts.union(response)
