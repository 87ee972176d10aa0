"""A corpus of reward hacks against ``code_tests``: each must score 0. Add new ones to
tests/fixtures/reward_hacks/ (one program per file, defining or faking ``add``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlframe.rewards.code_tests import score_code_tests

HACKS = sorted(Path(__file__).parents[1].joinpath("fixtures", "reward_hacks").glob("*.py"))
ASSERTS = {
    "tests": [
        "assert add(1, 2) == 3",
        "assert add(2, 2) == 4",
        "assert [add(i, 1) for i in range(3)] == [1, 2, 3]",
        "assert add(1, 1)",
    ],
    "time_limit_s": 5,
}


def score(program: str, tests: object = ASSERTS["tests"]) -> float:
    sample = {"tests": tests, "time_limit_s": 5}
    return score_code_tests(f"```python\n{program}```", "", sample)


def test_the_corpus_is_there() -> None:
    assert len(HACKS) >= 12


@pytest.mark.parametrize("hack", HACKS, ids=lambda p: p.stem)
def test_a_hack_scores_nothing(hack: Path) -> None:
    assert score(hack.read_text()) == 0.0


def test_an_honest_program_scores_fully_and_a_partial_one_partly() -> None:
    assert score("def add(a, b):\n    return a + b\n") == 1.0
    # Right for add(1, 2) and truthy, wrong elsewhere.
    assert score("def add(a, b):\n    return 3\n") == 2 / 4


def test_objects_and_methods_work_through_proxies() -> None:
    program = (
        "class Stack:\n"
        "    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n"
        "    def top(self):\n        return self.items[-1]\n"
    )
    tests = {
        "asserts": ["s = Stack()\ns.push(1).push({'a': (2, 3)})\nassert s.top() == {'a': (2, 3)}"]
    }
    assert score(program, tests) == 1.0
    assert score(program, {"asserts": ["assert Stack() == Stack()"]}) == 0.0


def test_stdin_style_cases_compare_the_output() -> None:
    tests = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    assert score("a, b = map(int, input().split())\nprint(a + b)\n", tests) == 1.0
    assert score("print(3)\n", tests) == 0.5
