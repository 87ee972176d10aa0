"""The multi-turn episode loop on the driver, with a scripted policy in place of the engine
(tests/unit/scripted_episodes.py; the real engine runs in tests/ray/test_multi_turn.py):
exact id concatenation, masks, budgets, limits, env failures, concurrency; and the advantage
estimators across observations."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from rlframe.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    compute_reverse_cumsum,
    place_on_last_token,
)
from rlframe.config import AgentConfig, AlgorithmConfig
from rlframe.core.protocol import Batch
from rlframe.envs import EnvError, StepResult
from rlframe.envs.runner import count_stuck_calls
from rlframe.rewards.stage import combine_rewards
from rlframe.rollout import collect_agent_metrics
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


def test_ids_concatenate_exactly_and_observations_are_masked() -> None:
    prompts = ["a:", "b:"]
    policy = ScriptedPolicy(
        prompts, [["5<eos>", "8<eos>", "7<eos>"], ["3<eos>", "9", "x"]], width=12
    )
    cfg = make_config(GUESS, 2, env_kwargs=HINTS, max_turns=3)
    batch = run(cfg, policy, make_prompts(prompts, ["7", "4"]))

    # Row 0 finds 7 on turn 3; row 1 stops after turn 2, which its budget did not cut but
    # which ended without <eos>: a cut turn ends the episode.
    turns0 = [encode("5") + [EOS], encode("8") + [EOS], encode("7") + [EOS]]
    obs0 = [encode(" higher:"), encode(" lower:")]
    expected0 = turns0[0] + obs0[0] + turns0[1] + obs0[1] + turns0[2]
    n0 = len(expected0)
    assert batch["response_ids"][0, :n0].tolist() == expected0
    assert (
        batch["loss_mask"][0, :n0].tolist()
        == [1] * 2 + [0] * len(obs0[0]) + [1] * 2 + [0] * len(obs0[1]) + [1] * 2
    )
    assert batch["response_mask"][0].sum() == n0 and batch["loss_mask"][0, n0:].sum() == 0
    # Sampled log-probs are the engine's, unchanged; observations carry 0.
    sampled = batch["response_ids"][0][batch["loss_mask"][0].bool()]
    torch.testing.assert_close(
        batch["rollout_logprobs"][0][batch["loss_mask"][0].bool()], -sampled.float() / 100
    )
    assert (
        batch["rollout_logprobs"][0][(batch["response_mask"][0] - batch["loss_mask"][0]).bool()]
        .eq(0)
        .all()
    )

    # Token in, token out: each turn's context is exactly the previous context + sampled +
    # observation ids.
    prompt0 = encode("a:")
    assert policy.contexts_of(0) == [
        prompt0,
        prompt0 + turns0[0] + obs0[0],
        prompt0 + turns0[0] + obs0[0] + turns0[1] + obs0[1],
    ]
    assert all(call["meta"]["more_turns"] for call in policy.calls)

    assert batch["env_reward"].tolist() == [1.0, 0.0]
    assert batch["agent_turns"].tolist() == [3.0, 2.0]
    assert list(batch["finish_reason"]) == ["stop", "length"]
    assert batch["weights_version"].tolist() == [3, 3]
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == prompt0


def test_each_turn_gets_what_is_left_of_the_budget() -> None:
    policy = ScriptedPolicy(["a:"], [["12<eos>", "34<eos>", "56<eos>"]], width=7)
    batch = run(
        make_config(GUESS, 1, max_tokens=7, env_kwargs=HINTS), policy, make_prompts(["a:"], ["9"])
    )
    assert [c["max_tokens"] for c in policy.calls] == [[7], [4], [1]]
    assert batch["loss_mask"].sum() == 7 and batch["agent_turns"].item() == 3
    assert batch["finish_reason"][0] == "length"
    # The observation after the last turn is dropped: the response ends with sampled tokens.
    last = int(batch["response_mask"][0].sum()) - 1
    assert batch["loss_mask"][0, last] == 1


def test_max_turns_and_per_turn_cap_with_closed_turns() -> None:
    policy = ScriptedPolicy(["a:"], [["55", "66", "77"]], width=12)
    cfg = make_config(
        GUESS, 1, env_kwargs=HINTS, max_turns=2, max_tokens_per_turn=1, close_cut_turns=True
    )
    batch = run(cfg, policy, make_prompts(["a:"], ["9"]))
    assert [c["max_tokens"] for c in policy.calls] == [[1], [1]]
    # The cut turn is closed with <eos> that the policy did not sample: loss mask 0.
    expected = encode("5") + [EOS] + encode(" higher:") + encode("6")
    n = len(expected)
    assert batch["response_ids"][0, :n].tolist() == expected
    assert batch["loss_mask"][0, :n].tolist() == [1, 0] + [0] * len(encode(" higher:")) + [1]
    assert batch["agent_turns"].item() == 2


class SleepyEnv:
    def __init__(self, seconds: float = 1.0) -> None:
        self.seconds = seconds

    def reset(self, sample: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, action: str) -> StepResult:
        time.sleep(self.seconds)
        return StepResult(
            [{"role": "user", "content": " ok:"}], 0.5, False, {"tool_calls": 1, "tool_errors": 0}
        )


class AsyncSleepyEnv(SleepyEnv):
    async def step(self, action: str) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(self.seconds)
        return StepResult([], 0.5, True, {})


class BrokenEnv(SleepyEnv):
    def step(self, action: str) -> StepResult:
        if "2" in action:
            raise RuntimeError("the sandbox crashed")
        return super().step(action)


@pytest.mark.parametrize("env", ["SleepyEnv", "AsyncSleepyEnv"])
def test_env_steps_of_a_turn_run_concurrently(env: str) -> None:
    prompts = [f"{i}:" for i in range(64)]
    policy = ScriptedPolicy(prompts, [["1<eos>"]] * 64, width=4)
    cfg = make_config(f"tests.unit.test_multi_turn:{env}", 64, max_tokens=4, max_turns=1)
    start = time.perf_counter()
    batch = run(cfg, policy, make_prompts(prompts, ["0"] * 64))
    seconds = time.perf_counter() - start
    print(f"{env}: 64 envs sleeping 1 s each finished a turn in {seconds:.2f} s")
    assert seconds < 5 and batch["env_reward"].tolist() == [0.5] * 64


def test_env_errors_name_the_env_and_sample_or_fail_the_episode() -> None:
    prompts = ["a:", "b:"]
    policy = ScriptedPolicy(prompts, [["1<eos>", "1<eos>"], ["2<eos>", "2<eos>"]], width=6)
    env = "tests.unit.test_multi_turn:BrokenEnv"
    with pytest.raises(
        EnvError,
        match=r"BrokenEnv step failed on sample 1 at turn 1 .*'b:'"
        r".*RuntimeError: the sandbox crashed",
    ):
        run(
            make_config(env, 2, max_tokens=6, env_kwargs={"seconds": 0}),
            policy,
            make_prompts(prompts, ["0", "0"]),
        )

    policy = ScriptedPolicy(prompts, [["1<eos>", "1<eos>"], ["2<eos>", "2<eos>"]], width=6)
    cfg = make_config(
        env, 2, max_tokens=6, env_kwargs={"seconds": 0}, on_env_error="fail_episode", max_turns=2
    )
    batch = run(cfg, policy, make_prompts(prompts, ["0", "0"]))
    assert batch["env_failed"].tolist() == [0.0, 1.0] and batch["agent_turns"].tolist() == [
        2.0,
        1.0,
    ]
    scored = combine_rewards(
        batch.with_tensors(score=torch.tensor([0.25, 0.25]), reward=torch.tensor([0.25, 0.25])),
        cfg.agent,
    )
    assert scored["score"].tolist() == [1.25, 0.0] and scored["reward"].tolist() == [1.25, 0.0]
    metrics = collect_agent_metrics(batch)
    assert metrics["agent/env_failures"] == 1 and metrics["agent/turns/mean"] == 1.5
    assert metrics["agent/tool_calls/mean"] == 1.0 and metrics["agent/tool_errors"] == 0


def test_env_timeouts_end_as_errors() -> None:
    policy = ScriptedPolicy(["a:"], [["1<eos>"]], width=4)
    cfg = make_config(
        "tests.unit.test_multi_turn:SleepyEnv",
        1,
        max_tokens=4,
        env_kwargs={"seconds": 3},
        step_timeout_s=0.2,
    )
    start = time.perf_counter()
    with pytest.raises(EnvError, match=r"TimeoutError: no answer within 0.2 s"):
        run(cfg, policy, make_prompts(["a:"], ["0"]))
    assert time.perf_counter() - start < 2


RELEASE = threading.Event()
"""Lets HangingEnv's steps return."""


