"""Token rows: the one form a sequence takes from the engine to the training grid.

A :class:`TokenRow` is one sequence as lists: its prompt ids, its response ids (sampled turns,
loss mask 1, and whatever came between them, loss mask 0), the engine's log-prob and the
weights version of each response token, and room for what a workload adds per token
(``token_extras``) or per row (``row_extras``). Every agent grows rows turn by turn
(:meth:`TokenRow.add_turn`, :meth:`TokenRow.add_observation`); :func:`collate` turns them
into the padded Batch training reads, once.

The rollout wire carries lists too (:func:`build_request`, :func:`build_response`): a
request's ``prompt_tokens`` column holds each row's whole context, a response's
``response_tokens`` and ``token_logprobs`` columns each row's new tokens. Rows split over the
rollout ranks as they are; nothing is padded to a rectangle to cross.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlframe.controller.reads import IMAGES
from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.rollout.turns import TurnResult


@dataclass
class TokenRow:
    """One sequence as far as it got."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on tokens the policy sampled, 0 on tokens it was given (observations)."""
    logprobs: list[float] = field(default_factory=list)
    """The engine's log-prob of each sampled token, 0 on given ones."""
    versions: list[int] = field(default_factory=list)
    """Weights version of each response token: a turn's that of the engine that sampled it, a
    given token's that of the turn before it."""
    seed: int = 0
    """The row's sampling seed."""
    first_version: int = -1
    """Version of the first engine call that ran the row (-1: none yet)."""
    finish_reason: str | None = None
    """How the last turn ended (``stop``, ``length``...); None while a turn is unfinished."""
    turns: int = 0
    """Engine calls that added to the row."""
    token_extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per response token, by name (e.g. routed experts); None on given tokens."""
    prompt_extras: dict[str, list[Any]] = field(default_factory=dict)
    """Per prompt token, by name, for an extra the prompt has too (the experts the engine
    routed the prompt to): collate lays such an extra over prompt and response."""
    row_extras: dict[str, Any] = field(default_factory=dict)
    """Per row, by name: ints become int64 tensors in the grid, other numbers float32 ones,
    tensors are stacked, anything else is a column."""

    @property
    def context(self) -> list[int]:
        """What the engine continues from: the prompt and the response so far."""
        return self.prompt_ids + self.response_ids

    @property
    def sampled(self) -> int:
        """Tokens the policy sampled."""
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        return min(self.versions, default=self.first_version)

    def add_turn(
        self,
        ids: list[int],
        logprobs: list[float],
        finish_reason: str,
        version: int,
        extras: dict[str, list[Any]] | None = None,
    ) -> None:
        """Append tokens the engine sampled with weights ``version``."""
        self.add_tokens(ids, [1] * len(ids), logprobs, [version] * len(ids), extras)
        self.turns += 1
        self.finish_reason = finish_reason
        if self.first_version < 0:
            self.first_version = version

    def add_observation(self, ids: list[int]) -> None:
        """Append tokens the policy did not sample (loss mask 0, log-prob 0)."""
        self.add_tokens(ids, [0] * len(ids), [0.0] * len(ids), self.versions[-1:] * len(ids), {})

    def add_tokens(
        self,
        ids: list[int],
        mask: list[int],
        logprobs: list[float],
        versions: list[int],
        extras: dict[str, list[Any]] | None,
    ) -> None:
        extras = extras or {}
        for name in set(self.token_extras) | set(extras):
            column = self.token_extras.setdefault(name, [None] * len(self.response_ids))
            column += extras.get(name, [None] * len(ids))
        self.response_ids += ids
        self.loss_mask += mask
        self.logprobs += logprobs
        self.versions += versions


def collate(rows: Sequence[TokenRow], width: int, pad_id: int, version: int = 0) -> Batch:
    """The padded training grid of ``rows``: ``prompt_ids``/``prompt_mask`` left-padded to the
    longest prompt; ``response_ids``, ``response_mask``, ``loss_mask``, ``rollout_logprobs``,
    ``token_version`` right-padded to ``width``; per row ``weights_version`` (its oldest
    token's) and the column ``finish_reason``; then the extras. Padding (and an empty
    response) carries the row's first version, or ``version`` for a row no call ran."""
    n = len(rows)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    response_mask, loss_mask, logprobs = (torch.zeros(n, width) for _ in range(3))
    token_version = torch.empty((n, width), dtype=torch.long)
    for i, r in enumerate(rows):
        k = len(r.response_ids)
        if k > width:
            raise AssertionError(f"a response of {k} tokens exceeds the width {width}")
        ids[i, :k] = torch.tensor(r.response_ids, dtype=torch.long)
        response_mask[i, :k] = 1
        loss_mask[i, :k] = torch.tensor(r.loss_mask, dtype=torch.float32)
        logprobs[i, :k] = torch.tensor(r.logprobs)
        token_version[i] = r.first_version if r.first_version >= 0 else version
        token_version[i, :k] = torch.tensor(r.versions, dtype=torch.long)
    longest = max((len(r.prompt_ids) for r in rows), default=0)
    prompt_ids = torch.full((n, longest), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((n, longest), dtype=torch.long)
    for i, r in enumerate(rows):
        prompt_ids[i, longest - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, dtype=torch.long)
        prompt_mask[i, longest - len(r.prompt_ids) :] = 1
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": ids,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "token_version": token_version,
        "weights_version": token_version.min(1).values,
    }
    columns: dict[str, Any] = {"finish_reason": [r.finish_reason for r in rows]}
    for name in sorted({k for r in rows for k in r.token_extras}):
        responses = [r.token_extras.get(name, []) for r in rows]
        if any(name in r.prompt_extras for r in rows):
            prompts = [r.prompt_extras.get(name, []) for r in rows]
            tensors[name] = pad_sequence_extra(prompts, responses, longest, width)
        else:
            tensors[name] = pad_token_extra(responses, width)
    for name in sorted({k for r in rows for k in r.row_extras}):
        values = [r.row_extras.get(name) for r in rows]
        numbers = [v for v in values if isinstance(v, int | float)]
        arrays = [v for v in values if isinstance(v, torch.Tensor)]
        if all(type(v) is int for v in values):
            tensors[name] = torch.tensor(values, dtype=torch.long)
        elif len(numbers) == len(values):
            tensors[name] = torch.tensor([float(v) for v in numbers])
        elif len(arrays) == len(values):
            tensors[name] = torch.stack(arrays)
        else:
            columns[name] = values
    return Batch(tensors, columns)


