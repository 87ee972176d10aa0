"""Token rows and their one collate: the padded grid, each token's version, the extras a
workload adds per token or per row, and the list wire of an engine call."""

from __future__ import annotations

import torch

from rlframe.core.protocol import Batch
from rlframe.rollout.rows import (
    TokenRow,
    add_turns,
    build_request,
    build_response,
    collate,
    read_prompt_rows,
    sample_turns,
)

PAD = 0


def two_rows() -> list[TokenRow]:
    """Row 0: turn (v1) | observation | turn (v2), with routed experts per sampled token.
    Row 1: a longer prompt and one turn (v3) without extras."""
    a = TokenRow([5, 6], seed=7)
    a.add_turn([11, 12], [-0.5, -0.25], "stop", 1, {"experts": [[1, 2], [3, 4]]})
    a.add_observation([40])
    a.add_turn([13], [-1.0], "length", 2, {"experts": [[5, 6]]})
    a.row_extras = {"episode": 0, "env_reward": 0.5, "prompt": "a"}
    b = TokenRow([7, 8, 9])
    b.add_turn([21], [-2.0], "stop", 3)
    b.row_extras = {"episode": 1, "env_reward": 1, "prompt": "b"}
    return [a, b]


def test_collate_pads_prompts_left_responses_right_and_versions_by_token() -> None:
    grid = collate(two_rows(), width=6, pad_id=PAD)
    assert grid["prompt_ids"].tolist() == [[PAD, 5, 6], [7, 8, 9]]
    assert grid["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert grid["response_ids"].tolist() == [[11, 12, 40, 13, PAD, PAD], [21] + [PAD] * 5]
    assert grid["response_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert grid["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert grid["rollout_logprobs"].tolist() == [
        [-0.5, -0.25, 0.0, -1.0, 0.0, 0.0],
        [-2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    ]
    # An observation carries the version of the turn before it; padding the row's first.
    assert grid["token_version"].tolist() == [[1, 1, 1, 2, 1, 1], [3] * 6]
    assert grid["weights_version"].tolist() == [1, 3]
    assert list(grid["finish_reason"]) == ["length", "stop"]


def test_extras_pass_through_collate_by_name() -> None:
    grid = collate(two_rows(), width=5, pad_id=PAD)
    # Per token: [rows, width, 2], zeros on observations, padding and rows without any.
    assert grid["experts"].tolist() == [
        [[1, 2], [3, 4], [0, 0], [5, 6], [0, 0]],
        [[0, 0]] * 5,
    ]
    assert grid["experts"].dtype == torch.long
    # Per row: ints stay int64, other numbers float32, anything else a column.
    assert grid["episode"].dtype == torch.long and grid["episode"].tolist() == [0, 1]
    assert grid["env_reward"].dtype == torch.float32
    assert grid["env_reward"].tolist() == [0.5, 1.0]
    assert list(grid["prompt"]) == ["a", "b"]


def test_a_row_no_call_ran_carries_the_version_given() -> None:
    grid = collate([TokenRow([5], finish_reason="env_error")], width=3, pad_id=PAD, version=4)
    assert grid["token_version"].tolist() == [[4, 4, 4]]
    assert grid["response_mask"].sum() == 0


def test_the_wire_carries_each_rows_context_and_appends_its_turn() -> None:
    rows = two_rows()
    request = build_request([r.context for r in rows], [1, 2], [3, 4], {"greedy": True})
    assert list(request["prompt_tokens"]) == [[5, 6, 11, 12, 40, 13], [7, 8, 9, 21]]
    assert request["max_tokens"].tolist() == [3, 4] and request.meta == {"greedy": True}
    # Unequal lengths cross as they are: the rank split chunks rows, never a rectangle.
    assert [len(c) for c in request.chunk(2)] == [1, 1]
    add_turns(rows, build_response([([14], [-0.1], "stop"), ([], [], "length")], 5))
    assert rows[0].response_ids[-1] == 14 and rows[0].versions[-1] == 5
    assert rows[1].response_ids == [21] and rows[1].turns == 2
    assert rows[0].sampled == 4 and rows[0].finish_reason == "stop"


def test_images_travel_in_the_rows_to_every_engine_call_and_into_the_grid() -> None:
    """A vision-language prompt's images become its rows' extra: each call that continues
    the row sends them with its context (vLLM needs them for the image pads), and the grid
    carries them to the trainer's forward. A text prompt's call carries no images column."""
    prompts = Batch(
        {
            "prompt_ids": torch.tensor([[PAD, 5], [6, 7]]),
            "prompt_mask": torch.tensor([[0, 1], [1, 1]]),
        },
        {"seed": [1, 2], "images": [[b"png-a"], []]},
    )
    rows = read_prompt_rows(prompts)
    sent: list[Batch] = []

    def engine(request: Batch) -> Batch:
        sent.append(request)
        return build_response([([9], [-0.5], "length")] * len(request), 1)

    sample_turns(engine, rows, [1, 2], None, {})
    sample_turns(engine, rows, [3, 4], None, {})  # a continuation sends them again
    assert [list(r["images"]) for r in sent] == [[[b"png-a"], []]] * 2
    grid = collate(rows, width=2, pad_id=PAD)
    assert list(grid["images"]) == [[b"png-a"], None]
    text = read_prompt_rows(Batch(prompts.tensors, {"seed": [1, 2]}))
    sample_turns(engine, text, [1, 2], None, {})
    assert "images" not in sent[-1]
