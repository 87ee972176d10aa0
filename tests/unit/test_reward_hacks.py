"""A corpus of reward hacks against ``code_tests``: each must score 0. Add new ones to
tests/fixtures/reward_hacks/ (one program per file, defining or faking ``add``). Beside
them, tests/fixtures/reward_honest/: right programs the old scoping failed (a helper named
like a builtin the assert uses, an exception the assert expects), each must score 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlframe.rewards.code_tests import score_code_tests

FIXTURES = Path(__file__).parents[1] / "fixtures"
HACKS = sorted(FIXTURES.joinpath("reward_hacks").glob("*.py"))
HONEST = sorted(FIXTURES.joinpath("reward_honest").glob("*.py"))
PLAIN = [
    "assert add(1, 2) == 3",
    "assert add(2, 2) == 4",
    "assert [add(i, 1) for i in range(3)] == [1, 2, 3]",
    "assert add(1, 1)",
]
# As MBPP and HumanEval write them: builtins and modules around the call under test.
AROUND_BUILTINS = [
    "assert set(add([1], [2])) == set([2, 1])",
    "assert abs(add(0.1, 0.2) - 0.3) < 1e-9",
    "assert str(add(1, 2)) == '3'",
    "assert sorted(add([2], [1])) == [1, 2]",
    "assert len(add([1], [2])) == 2",
    "assert round(add(0.1, 0.2), 6) == 0.3",
    "assert math.isclose(add(0.1, 0.2), 0.3)",
    "assert all(map(lambda p: add(*p) == sum(p), [(1, 2), (3, 4)]))",
]
EXPECTS_TYPE_ERROR = (
    "try:\n    add(1, None)\nexcept TypeError as e:\n"
    "    assert str(e) == 'add takes numbers or lists, not None', str(e)\n"
    "else:\n    raise AssertionError('no TypeError')"
)
ASSERTS = PLAIN + AROUND_BUILTINS
SHADOWING = {"shadow_set", "shadow_abs", "shadow_str", "shadow_sorted", "shadow_len"}
SHADOWING |= {"shadow_round", "class_math", "patch_math", "stop_iteration"}
"""Hacks of the asserts around builtins; the others attack plain calls (each case is a
sandbox of about 0.1 s, so each hack meets the asserts it attacks)."""


def score(program: str, tests: object = ASSERTS) -> float:
    sample = {"tests": tests, "time_limit_s": 5}
    return score_code_tests(f"```python\n{program}```", "", sample)


def test_the_corpus_is_there() -> None:
    assert len(HACKS) >= 22 and len(HONEST) >= 3


@pytest.mark.parametrize("hack", HACKS, ids=lambda p: p.stem)
def test_a_hack_scores_nothing(hack: Path) -> None:
    assert score(hack.read_text(), AROUND_BUILTINS if hack.stem in SHADOWING else PLAIN) == 0.0


@pytest.mark.parametrize("program", HONEST, ids=lambda p: p.stem)
def test_an_honest_program_scores_fully(program: Path) -> None:
    assert score(program.read_text(), [*AROUND_BUILTINS, EXPECTS_TYPE_ERROR]) == 1.0


def test_an_honest_program_scores_fully_and_a_partial_one_partly() -> None:
    assert score("def add(a, b):\n    return a + b\n") == 1.0
    # Right for add(1, 2) and truthy, wrong elsewhere.
    assert score("def add(a, b):\n    return 3\n", PLAIN) == 2 / 4


def test_an_expected_exception_compares_by_type_and_message() -> None:
    raises = "def add(a, b):\n    raise {}('add takes numbers or lists, not None')\n"
    assert score(raises.format("TypeError"), [EXPECTS_TYPE_ERROR]) == 1.0
    assert score(raises.format("ValueError"), [EXPECTS_TYPE_ERROR]) == 0.0
    wrong_text = "def add(a, b):\n    raise TypeError('no')\n"
    assert score(wrong_text, [EXPECTS_TYPE_ERROR]) == 0.0
    # Arguments come back as given: str() of a KeyError is its repr, as in the program.
    keyed = "def get(d, k):\n    return d[k]\n"
    check = "try:\n    get({}, 'x')\nexcept KeyError as e:\n    assert str(e) == \"'x'\""
    assert score(keyed, [check]) == 1.0


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