def pad_token_extra(values: list[list[Any]], width: int) -> torch.Tensor:
    """``[rows, width, ...]`` of one per-token extra; zeros where a token has none."""
    known = [torch.as_tensor(v) for row in values for v in row if v is not None]
    if not known:
        return torch.zeros(len(values), width)
    out = torch.zeros((len(values), width, *known[0].shape), dtype=known[0].dtype)
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            if v is not None:
                out[i, j] = torch.as_tensor(v)
    return out


def pad_sequence_extra(
    prompts: list[list[Any]], responses: list[list[Any]], prompt_width: int, width: int
) -> torch.Tensor:
    """``[rows, prompt_width + width, ...]`` of an extra the prompt has too, aligned with
    ``prompt_ids`` + ``response_ids`` (prompts left-padded, responses right-padded); -1 where a
    token has none (padding; a routed-experts index of -1 is no expert)."""
    known = [torch.as_tensor(v) for row in prompts + responses for v in row if v is not None]
    shape, dtype = known[0].shape, known[0].dtype
    out = torch.full((len(prompts), prompt_width + width, *shape), -1, dtype=dtype)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        values = [*prompt, *response]
        at = [j for j, v in enumerate(values) if v is not None]
        if at:
            start = prompt_width - len(prompt)
            out[i, torch.tensor(at) + start] = torch.stack([torch.as_tensor(values[j]) for j in at])
    return out


def build_request(
    contexts: Sequence[list[int]],
    seeds: Sequence[int],
    caps: Sequence[int] | None,
    meta: dict[str, Any],
    images: Sequence[list[bytes]] | None = None,
) -> Batch:
    """An engine call that continues each context (a row's :attr:`TokenRow.context`): seeds,
    per-row token caps (None: the run's ``rollout.max_tokens``), the call's meta (stop ids,
    ``greedy``, ``more_turns``) and, for a vision-language model, each row's images (the
    context's image pads stand for them; :func:`read_row_images`)."""
    tensors = {} if caps is None else {"max_tokens": torch.tensor(list(caps), dtype=torch.long)}
    columns: dict[str, Sequence[Any]] = {
        "prompt_tokens": [list(c) for c in contexts],
        "seed": [int(s) for s in seeds],
    }
    if images is not None:
        columns[IMAGES] = [list(i) for i in images]
    return Batch(tensors, columns, dict(meta))


def read_row_images(rows: Sequence[TokenRow]) -> list[list[bytes]] | None:
    """Each row's images (its ``images`` row extra: encoded bytes, in prompt order); None
    when no row has any, so a text model's request carries no images column."""
    images = [list(r.row_extras.get(IMAGES, [])) for r in rows]
    return images if any(images) else None


def build_response(
    turns: Sequence[tuple[list[int], list[float], str]],
    version: int,
    meta: dict[str, Any] | None = None,
) -> Batch:
    """What an engine call returns: per row the sampled ids, their log-probs, the finish
    reason, and the weights version that sampled them."""
    return Batch(
        {"weights_version": torch.full((len(turns),), version, dtype=torch.long)},
        {
            "response_tokens": [list(t[0]) for t in turns],
            "token_logprobs": [list(t[1]) for t in turns],
            "finish_reason": [t[2] for t in turns],
        },
        dict(meta or {}),
    )


