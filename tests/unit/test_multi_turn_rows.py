"""What each row of a multi-turn batch carries besides its ids: the weights version of every
token, the seeds each turn samples with, the prompt columns the env sees, the prompt mask,
and the prompt-length limit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlframe.core.protocol import Batch
from rlframe.envs import EnvError, StepResult
from tests.unit.scripted_episodes import (
    EOS,
    GUESS,
    HINTS,
    ScriptedPolicy,
    encode,
    make_config,
    make_prompts,
    run,
)


class VersionedPolicy(ScriptedPolicy):
    """The scripted policy behind an engine whose weights move on by one each call (with one
    episode, version k + 1 samples turn k), and which records the seeds each row (episode)
    is asked to sample with, turn by turn."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seeds: dict[int, list[int]] = {}

    def __call__(self, batch: Batch) -> Batch:
        for context, seed in zip(batch["prompt_tokens"], batch["seed"], strict=True):
            row = next(r for r, p in enumerate(self.prompts) if list(context[: len(p)]) == p)
            self.seeds.setdefault(row, []).append(int(seed))
        out = super().__call__(batch)
        return out.with_tensors(weights_version=torch.full((len(out),), len(self.calls)))


def test_each_token_carries_the_version_that_sampled_it() -> None:
    policy = VersionedPolicy(["a:"], [["5<eos>", "8<eos>", "9<eos>"]], width=12)
    batch = run(
        make_config(GUESS, 1, env_kwargs=HINTS, max_turns=3), policy, make_prompts(["a:"], ["9"])
    )
    turn, obs = len(encode("5") + [EOS]), len(encode(" higher:"))
    n = 3 * turn + 2 * obs
    # An observation carries the version of the turn before it; padding the first turn's.
    expected = [1] * (turn + obs) + [2] * (turn + obs) + [3] * turn
    assert batch["token_version"][0, :n].tolist() == expected
    assert batch["token_version"][0, n:].eq(1).all()
    assert batch["weights_version"].tolist() == [1]


def test_first_turn_samples_with_the_row_seed_later_turns_with_their_own() -> None:
    prompts = ["a:", "b:", "c:"]
    policy = VersionedPolicy(prompts, [["1<eos>", "2<eos>", "3<eos>"]] * 3, width=12)
    rows = make_prompts(prompts, ["9"] * 3)
    run(make_config(GUESS, 3, env_kwargs=HINTS, max_turns=3), policy, rows)
    # Turn 1 samples what a single-turn rollout of the row would.
    first = [policy.seeds[row][0] for row in range(3)]
    assert first == [int(s) for s in rows["seed"]]
    later = [s for row in range(3) for s in policy.seeds[row][1:]]
    # Later turns: 31-bit seeds (what the engine takes), none repeating an earlier stream.
    assert all(0 <= s < 2**31 for s in later)
    assert len(set(first + later)) == 9
    # The same prompts sample the same seeds again: runs are reproducible.
    again = VersionedPolicy(prompts, [["1<eos>", "2<eos>", "3<eos>"]] * 3, width=12)
    run(make_config(GUESS, 3, env_kwargs=HINTS, max_turns=3), again, rows)
    assert again.seeds == policy.seeds


class RecordingEnv:
    samples: list[dict[str, Any]] = []

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        RecordingEnv.samples.append(sample)
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        return StepResult([], 1.0, True, {})


def test_prompts_without_chat_turns_reach_every_env() -> None:
    RecordingEnv.samples = []
    prompts = ["a:", "b:", "c:"]
    rows = make_prompts(prompts, ["1", "2", "3"])
    rows = Batch(
        rows.tensors, {k: v for k, v in rows.columns.items() if k != "messages"}, rows.meta
    )
    policy = ScriptedPolicy(prompts, [["1<eos>"]] * 3, width=4)
    batch = run(
        make_config("tests.unit.test_multi_turn_rows:RecordingEnv", 3, max_tokens=4), policy, rows
    )
    assert [(s["prompt"], s["ground_truth"], s["messages"]) for s in RecordingEnv.samples] == [
        ("a:", "1", None),
        ("b:", "2", None),
        ("c:", "3", None),
    ]
    assert batch["env_reward"].tolist() == [1.0, 1.0, 1.0]


def test_prompt_mask_is_one_on_prompt_tokens_only() -> None:
    prompts = ["a:", "bbb:"]
    policy = ScriptedPolicy(prompts, [["1<eos>"]] * 2, width=4)
    batch = run(
        make_config("tests.unit.test_multi_turn_rows:RecordingEnv", 2, max_tokens=4),
        policy,
        make_prompts(prompts, ["0", "0"]),
    )
    short, long = len(encode("a:")), len(encode("bbb:"))
    assert batch["prompt_mask"].tolist() == [[0] * (long - short) + [1] * short, [1] * long]
    assert batch["response_mask"][:, :2].tolist() == [[1, 1], [1, 1]]


@pytest.mark.parametrize("length", [16, 17])
def test_prompt_may_fill_max_prompt_length_exactly(length: int) -> None:
    prompt = "a" * length
    assert len(encode(prompt)) == length
    policy = ScriptedPolicy([prompt], [["1<eos>"]], width=4)
    cfg = make_config("tests.unit.test_multi_turn_rows:RecordingEnv", 1, max_tokens=4)
    assert cfg.data.max_prompt_length == 16
    if length == 16:
        assert run(cfg, policy, make_prompts([prompt], ["0"]))["env_reward"].item() == 1.0
    else:
        with pytest.raises(EnvError, match="17 tokens .* more than data.max_prompt_length=16"):
            run(cfg, policy, make_prompts([prompt], ["0"]))


