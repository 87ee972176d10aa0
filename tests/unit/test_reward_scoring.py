"""Rule rewards scored in a pool of processes: parallel, per-sample time limit, error policy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlframe.config import ConfigError, RewardConfig
from rlframe.rewards import RewardError, RuleScorer, score_char_match
from rlframe.rewards.pool import RewardPool

PLUGIN = '''
import os, time

def behave(response, ground_truth, sample):
    """The response says what to do: a number, hang, raise, text, nan, die or print."""
    if response == "hang":
        time.sleep(3600)
    if response == "raise":
        raise ValueError("bad sample")
    if response == "text":
        return "1.0"
    if response == "nan":
        return float("nan")
    if response == "die":
        os._exit(3)
    if response == "print":
        print("noise on stdout")
        return 0.25
    if response == "slow":
        time.sleep(0.5)
        return 1.0
    return float(response)
'''


@pytest.fixture()
def plugin(tmp_path: Path) -> str:
    path = tmp_path / "behave.py"
    path.write_text(PLUGIN)
    return f"{path}:behave"


def score(
    spec: str, responses: list[str], **cfg: object
) -> tuple[list[float], list[bool], list[bool]]:
    scorer = RuleScorer(spec, RewardConfig(**cfg))  # type: ignore[arg-type]
    try:
        out = scorer.score(
            responses, ["x"] * len(responses), [{"prompt": f"p{i}"} for i in range(len(responses))]
        )
    finally:
        scorer.close()
    return out.scores, out.errors, out.timeouts


def test_pool_scores_like_the_driver() -> None:
    responses = ["12", "1", "13", "", "21", "12\n3"] * 5
    truths = ["12"] * len(responses)
    expected = [score_char_match(r, t, {}) for r, t in zip(responses, truths)]
    scorer = RuleScorer("char_match", RewardConfig(num_workers=3))
    try:
        assert scorer.score(responses, truths, [{}] * len(responses)).scores == expected
        assert (
            scorer.score(responses[:2], truths[:2], [{}] * 2).scores == expected[:2]
        )  # the pool is reused
    finally:
        scorer.close()


def test_samples_are_scored_in_parallel(plugin: str) -> None:
    start = time.monotonic()
    scores, _, _ = score(plugin, ["slow"] * 4, num_workers=4)
    elapsed = time.monotonic() - start
    assert scores == [1.0] * 4
    # 4 x 0.5 s one by one would be 2 s (plus start-up, ~0.1 s per worker here).
    assert elapsed < 1.9, elapsed


def test_failures_score_zero_and_are_counted(plugin: str) -> None:
    responses = ["0.5", "hang", "raise", "text", "nan", "die", "print", "1", "hang"]
    start = time.monotonic()
    scores, errors, timeouts = score(
        plugin, responses, num_workers=2, timeout_s=1.0, on_error="zero"
    )
    assert time.monotonic() - start < 10  # two hangs of 1 s each, not an hour
    assert scores == [0.5, 0, 0, 0, 0, 0, 0.25, 1.0, 0]
    assert timeouts == [False, True, False, False, False, False, False, False, True]
    assert errors == [False, False, True, True, True, True, False, False, False]


@pytest.mark.parametrize(
    "response,message",
    [
        ("hang", r"timed out after 1 s \(reward.timeout_s\) on sample 1 \(prompt 'p1'"),
        ("raise", r"raised ValueError: bad sample .* on sample 1 \(prompt 'p1', response 'raise'"),
        ("text", r"returned '1.0' \(str\), not a number on sample 1"),
        ("nan", "returned nan on sample 1"),
        ("die", r"killed its scoring process \(exit code 3\) on sample 1"),
    ],
)
def test_default_policy_names_function_and_sample(plugin: str, response: str, message: str) -> None:
    with pytest.raises(RewardError, match=f"reward function {plugin}.*{message}"):
        score(plugin, ["1", response, "1"], num_workers=2, timeout_s=1.0)


def test_driver_scoring_applies_the_same_policy(plugin: str) -> None:
    scores, errors, timeouts = score(
        plugin, ["0.5", "raise", "nan", "1"], num_workers=0, on_error="zero"
    )
    assert (scores, errors, timeouts) == ([0.5, 0, 0, 1.0], [False, True, True, False], [False] * 4)
    with pytest.raises(RewardError, match="returned nan on sample 0"):
        score(plugin, ["nan"], num_workers=0)


def test_pool_that_cannot_load_the_function_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(RewardError, match="could not start: .*no_such_module_here"):
        RewardPool(f"{broken}:fn", 1, 5.0)


def test_reward_config_checks() -> None:
    with pytest.raises(ConfigError, match="reward.on_error"):
        RewardConfig(on_error="ignore")
    with pytest.raises(ConfigError, match="reward.num_workers"):
        RewardConfig(num_workers=-1)
    with pytest.raises(ConfigError, match="reward.timeout_s"):
        RewardConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="reward.weight: is 0"):
        RewardConfig(weight=0)
