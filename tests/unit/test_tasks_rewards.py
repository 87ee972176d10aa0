"""Synthetic tasks are reproducible and their rule rewards score as documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlframe.config import RewardConfig
from rlframe.data.tasks import TASKS, generate_examples
from rlframe.rewards import (
    RewardError,
    RuleScorer,
    score_char_match,
    score_exact_match,
    score_math_answer,
)


def test_examples_are_fixed_by_seed_and_correct() -> None:
    a = generate_examples("mixed", 40, seed=3)
    assert a == generate_examples("mixed", 40, seed=3)
    assert a != generate_examples("mixed", 40, seed=4)
    assert {e.task for e in a} == set(TASKS)
    for e in a:
        body = e.prompt[:-1]
        if e.task == "arithmetic":
            x, y = body.split("+")
            assert int(e.ground_truth) == int(x) + int(y)
        elif e.task == "copy":
            assert e.ground_truth == body.split()[1]
        elif e.task == "reverse":
            assert e.ground_truth == body.split()[1][::-1]
        else:
            assert int(e.ground_truth) == body.split()[2].count("a")
    with pytest.raises(ValueError, match="unknown synthetic task"):
        generate_examples("sudoku", 1, 0)


def test_rule_rewards() -> None:
    assert score_exact_match("19\nmore", "19", {}) == 1.0
    assert score_exact_match("18", "19", {}) == 0.0
    assert score_char_match("19", "19", {}) == 1.0
    assert score_char_match("18", "19", {}) == 0.5
    assert score_char_match("1", "19", {}) == 0.5
    assert score_char_match("", "7", {}) == 0.0


def test_reward_errors_name_function_and_sample(tmp_path: Path) -> None:
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(
        "def reward(response, ground_truth, sample):\n    return 1.0 / len(response)\n"
    )
    name = f"{plugin}:reward"
    scorer = RuleScorer(name, RewardConfig(num_workers=0))  # scores in this process
    assert scorer.score(["ab"], ["x"], [{"prompt": "p"}]).scores == [0.5]
    with pytest.raises(
        RewardError,
        match=rf"reward function {re.escape(name)} raised ZeroDivisionError.* on sample 1 "
        r"\(prompt 'q'",
    ):
        scorer.score(["ab", ""], ["x", "y"], [{"prompt": "p"}, {"prompt": "q"}])


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("so she has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("The answer is \\boxed{1,234}.", "#### 1234", 1.0),
        ("we get 12 then 15", "15", 1.0),
        ("we get 15 then 12", "15", 0.0),
        ("no idea", "3", 0.0),
        ("#### 2.50", "2.5", 1.0),
    ],
)
def test_math_answer(response: str, truth: str, score: float) -> None:
    assert score_math_answer(response, truth, {}) == score


def test_the_schema_names_every_generated_task() -> None:
    """``data.task`` is checked against the schema's names without importing the generators."""
    from rlframe.core.names import TASK_NAMES
    from rlframe.data.tasks import GENERATED_TASKS

    assert sorted(TASK_NAMES) == sorted(GENERATED_TASKS)