class ActionEnv:
    """Opens with a one-shot exchange (so contexts start "ab"); records every action; answers
    ' ok:' and goes on. Odd turns report tool use, even turns nothing (counts default to 0)."""

    actions: list[str] = []

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        ActionEnv.actions = []
        opening = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        return [*opening, {"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        ActionEnv.actions.append(action)
        info = {"tool_calls": 2, "tool_errors": 1} if len(ActionEnv.actions) % 2 else {}
        return StepResult([{"role": "user", "content": " ok:"}], 0.25, False, info)


ACTION_ENV = "tests.unit.test_multi_turn_rows:ActionEnv"


def test_env_sees_each_turn_without_its_end_of_turn_token() -> None:
    policy = ScriptedPolicy(["ab"], [["5<eos>", "<unk>7<eos>", "86"]], width=12)
    batch = run(make_config(ACTION_ENV, 1, max_turns=3), policy, make_prompts(["c:"], ["0"]))
    # Special tokens other than the end of the turn stay visible; a cut turn has no <eos>.
    assert ActionEnv.actions == ["5", "<unk>7", "86"]
    # Tools counted per episode: turns 1 and 3 report 2 calls and 1 error, turn 2 nothing.
    assert batch["agent_tool_calls"].tolist() == [4.0] and batch["agent_tool_errors"].tolist() == [
        2.0
    ]
    assert batch["env_reward"].tolist() == [0.75]


def test_prompt_column_is_the_rendered_opening_with_its_special_tokens() -> None:
    policy = ScriptedPolicy(["ab"], [["5<eos>"]], width=12)
    batch = run(make_config(ACTION_ENV, 1, max_turns=1), policy, make_prompts(["c:"], ["0"]))
    # The env opens with a one-shot exchange: the template closes its assistant turn.
    assert list(batch["prompt"]) == ["ab<eos>c:"]
    assert batch["prompt_ids"][0].tolist() == encode("ab") + [EOS] + encode("c:")


def test_last_turn_at_max_turns_gets_no_observation() -> None:
    policy = ScriptedPolicy(["ab"], [["5<eos>", "6<eos>"]], width=12)
    batch = run(make_config(ACTION_ENV, 1, max_turns=2), policy, make_prompts(["c:"], ["0"]))
    expected = encode("5") + [EOS] + encode(" ok:") + encode("6") + [EOS]
    assert int(batch["response_mask"][0].sum()) == len(expected)
    assert batch["response_ids"][0, : len(expected)].tolist() == expected
    assert ActionEnv.actions == ["5", "6"]


def test_a_response_that_fills_its_width_exactly_is_kept() -> None:
    # Width 4 + (2 - 1) * 8 = 12: two turns of 2 tokens and the 8-token hint ' higher:'.
    policy = ScriptedPolicy(["a:"], [["1<eos>", "2<eos>"]], width=4)
    cfg = make_config(GUESS, 1, max_tokens=4, max_turns=2, max_obs_tokens=8, env_kwargs=HINTS)
    batch = run(cfg, policy, make_prompts(["a:"], ["9"]))
    assert batch["response_ids"].shape[1] == 12 and batch["response_mask"].sum() == 12


def test_a_one_token_episode_pads_with_its_version() -> None:
    policy = VersionedPolicy(["a:"], [["9"]], width=1)
    batch = run(
        make_config(GUESS, 1, max_tokens=1, env_kwargs=HINTS), policy, make_prompts(["a:"], ["9"])
    )
    assert batch["response_mask"].sum() == 1 and batch["token_version"].eq(1).all()


class FailingEnv:
    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        raise RuntimeError("no container left")

    def step(self, action: str) -> StepResult:
        raise AssertionError("never reached")


def test_env_error_quotes_only_the_end_of_a_long_prompt() -> None:
    prompt = "y" + "x" * 119 + "z" * 10
    policy = ScriptedPolicy([prompt], [["1<eos>"]], width=4)
    cfg = make_config("tests.unit.test_multi_turn_rows:FailingEnv", 1, max_tokens=4)
    with pytest.raises(EnvError) as failure:
        run(cfg, policy, make_prompts([prompt], ["0"]))
    # The last 120 characters: the 'y' before them is left out.
    assert f"prompt {prompt[-120:]!r}, ground truth '0'" in str(failure.value)


def test_an_episode_that_fails_later_keeps_no_env_reward() -> None:
    """BrokenEnv pays 0.5 a step and fails on an action with a 2: row 0 earns 0.5 on turn 1,
    then fails on turn 2; its env reward is 0, not the 0.5 it had."""
    prompts = ["a:", "b:"]
    policy = ScriptedPolicy(prompts, [["1<eos>", "2<eos>"], ["1<eos>", "1<eos>"]], width=12)
    cfg = make_config(
        "tests.unit.test_multi_turn:BrokenEnv",
        2,
        max_turns=2,
        env_kwargs={"seconds": 0},
        on_env_error="fail_episode",
    )
    batch = run(cfg, policy, make_prompts(prompts, ["0", "0"]))
    assert batch["env_failed"].tolist() == [1.0, 0.0]
    assert batch["env_reward"].tolist() == [0.0, 1.0]
