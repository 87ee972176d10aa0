"""Token rows: the one form a sequence takes from the engine to the training grid.

A :class:`TokenRow` is one sequence as lists: its prompt ids, its response ids (sampled turns,
loss mask 1, and whatever came between them, loss mask 0), the engine's log-prob and the
weights version of each response token, and typed fields for what a workload adds: the row's
``images``, its ``routed_experts`` (one array per row), an agent's :class:`AgentStats`, and any
field declared with :func:`per_row` or :func:`per_token`. Every agent grows rows turn by turn
(:meth:`TokenRow.add_turn`, :meth:`TokenRow.add_observation`) and returns them; the experience
producer turns them into the padded Batch training reads with :func:`collate`, in one place.

Adding a field to the row is one line in :class:`TokenRow` (or a subclass): a per-row number
``judge_score: float | None = per_row()`` becomes the grid's ``[rows]`` tensor
``judge_score``; a per-token list ``teacher_logprobs: list[float] = per_token()`` becomes a
``[rows, width]`` float tensor, right-padded with 0 like ``rollout_logprobs``.

The rollout wire carries lists too (:func:`build_request`, :func:`build_response`): a
request's ``prompt_tokens`` column holds each row's whole context, a response's
``response_tokens`` and ``token_logprobs`` columns each row's new tokens. Rows split over the
rollout ranks as they are; nothing is padded to a rectangle to cross.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from rlframe.controller.reads import IMAGES
from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.models.moe_routing import NOT_RECORDED
from rlframe.rollout.turns import TurnResult

PER_ROW = "rlframe.per_row"
PER_TOKEN = "rlframe.per_token"


def per_row(default: Any = None) -> Any:
    """A :class:`TokenRow` field that :func:`collate` turns into a grid key of its name: ints
    an int64 ``[rows]`` tensor, other numbers float32, text a column. None on every row: no
    key; None on some: the prompt row's value of that key where the prompts have it, else 0."""
    return field(default=default, metadata={PER_ROW: True})


def per_token() -> Any:
    """A :class:`TokenRow` field of one float per response token (a list) that
    :func:`collate` turns into a float32 ``[rows, width]`` tensor, right-padded with 0
    (rows whose list is empty or shorter are padded alike)."""
    return field(default_factory=list, metadata={PER_TOKEN: True})


@dataclass
class AgentStats:
    """An agent's counters of one row (an episode); each field is a grid key of its name.
    Optional ones (None) are left out of the grid when no row has them."""

    env_reward: float = 0.0
    """The sum of the env's step rewards (``agent.env_reward_weight`` weighs it)."""
    env_failed: float = 0.0
    """1 where the env (or an ``openai`` agent) raised or timed out."""
    agent_turns: float = 0.0
    agent_tool_calls: float = 0.0
    agent_tool_errors: float = 0.0
    agent_obs_tokens: float = 0.0
    """Response tokens the policy did not sample (observations)."""
    agent_obs_cut: float = 0.0
    """Observations cut to ``agent.max_obs_tokens``."""
    agent_obs_images: float | None = None
    """Images the observations showed (``multi_turn``)."""
    agent_reward_given: float | None = None
    """1 where the ``openai`` agent returned the reward, 0 where ``reward.fn`` scores it."""
    agent_episode: int | None = None
    """The episode (prompt row) an ``openai`` row belongs to: an episode may make several."""


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
    source: int = -1
    """The prompt row this row answers: its index in the prompts the agent got (-1: the
    row's own position in what the agent returns). An agent may return several rows per
    prompt (the ``openai`` agent's forks)."""
    images: list[bytes] = field(default_factory=list)
    """A vision-language row's images (encoded), in the order of their pads in the row."""
    routed_experts: torch.Tensor | None = None
    """The experts the engine routed each fed token to, one int16 array per row
    ``[prompt + response - 1, MoE layers, top_k]`` in token order
    (:mod:`rlframe.models.moe_routing`); None: not recorded."""
    agent: AgentStats | None = None
    """An agent's counters of the row (``multi_turn``, ``openai``); None: single-turn."""
    prompt: str | None = per_row()
    """The prompt's text as the policy saw it, where an agent built the prompt (an env's
    opening messages); None: the prompt row's."""

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
        self, ids: list[int], logprobs: list[float], finish_reason: str, version: int
    ) -> None:
        """Append tokens the engine sampled with weights ``version``."""
        self.add_tokens(ids, [1] * len(ids), logprobs, [version] * len(ids))
        self.turns += 1
        self.finish_reason = finish_reason
        if self.first_version < 0:
            self.first_version = version

    def add_observation(self, ids: list[int]) -> None:
        """Append tokens the policy did not sample (loss mask 0, log-prob 0)."""
        self.add_tokens(ids, [0] * len(ids), [0.0] * len(ids), self.versions[-1:] * len(ids))

    def add_tokens(
        self, ids: list[int], mask: list[int], logprobs: list[float], versions: list[int]
    ) -> None:
        self.response_ids += ids
        self.loss_mask += mask
        self.logprobs += logprobs
        self.versions += versions


