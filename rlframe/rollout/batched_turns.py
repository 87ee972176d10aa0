"""An engine replica's ``serve`` over a blocking batch ``generate``.

For an engine reached by one call per batch of rows (``Batch -> Batch``, the wire of
:mod:`rlframe.rollout.rows`) rather than by the request stream: scripted engines in tests, or
a group whose workers have no ``serve``. The :class:`~rlframe.rollout.engine_client.EngineClient`
over it queues the requests as for any replica; each of its calls is one ``generate`` per
sampling kind (temperature and stop ids) among the new requests, which all finish in it.
"""

from __future__ import annotations

from collections.abc import Callable

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.rollout.engine_client import Serve
from rlframe.rollout.rows import build_request
from rlframe.rollout.turns import TurnRequest, TurnResult


def serve_by_generate(generate: Callable[[Batch], Batch]) -> Serve:
    """A ``serve`` that samples every new request whole, in calls of ``generate``."""

    def serve(requests: list[TurnRequest]) -> list[TurnResult]:
        kinds: dict[tuple[float | None, tuple[int, ...]], list[TurnRequest]] = {}
        for r in requests:
            kinds.setdefault((r.temperature, r.stop_ids), []).append(r)
        return [result for alike in kinds.values() for result in call(generate, alike)]

    return serve


def call(generate: Callable[[Batch], Batch], requests: list[TurnRequest]) -> list[TurnResult]:
    """One blocking ``generate`` over ``requests`` (alike in temperature and stop ids)."""
    first = requests[0]
    meta: dict[str, object] = {"stop_token_ids": list(first.stop_ids), "more_turns": True}
    if first.temperature == 0:
        meta["greedy"] = True
    elif first.temperature is not None:
        meta["temperature"] = first.temperature
    images = [list(r.images) for r in requests]
    out = generate(
        build_request(
            [r.context for r in requests],
            [r.seed for r in requests],
            [r.max_tokens for r in requests],
            meta,
            images if any(images) else None,
        )
    )
    routing = out.column(ROUTED_EXPERTS) if ROUTED_EXPERTS in out else [None] * len(requests)
    return [
        TurnResult(r.request_id, list(ids), list(logprobs), str(reason), int(version), -1, experts)
        for r, ids, logprobs, reason, version, experts in zip(
            requests,
            out.column("response_tokens"),
            out.column("token_logprobs"),
            out.column("finish_reason"),
            out.tensor("weights_version").tolist(),
            routing,
            strict=True,
        )
    ]
