"""Multi-turn limits the first tests left loose: the sampled-token budget ends an episode, an
observation's budget keeps room for the closing token of a cut turn, a failed ``reset`` under
``fail_episode``, and ``agent.max_concurrent_envs``."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

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


def test_spent_budget_ends_the_episode_before_max_turns() -> None:
    """Budget 6: turns of 3 and 3 tokens spend it (12 > 9: the hint is ' lower:'); no third
    turn, no trailing observation, although max_turns allows four and the env goes on."""
    policy = ScriptedPolicy(["a:"], [["12<eos>", "34<eos>", "56<eos>"]], width=6)
    batch = run(
        make_config(GUESS, 1, max_tokens=6, env_kwargs=HINTS), policy, make_prompts(["a:"], ["9"])
    )
    assert len(policy.calls) == 2 and [c["max_tokens"] for c in policy.calls] == [[6], [3]]
    expected = encode("12") + [EOS] + encode(" lower:") + encode("34") + [EOS]
    assert batch["response_ids"][0, : len(expected)].tolist() == expected
    assert int(batch["response_mask"][0].sum()) == len(expected)
    assert batch["agent_turns"].item() == 2 and batch["finish_reason"][0] == "stop"


def test_one_token_left_is_still_a_turn() -> None:
    policy = ScriptedPolicy(["a:"], [["12<eos>", "34<eos>"]], width=4)
    batch = run(
        make_config(GUESS, 1, max_tokens=4, env_kwargs=HINTS), policy, make_prompts(["a:"], ["9"])
    )
    assert [c["max_tokens"] for c in policy.calls] == [[4], [1]]
    assert batch["loss_mask"].sum() == 4 and batch["agent_turns"].item() == 2


def test_observation_budget_keeps_room_for_the_closing_token() -> None:
    """A cut turn is closed with <eos> (loss mask 0) inside agent.max_obs_tokens: with 8, the
    8-token hint ' higher:' is cut to 7 to leave room for it."""
    hint = encode(" higher:")
    assert len(hint) == 8
    policy = ScriptedPolicy(["a:"], [["55", "66"]], width=12)
    cfg = make_config(
        GUESS,
        1,
        env_kwargs=HINTS,
        max_turns=2,
        max_tokens_per_turn=1,
        close_cut_turns=True,
        max_obs_tokens=8,
    )
    batch = run(cfg, policy, make_prompts(["a:"], ["9"]))
    n = int(batch["response_mask"][0].sum())
    between = batch["response_ids"][0, 1 : n - 1].tolist()
    assert len(between) == 8 and between[0] == EOS and between[1:] == hint[:7]
    assert batch["loss_mask"][0, :n].tolist() == [1] + [0] * 8 + [1]
    assert batch["agent_obs_cut"].item() == 1 and batch["agent_obs_tokens"].item() == 8
    # Room for both: nothing is cut.
    policy = ScriptedPolicy(["a:"], [["55", "66"]], width=12)
    cfg = make_config(
        GUESS,
        1,
        env_kwargs=HINTS,
        max_turns=2,
        max_tokens_per_turn=1,
        close_cut_turns=True,
        max_obs_tokens=9,
    )
    batch = run(cfg, policy, make_prompts(["a:"], ["9"]))
    assert batch["agent_obs_cut"].item() == 0 and batch["agent_obs_tokens"].item() == 9


class ResetFailsOnB:
    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        if sample["prompt"] == "b:":
            raise RuntimeError("no container left")
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        return StepResult([], 1.0, True, {})


def test_reset_failure_fails_only_that_episode() -> None:
    env = "tests.unit.test_multi_turn_budget:ResetFailsOnB"
    prompts = ["a:", "b:", "c:"]
    policy = ScriptedPolicy(prompts, [["1<eos>"]] * 3, width=4)
    cfg = make_config(env, 3, max_tokens=4, on_env_error="fail_episode")
    batch = run(cfg, policy, make_prompts(prompts, ["0"] * 3))
    # The failed row is never sampled; the others are.
    assert [len(policy.contexts_of(row)) for row in range(3)] == [1, 0, 1]
    assert batch["env_failed"].tolist() == [0.0, 1.0, 0.0]
    assert batch["env_reward"].tolist() == [1.0, 0.0, 1.0]
    assert batch["agent_turns"].tolist() == [1.0, 0.0, 1.0]
    assert batch["response_mask"][1].sum() == 0 and batch["loss_mask"][1].sum() == 0
    assert list(batch["finish_reason"]) == ["stop", "env_error", "stop"]
    assert batch["prompt_ids"][1][batch["prompt_mask"][1].bool()].tolist() == encode("b:")
    with pytest.raises(EnvError, match=r"ResetFailsOnB reset failed on sample 1 \(prompt 'b:'"):
        run(
            make_config(env, 3, max_tokens=4),
            ScriptedPolicy(prompts, [["1<eos>"]] * 3, width=4),
            make_prompts(prompts, ["0"] * 3),
        )


class CountingEnv:
    lock = threading.Lock()
    running = 0
    most = 0

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        cls = CountingEnv
        with cls.lock:
            cls.running += 1
            cls.most = max(cls.most, cls.running)
        time.sleep(0.1)
        with cls.lock:
            cls.running -= 1
        return StepResult([], 0.0, True, {})


@pytest.mark.parametrize("limit", [1, 3])
def test_max_concurrent_envs_bounds_the_env_calls_in_flight(limit: int) -> None:
    CountingEnv.most = 0
    prompts = [f"{i}:" for i in range(6)]
    policy = ScriptedPolicy(prompts, [["1<eos>"]] * 6, width=4)
    cfg = make_config(
        "tests.unit.test_multi_turn_budget:CountingEnv", 6, max_tokens=4, max_concurrent_envs=limit
    )
    run(cfg, policy, make_prompts(prompts, ["0"] * 6))
    assert CountingEnv.most == limit