def collate(
    rows: Sequence[TokenRow], prompts: Batch, width: int, pad_id: int, version: int = 0
) -> Batch:
    """The padded training grid of ``rows``, with the keys of ``prompts`` (row ``i`` the
    prompt row of ``rows[i]``: ground truth, group, texts) where the grid has none:
    ``prompt_ids``/``prompt_mask`` left-padded to the longest prompt; ``response_ids``,
    ``response_mask``, ``loss_mask``, ``rollout_logprobs``, ``token_version`` right-padded to
    ``width``; per row ``weights_version`` (its oldest token's) and the column
    ``finish_reason``; then the typed fields: ``images`` (a column, when the prompts or a row
    have images), ``routed_experts`` laid over prompt + response (-1 where none), the
    agent's counters, and the :func:`per_row` / :func:`per_token` fields. Padding (and an
    empty response) carries the row's first version, or ``version`` for a row no call ran."""
    n = len(rows)
    if len(prompts) != n:
        raise ValueError(f"{n} rows with {len(prompts)} prompt rows")
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
    if IMAGES in prompts or any(r.images for r in rows):
        columns[IMAGES] = [list(r.images) for r in rows]
    routing = [r.routed_experts for r in rows]
    if any(x is not None for x in routing):
        tensors[ROUTED_EXPERTS] = lay_routed_experts(rows, longest, width)
    stats = [r.agent for r in rows]
    if any(s is not None for s in stats):
        for name in (f.name for f in fields(AgentStats)):
            values = [None if s is None else getattr(s, name) for s in stats]
            add_row_values(name, values, prompts, tensors, columns)
    for f in fields(rows[0]) if rows else ():
        if f.metadata.get(PER_ROW):
            add_row_values(f.name, [getattr(r, f.name) for r in rows], prompts, tensors, columns)
        elif f.metadata.get(PER_TOKEN):
            tensors[f.name] = pad_token_values([getattr(r, f.name) for r in rows], width)
    return Batch(prompts.tensors | tensors, prompts.columns | columns, dict(prompts.meta))


def add_row_values(
    name: str,
    values: list[Any],
    prompts: Batch,
    tensors: dict[str, torch.Tensor],
    columns: dict[str, Any],
) -> None:
    """One per-row field into the grid (see :func:`per_row`)."""
    if all(v is None for v in values):
        return
    fallback = prompts[name] if name in prompts else [0] * len(values)
    values = [fallback[i] if v is None else v for i, v in enumerate(values)]
    if all(type(v) is int for v in values):
        tensors[name] = torch.tensor(values, dtype=torch.long)
    elif all(isinstance(v, int | float) for v in values):
        tensors[name] = torch.tensor([float(v) for v in values])
    else:
        columns[name] = values


def pad_token_values(values: list[list[float]], width: int) -> torch.Tensor:
    """``[rows, width]`` float32 of one per-token field, right-padded with 0."""
    out = torch.zeros(len(values), width)
    for i, row in enumerate(values):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def lay_routed_experts(rows: Sequence[TokenRow], prompt_width: int, width: int) -> torch.Tensor:
    """``[rows, prompt_width + width, layers, k]`` of the rows' routed experts, aligned with
    ``prompt_ids`` + ``response_ids`` (prompts left-padded, responses right-padded);
    -1 where a token has none (padding, the last response token, a row without routing).
    One copy per row: each row's routing is one array."""
    known = [r.routed_experts for r in rows if r.routed_experts is not None]
    shape, dtype = known[0].shape[1:], known[0].dtype
    out = torch.full((len(rows), prompt_width + width, *shape), NOT_RECORDED, dtype=dtype)
    for i, r in enumerate(rows):
        if r.routed_experts is not None:
            start = prompt_width - len(r.prompt_ids)
            out[i, start : start + r.routed_experts.shape[0]] = r.routed_experts
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
    """Each row's images; None when no row has any, so a text model's request carries no
    images column."""
    images = [list(r.images) for r in rows]
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
        if experts is not None:
            take_routed_experts(row, experts, len(ids))
        row.add_turn(list(ids), list(logprobs), str(reason), int(version))


def add_turn_result(row: TokenRow, result: TurnResult) -> None:
    """Append one streamed turn to ``row``, with its routed experts where recorded."""
    if result.routed_experts is not None:
        take_routed_experts(row, result.routed_experts, len(result.ids))
    row.add_turn(result.ids, result.logprobs, result.finish_reason, result.weights_version)


def take_routed_experts(row: TokenRow, routing: torch.Tensor, new_tokens: int) -> None:
    """Keep one engine call's ``routing`` of a row ([context + new_tokens - 1, layers, k], in
    token order) as the row's ``routed_experts``, whole: one array per row, never one per
    token. A row's first call only: a later call's context holds response tokens already
    routed (possibly by older weights), which ``algorithm.router_replay`` does not reconcile
    yet."""
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
    row.routed_experts = routing


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
    """A row per prompt row of a Batch (left-padded ``prompt_ids``), with its seed, its
    ``source`` (its index) and, where the prompts have an ``images`` column, its images: the
    one place prompt padding is taken off."""
    images = list(prompts.column(IMAGES)) if IMAGES in prompts else [[]] * len(prompts)
    return [
        TokenRow(ids[mask.bool()].tolist(), seed=int(seed), source=i, images=list(row_images))
        for i, (ids, mask, seed, row_images) in enumerate(
            zip(
                prompts.tensor("prompt_ids"),
                prompts.tensor("prompt_mask"),
                prompts.column("seed"),
                images,
            )
        )
    ]


def sample_single_turn(generate: Callable[[Batch], Batch], prompts: Batch) -> list[TokenRow]:
    """The prompt rows with one sampled turn each (capped by a ``max_tokens`` tensor where
    the prompts have one): the ``single_turn`` agent's rows."""
    rows = read_prompt_rows(prompts)
    caps = prompts.tensor("max_tokens").tolist() if "max_tokens" in prompts else None
    sample_turns(generate, rows, [r.seed for r in rows], caps, prompts.meta)
    return rows
