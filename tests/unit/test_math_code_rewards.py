"""math_verify (symbolic answer checks) and code_tests (programs run against test cases)."""

from __future__ import annotations

import json

import pytest

from rlframe.rewards import REWARDS
from rlframe.rewards.code_tests import extract_program, parse_test_cases


@pytest.mark.parametrize(
    "response,truth,score",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("We find $x^2 + 2x + 1$.", "(x+1)^2", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "#### 72", 1.0),
        ("The answer is \\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
        ("The answer is \\boxed{3}", "4", 0.0),
        ("I do not know", "7", 0.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
    ],
)
def test_math_verify(response: str, truth: str, score: float) -> None:
    assert REWARDS.get("math_verify")(response, truth, {}) == score


def test_math_verify_refuses_an_unparsable_ground_truth() -> None:
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        REWARDS.get("math_verify")("\\boxed{1}", "", {})


ADD_STDIO = json.dumps({"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7", "0\n"]})


@pytest.mark.parametrize(
    "program,score",
    [
        ("a, b = map(int, input().split())\nprint(a + b)", 1.0),
        ("a, b = map(int, input().split())\nprint(a + b if a else 1)", 2 / 3),
        ("print(3)", 1 / 3),
        ("while True:\n    pass", 0.0),
        ("import sys; sys.exit(1)", 0.0),
    ],
)
def test_code_tests_stdin_stdout(program: str, score: float) -> None:
    response = f"Here is my solution:\n```python\n{program}\n```\nIt adds."
    assert REWARDS.get("code_tests")(response, ADD_STDIO, {"time_limit_s": 1}) == pytest.approx(
        score
    )


def test_code_tests_assert_style_from_the_tests_column() -> None:
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
    fn = REWARDS.get("code_tests")
    assert fn("def add(a, b):\n    return a + b\n", "", {"tests": tests}) == 1.0
    assert fn(
        "```py\ndef add(a, b):\n    return int(a) + int(b)\n```", "", {"tests": {"asserts": tests}}
    ) == pytest.approx(2 / 3)
    assert fn("def sub(a, b):\n    return a - b", "", {"tests": tests}) == 0.0


def test_test_case_formats() -> None:
    pairs = parse_test_cases([{"input": "1", "output": "2"}])
    assert [(c.stdin, c.expected_stdout) for c in pairs] == [("1", "2")]
    with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
        parse_test_cases({"inputs": ["1", "2"], "outputs": ["3"]})
    with pytest.raises(ValueError, match="must be JSON"):
        parse_test_cases("print(1)")
    assert extract_program("a\n```python\nx = 1\n```\nb\n```\ny = 2\n```") == "y = 2\n"
    assert extract_program("x = 1") == "x = 1"


def test_program_is_the_last_of_several_blocks_whatever_the_fence_case() -> None:
    response = "```python\nx = 1\n```\nthen\n```Python\nx = 2\n```\nfinally\n```PY\nx = 3\n```"
    assert extract_program(response) == "x = 3\n"


@pytest.mark.parametrize(
    "spec",
    [[], {"inputs": ["1"]}, {"outputs": ["1"]}, {"cases": ["assert f()"]}, [1, 2], {}],
)
def test_test_cases_of_no_known_shape_are_refused(spec: object) -> None:
    with pytest.raises(ValueError, match="test cases must be"):
        parse_test_cases(spec)


def test_asserts_that_mention_input_are_asserts() -> None:
    cases = parse_test_cases(["assert parse_input('1 2') == [1, 2]", "assert f() == 0"])
    assert [(c.stdin, c.expected_stdout, c.check) for c in cases] == [
        ("", None, "assert parse_input('1 2') == [1, 2]"),
        ("", None, "assert f() == 0"),
    ]
    stdio = parse_test_cases(json.dumps({"inputs": [1, "2\n"], "outputs": ["3", 4]}))
    assert [(c.stdin, c.expected_stdout, c.check) for c in stdio] == [
        ("1", "3", ""),
        ("2\n", "4", ""),
    ]


def test_right_output_then_a_crash_fails_the_case() -> None:
    program = "print(input())\nraise SystemExit(1)"
    tests = {"inputs": ["7\n"], "outputs": ["7\n"]}
    assert REWARDS.get("code_tests")(program, "", {"tests": tests, "time_limit_s": 1}) == 0.0


CPU_LIMIT = "import resource\nprint(resource.getrlimit(resource.RLIMIT_CPU)[0])"


@pytest.mark.parametrize("time_limit_s,cpu_s", [(None, 6), (1, 2), (3.7, 4)])
def test_each_case_gets_a_cpu_limit_a_second_above_its_time_limit(
    time_limit_s: float | None, cpu_s: int
) -> None:
    """The default time limit is 5 s; CPU seconds are whole."""
    tests = {"inputs": [""], "outputs": [str(cpu_s)]}
    sample = {"tests": tests} | ({} if time_limit_s is None else {"time_limit_s": time_limit_s})
    assert REWARDS.get("code_tests")(CPU_LIMIT, "", sample) == 1.0


@pytest.mark.parametrize("flag", [["-O"], ["-OO"]])
def test_an_optimising_interpreter_still_runs_the_asserts(flag: list[str]) -> None:
    """``python -O`` (and PYTHONOPTIMIZE, which reward-pool workers inherit) strips assert
    statements from what the interpreter compiles: the assert case must keep them, or every
    program scores 1.0."""
    import subprocess
    import sys

    code = (
        "from rlframe.rewards import REWARDS\n"
        "tests = ['assert add(1, 2) == 3', 'assert add(2, 2) == 4']\n"
        "fn = REWARDS.get('code_tests')\n"
        "print(fn('', '', {'tests': tests}), fn('+76', '', {'tests': tests}),"
        " fn('def add(a, b):\\n    return a + b', '', {'tests': tests}))\n"
    )
    out = subprocess.run(
        [sys.executable, *flag, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.0", "0.0", "1.0"]