class HangingEnv(SleepyEnv):
    def step(self, action: str) -> StepResult:
        RELEASE.wait(60)
        return super().step(action)


def wait_for_no_stuck_calls() -> None:
    """Sync calls abandoned by earlier tests (SleepyEnv's 3 s) end before ours are counted."""
    deadline = time.monotonic() + 10
    while count_stuck_calls() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count_stuck_calls() == 0


def test_timed_out_sync_env_calls_are_counted_and_capped() -> None:
    """A sync step past agent.step_timeout_s keeps its thread (a thread cannot be stopped):
    agent/stuck_calls counts it until it returns, and more than agent.max_stuck_calls stop
    the run naming the key. An async step past its timeout is cancelled and never counts."""
    wait_for_no_stuck_calls()
    prompts = make_prompts(["a:", "b:"], ["0", "0"])
    env = "tests.unit.test_multi_turn:HangingEnv"
    cfg = make_config(
        env, 2, max_tokens=4, step_timeout_s=0.2, on_env_error="fail_episode", max_stuck_calls=3
    )
    RELEASE.clear()
    try:
        batch = run(cfg, ScriptedPolicy(["a:", "b:"], [["1"], ["2"]], width=4), prompts)
        assert batch["env_failed"].tolist() == [1.0, 1.0]
        assert collect_agent_metrics(batch)["agent/stuck_calls"] == 2
        with pytest.raises(EnvError, match=r"^4 sync calls .* agent.max_stuck_calls=3: "):
            run(cfg, ScriptedPolicy(["a:", "b:"], [["1"], ["2"]], width=4), prompts)
    finally:
        RELEASE.set()
    wait_for_no_stuck_calls()  # a released call is no longer counted
    cfg = make_config(
        "tests.unit.test_multi_turn:AsyncSleepyEnv",
        2,
        max_tokens=4,
        env_kwargs={"seconds": 30},
        step_timeout_s=0.2,
        on_env_error="fail_episode",
        max_stuck_calls=1,
    )
    batch = run(cfg, ScriptedPolicy(["a:", "b:"], [["1"], ["2"]], width=4), prompts)
    assert batch["env_failed"].tolist() == [1.0, 1.0]
    assert collect_agent_metrics(batch)["agent/stuck_calls"] == 0


