"""The experience producer's checkpoint state with what rows carry beyond token ids: a
prompt's images (bytes) and a token's routed experts (tensors) go through JSON exactly, and a
resumed producer sends the engine the very requests the straight one sent (the scripted
engine of tests/unit/scripted_engine.py stands in for the rollout group)."""

from __future__ import annotations

import io
import json
import math
import struct
from typing import Any

import pytest
import torch

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.rollout.partial import restore_row
from rlframe.rollout.rows import TokenRow
from rlframe.rollout.state_json import BLOBS, decode_state, encode_state
from tests.unit.scripted_engine import Engine, make_producer, run_steps


def make_pngs(count: int) -> list[bytes]:
    """``count`` distinct 4 x 4 PNG images."""
    from PIL import Image

    pngs = []
    for i in range(count):
        out = io.BytesIO()
        Image.new("RGB", (4, 4), (40 * i, 255 - 40 * i, 7)).save(out, format="PNG")
        pngs.append(out.getvalue())
    return pngs


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))


def assert_same_requests(a: list[Batch], b: list[Batch]) -> None:
    """Engine calls equal in what the engine reads: contexts, seeds, caps and images."""
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.columns.keys() == y.columns.keys(), i
        for key in x.columns:
            assert x.column(key).tolist() == y.column(key).tolist(), (i, key)
        assert torch.equal(x["max_tokens"], y["max_tokens"]), i


def resume_after(steps: int, engine_args: dict[str, Any], **producer: Any) -> dict[str, Any]:
    """A straight producer run ``steps`` + 3 steps, and one resumed from its state (through
    JSON) after ``steps``: their batches and the engine calls after the state."""
    engine = Engine(**engine_args)
    straight = make_producer(engine, **producer)
    run_steps(straight, engine, steps)
    state = through_json(straight.state_dict())
    calls_before = len(engine.requests)
    rest = run_steps(straight, engine, 3)

    resumed_engine = Engine(**engine_args)
    resumed_engine.version = steps
    resumed = make_producer(resumed_engine, **producer)
    resumed.load_state_dict(state)
    again = run_steps(resumed, resumed_engine, 3)
    return {
        "state": state,
        "straight": [b for b, _ in rest],
        "resumed": [b for b, _ in again],
        "straight_calls": engine.requests[calls_before:],
        "resumed_calls": resumed_engine.requests,
    }


def test_rows_with_images_in_flight_resume_exactly() -> None:
    """Staleness 1 with partial responses: the state holds rows part-way whose continuation
    calls must send their prompt's images again; the resumed calls equal the straight ones."""
    pngs = make_pngs(3)
    out = resume_after(3, {}, k=1, chunk=3, images=pngs)
    groups = decode_state(out["state"])["groups"]
    partial = [r for g in groups for r in g.get("rows", []) if r["response_ids"]]
    assert partial, "no response in flight: the test would not test continued image rows"
    assert all(r["images"][0] in pngs for r in partial)
    # Each image once in the blob table, however many rows and records show it.
    assert len(out["state"][BLOBS]) <= len(pngs)
    assert_same_requests(out["straight_calls"], out["resumed_calls"])
    assert all(len(i) == 1 for call in out["resumed_calls"] for i in call.column("images"))
    for a, b in zip(out["straight"], out["resumed"]):
        for key in ("group", "response_ids", "token_version", "rollout_logprobs", "reward"):
            assert torch.equal(a[key], b[key]), key
        assert a.column("images").tolist() == b.column("images").tolist()


def test_rows_with_routed_experts_resume_exactly() -> None:
    """Router replay's per-token tensors under staleness 1 (whole responses, as the config
    allows) and a call running during the update (a separate rollout pool): the state holds
    the groups it scored ahead of the trainer, with their routing."""
    out = resume_after(2, {"routing": True}, k=1, chunk=0, overlap=True, router_replay="rollout")
    groups = decode_state(out["state"])["groups"]
    assert any("scored" in g for g in groups), "nothing ahead: no routing in the state"
    for a, b in zip(out["straight"], out["resumed"]):
        assert a[ROUTED_EXPERTS].dtype == torch.int16
        assert (a[ROUTED_EXPERTS] >= 0).any()
        for key in ("group", "response_ids", "token_version", ROUTED_EXPERTS):
            assert torch.equal(a[key], b[key]), key


def test_the_state_codec_is_exact_for_bytes_and_tensors() -> None:
    nan = struct.unpack("<f", struct.pack("<I", 0x7FC00123))[0]  # a NaN with a payload
    values = {
        "f32": torch.tensor([[-0.0, 1 / 3], [nan, 1e-45]]),
        "bf16": torch.tensor([1.0078125, -3.5], dtype=torch.bfloat16),
        "i16": torch.arange(12, dtype=torch.int16).view(2, 3, 2) - 5,
        "empty": torch.zeros((0, 3), dtype=torch.int64),
        "png": make_pngs(1)[0],
    }
    row = TokenRow([1, 2], [3, 4], [1, 1], [-0.5, -0.25], [0, 1], seed=7)
    row.routed_experts = values["i16"][0]
    row.images = [values["png"], values["png"]]
    saved = through_json(encode_state({"values": values, "row": vars(row)}))
    back = decode_state(saved)
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            got = back["values"][key]
            assert got.dtype == value.dtype and got.shape == value.shape, key
            # Bit for bit: the NaN's payload and the sign of zero too.
            assert torch.equal(got.view(-1).view(torch.uint8), value.view(-1).view(torch.uint8))
        else:
            assert back["values"][key] == value
    assert math.copysign(1.0, float(back["values"]["f32"][0, 0])) == -1.0
    restored = restore_row(back["row"])
    assert restored.images == [values["png"]] * 2
    assert restored.routed_experts is not None
    assert torch.equal(restored.routed_experts, values["i16"][0])
    assert restored.response_ids == [3, 4] and restored.seed == 7
    # Four tensors, the row's routing and the png once, though the row shows it twice more.
    assert len(saved[BLOBS]) == 6
    with pytest.raises(TypeError, match=r"x\.y\[1\]: a set cannot be saved"):
        encode_state({"x": {"y": [1, {2}]}})


def test_a_row_saved_before_typed_fields_restores_its_images_and_routing() -> None:
    """A checkpoint of a row in flight from before rows had typed fields: images as a row
    extra, routing as one tensor per prompt token and per response token (None for the last)."""
    routing = torch.arange(12, dtype=torch.int16).view(3, 2, 2)
    old = {
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "loss_mask": [1, 1],
        "logprobs": [-0.5, -0.25],
        "versions": [0, 0],
        "row_extras": {"images": [b"png"]},
        "prompt_extras": {ROUTED_EXPERTS: [routing[0], routing[1]]},
        "token_extras": {ROUTED_EXPERTS: [routing[2], None]},
    }
    row = restore_row(old)
    assert row.images == [b"png"] and row.response_ids == [3, 4]
    assert row.routed_experts is not None and torch.equal(row.routed_experts, routing)