def add_turns(rows: Sequence[TokenRow], out: Batch) -> None:
    """Append each row's turn of an engine call (:func:`build_response`), with its routed
    experts where the engine recorded them (:func:`take_routed_experts`)."""
    routing = out.column(ROUTED_EXPERTS) if ROUTED_EXPERTS in out else [None] * len(rows)
    for row, ids, logprobs, reason, version, experts in zip(
        rows,
        out.column("response_tokens"),
        out.column("token_logprobs"),
        out.column("finish_reason"),
        out.tensor("weights_version").tolist(),
        routing,
    ):
        extras = None if experts is None else take_routed_experts(row, experts, len(ids))
        row.add_turn(list(ids), list(logprobs), str(reason), int(version), extras)


def add_turn_result(row: TokenRow, result: TurnResult) -> None:
    """Append one streamed turn to ``row``, with its routed experts where recorded."""
    experts = result.routed_experts
    extras = None if experts is None else take_routed_experts(row, experts, len(result.ids))
    row.add_turn(result.ids, result.logprobs, result.finish_reason, result.weights_version, extras)


def take_routed_experts(
    row: TokenRow, routing: torch.Tensor, new_tokens: int
) -> dict[str, list[Any]]:
    """File one engine call's ``routing`` of a row ([context + new_tokens - 1, layers, k], in
    token order) on the row: the prompt's part as the row's prompt extra, and the returned
    per-token extra of its ``new_tokens`` response tokens (the last one None: never fed).
    A row's first call only: a later call's context holds response tokens already routed
    (possibly by older weights), which ``algorithm.router_replay`` does not reconcile yet."""
    if row.response_ids:
        raise ValueError(
            "routed experts of a continued row (another turn, a partial rollout) are not "
            "carried: algorithm.router_replay=rollout needs single_turn rows sampled whole "
            "(rollout.partial_chunk_tokens=0)"
        )
    prompt = len(row.prompt_ids)
    if routing.shape[0] != prompt + new_tokens - 1:
        raise ValueError(
            f"routed experts of {routing.shape[0]} tokens for a prompt of {prompt} and "
            f"{new_tokens} new tokens (expected {prompt + new_tokens - 1})"
        )
    row.prompt_extras[ROUTED_EXPERTS] = list(routing[:prompt])
    response = list(routing[prompt:])
    return {ROUTED_EXPERTS: response + [None] if new_tokens else []}


def sample_turns(
    generate: Callable[[Batch], Batch],
    rows: Sequence[TokenRow],
    seeds: Sequence[int],
    caps: Sequence[int] | None,
    meta: dict[str, Any],
) -> Batch:
    """One blocking engine call that appends a turn to every row; the call's response."""
    out = generate(
        build_request([r.context for r in rows], seeds, caps, meta, read_row_images(rows))
    )
    add_turns(rows, out)
    return out


def read_prompt_rows(prompts: Batch) -> list[TokenRow]:
    """A row per prompt row of a Batch (left-padded ``prompt_ids``), with its seed and, where
    the prompts have an ``images`` column, its images as a row extra."""
    images = list(prompts.column(IMAGES)) if IMAGES in prompts else [[]] * len(prompts)
    return [
        TokenRow(ids[mask.bool()].tolist(), seed=int(seed), row_extras=image_extras(row_images))
        for ids, mask, seed, row_images in zip(
            prompts.tensor("prompt_ids"),
            prompts.tensor("prompt_mask"),
            prompts.column("seed"),
            images,
        )
    ]


def image_extras(images: Sequence[bytes]) -> dict[str, Any]:
    """The row extras of a prompt with ``images`` (none for a text prompt)."""
    return {IMAGES: list(images)} if len(images) else {}


def attach(prompts: Batch, grid: Batch) -> Batch:
    """The prompt rows' keys and meta, with the grid's keys in place of the ones both have."""
    return Batch(prompts.tensors | grid.tensors, prompts.columns | grid.columns, dict(prompts.meta))


def generate_batch(generate: Callable[[Batch], Batch], prompts: Batch, width: int) -> Batch:
    """The prompt rows with one sampled turn each (capped by a ``max_tokens`` tensor where
    the prompts have one), as a training grid: the ``single_turn`` agent."""
    rows = read_prompt_rows(prompts)
    caps = prompts.tensor("max_tokens").tolist() if "max_tokens" in prompts else None
    sample_turns(generate, rows, [r.seed for r in rows], caps, prompts.meta)
    pad = int(prompts.meta["pad_token_id"])
    return attach(prompts, collate(rows, width, pad))
