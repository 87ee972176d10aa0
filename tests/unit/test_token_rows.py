"""Token rows and their one collate: the padded grid, each token's version, the typed fields
a workload adds per row or per token, and the list wire of an engine call."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rlframe.core.protocol import Batch
from rlframe.rollout.rows import (
    AgentStats,
    TokenRow,
    add_turns,
    build_request,
    build_response,
    collate,
    per_row,
    per_token,
    read_prompt_rows,
    sample_turns,
)

PAD = 0


def prompt_rows(n: int, **columns: list[object]) -> Batch:
    """The prompt rows of ``n`` rows: a group id each, and ``columns``."""
    return Batch({"group": torch.arange(n)}, {"ground_truth": ["1"] * n, **columns})


def two_rows() -> list[TokenRow]:
    """Row 0: turn (v1) | observation | turn (v2), an agent's counters and its prompt text.
    Row 1: a longer prompt and one turn (v3), the counters of a failed episode."""
    a = TokenRow([5, 6], seed=7)
    a.add_turn([11, 12], [-0.5, -0.25], "stop", 1)
    a.add_observation([40])
    a.add_turn([13], [-1.0], "length", 2)
    a.agent, a.prompt = AgentStats(env_reward=0.5, agent_episode=0), "a"
    b = TokenRow([7, 8, 9])
    b.add_turn([21], [-2.0], "stop", 3)
    b.agent = AgentStats(env_failed=1.0, agent_episode=1)
    return [a, b]


def test_collate_pads_prompts_left_responses_right_and_versions_by_token() -> None:
    grid = collate(two_rows(), prompt_rows(2), width=6, pad_id=PAD)
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


def test_typed_fields_become_grid_keys_of_their_names() -> None:
    prompts = prompt_rows(2, prompt=["loader a", "loader b"])
    grid = collate(two_rows(), prompts, width=5, pad_id=PAD)
    # The prompt rows' keys come along; the grid's own replace theirs.
    assert grid["group"].tolist() == [0, 1] and list(grid["ground_truth"]) == ["1", "1"]
    # An agent's counters: ints int64, other numbers float32; optional ones only when set.
    assert grid["agent_episode"].dtype == torch.long and grid["agent_episode"].tolist() == [0, 1]
    assert grid["env_reward"].dtype == torch.float32
    assert grid["env_reward"].tolist() == [0.5, 0.0] and grid["env_failed"].tolist() == [0, 1]
    assert "agent_reward_given" not in grid and "agent_obs_images" not in grid
    # A per-row text: the row's where it has one, the prompt row's where it has none.
    assert list(grid["prompt"]) == ["a", "loader b"]
    # Single-turn rows carry no counters: none of their keys.
    plain = collate([TokenRow([5], [6], [1], [0.0], [0])], prompt_rows(1), width=2, pad_id=PAD)
    assert "env_reward" not in plain and "agent_turns" not in plain and "prompt" not in plain


@dataclass
class JudgedRow(TokenRow):
    """What another workload adds: one line per field."""

    judge_score: float | None = per_row()
    teacher_logprobs: list[float] = per_token()


def test_a_field_declared_on_the_row_reaches_the_grid_without_touching_collate() -> None:
    a = JudgedRow([5], [6, 7], [1, 1], [-0.5, -0.5], [0, 0], judge_score=0.25)
    a.teacher_logprobs = [-0.1, -0.2]
    b = JudgedRow([5], [8], [1], [-0.5], [0], judge_score=1)
    grid = collate([a, b], prompt_rows(2), width=3, pad_id=PAD)
    assert grid["judge_score"].dtype == torch.float32
    assert grid["judge_score"].tolist() == [0.25, 1.0]
    expected = torch.tensor([[-0.1, -0.2, 0], [0, 0, 0]])
    assert torch.equal(grid["teacher_logprobs"], expected)


def test_collate_needs_one_prompt_row_per_row() -> None:
    with pytest.raises(ValueError, match="2 rows with 1 prompt rows"):
        collate(two_rows(), prompt_rows(1), width=6, pad_id=PAD)


def test_a_row_no_call_ran_carries_the_version_given() -> None:
    row = TokenRow([5], finish_reason="env_error")
    grid = collate([row], prompt_rows(1), width=3, pad_id=PAD, version=4)
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
    """A vision-language prompt's images become its rows' ``images``: each call that continues
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
    grid = collate(rows, prompts, width=2, pad_id=PAD)
    assert list(grid["images"]) == [[b"png-a"], []]
    assert [r.source for r in rows] == [0, 1] and grid["prompt_ids"].tolist() == [[PAD, 5], [6, 7]]
    text = read_prompt_rows(Batch(prompts.tensors, {"seed": [1, 2]}))
    sample_turns(engine, text, [1, 2], None, {})
    assert "images" not in sent[-1]