def test_rows_per_episode_are_reported_where_episodes_make_several() -> None:
    """The openai agent's batches say which episode each row is of (agent_episode)."""
    batch = Batch(
        {
            "agent_turns": torch.ones(4),
            "agent_tool_calls": torch.zeros(4),
            "agent_tool_errors": torch.zeros(4),
            "agent_obs_tokens": torch.zeros(4),
            "agent_obs_cut": torch.zeros(4),
            "env_failed": torch.zeros(4),
            "env_reward": torch.zeros(4),
            "agent_episode": torch.tensor([0, 0, 0, 2]),
        }
    )
    metrics = collect_agent_metrics(batch)
    assert metrics["agent/rows_per_episode/max"] == 3
    assert metrics["agent/rows_per_episode/mean"] == 2  # episodes 0 and 2; 1 is not in it


def test_rewards_combine_with_weights_and_the_overlong_penalty_stays() -> None:
    batch = Batch(
        {
            "score": torch.tensor([1.0, 0.0]),
            "reward": torch.tensor([0.5, -0.5]),
            "env_reward": torch.tensor([2.0, 1.0]),
            "env_failed": torch.tensor([0.0, 0.0]),
        }
    )
    out = combine_rewards(
        batch, AgentConfig(env="guess_number", rule_reward_weight=0.5, env_reward_weight=2.0)
    )
    assert out["score"].tolist() == [4.5, 2.0] and out["reward"].tolist() == [4.0, 1.5]
    # rule_score stays the raw rule reward: combining never writes it.
    assert "rule_score" not in out


# -- advantages over a loss mask with observation gaps ----------------------------------

MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])  # turn, observation, turn, padding


def test_score_goes_on_the_last_sampled_token() -> None:
    placed = place_on_last_token(torch.tensor([3.0]), MASK)
    assert placed.tolist() == [[0, 0, 0, 0, 0, 3.0, 0]]


def test_returns_flow_across_observations() -> None:
    rewards = place_on_last_token(torch.tensor([1.0]), MASK)
    returns = compute_reverse_cumsum(rewards, MASK, gamma=0.5)
    assert returns.tolist() == [[0.125, 0.25, 0, 0, 0.5, 1.0, 0]]


def test_gae_skips_observations_and_reaches_the_first_turn() -> None:
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4, 9.0]])
    cfg = AlgorithmConfig(gamma=1.0, lam=1.0)
    out = ADVANTAGES.get("gae")(
        AdvantageInputs(torch.tensor([1.0]), MASK, torch.tensor([0]), cfg, values=values * MASK)
    )
    # gamma = lambda = 1: returns are the final reward on every sampled token, observations 0.
    torch.testing.assert_close(out.returns, torch.tensor([[1.0, 1.0, 0, 0, 1.0, 1.0, 0]]))
    # Single-turn rows are unchanged by the gap handling: padding carries zeros.
    single = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out1 = ADVANTAGES.get("gae")(
        AdvantageInputs(
            torch.tensor([1.0]),
            single,
            torch.tensor([0]),
            cfg,
            values=torch.tensor([[0.5, 0.5, 0.5, 0.0]]),
        )
    )
    torch.testing.assert_close(out1.returns, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))


def test_docs_env_example_retries_until_right() -> None:
    policy = ScriptedPolicy(["3+4="], [["6<eos>", "7<eos>", "7<eos>"]], width=9)
    cfg = make_config(
        "tests/plugins/retry_env.py:RetryEnv", 1, max_tokens=9, max_turns=3, max_obs_tokens=32
    )
    batch = run(cfg, policy, make_prompts(["3+4="], ["7"]))
    expected = encode("6") + [EOS] + encode(" wrong, try again:") + encode("7") + [EOS]
    assert batch["response_ids"][0, : len(expected)].tolist() == expected
    assert batch["env_reward"].item() == 1.0 and batch["agent_turns"].item() == 2
