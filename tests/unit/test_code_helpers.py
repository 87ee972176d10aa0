"""HumanEval-style tasks whose asserts call functions the prompt defines (issue 46: a program
that redefined ``poly`` or recorded what ``encode_cyclic`` was called with passed). The
prompt's ``helpers`` run in the reward worker beside the assert, and over the program's names
in the sandbox: only the functions under test are the program's."""

from __future__ import annotations

import pytest

from rlframe.rewards.code_tests import score_code_tests

POLY = '''import math


def poly(xs: list, x: float):
    """Evaluates polynomial with coefficients xs at point x."""
    return sum([coeff * math.pow(x, i) for i, coeff in enumerate(xs)])
'''
FIND_ZERO = (
    "for coeffs in ([1, 2], [-6, 11, -6, 1], [1, 0, 0, 1]):\n"
    "    solution = find_zero(coeffs)\n"
    "    assert math.fabs(poly(coeffs, solution)) < 1e-4"
)
BISECTION = (
    "def find_zero(xs):\n"
    "    lo, hi = -10.0, 10.0\n"
    "    for _ in range(200):\n"
    "        mid = (lo + hi) / 2\n"
    "        if poly(xs, mid) * poly(xs, lo) > 0:\n"
    "            lo = mid\n"
    "        else:\n"
    "            hi = mid\n"
    "    return lo\n"
)
CYCLIC = '''def encode_cyclic(s: str):
    """Returns the string encoded by cycling groups of three characters."""
    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]
    groups = [(group[1:] + group[0]) if len(group) == 3 else group for group in groups]
    return "".join(groups)
'''
ROUND_TRIP = (
    "for s in ['abcdefg', 'hello world', 'xy']:\n    assert decode_cyclic(encode_cyclic(s)) == s"
)

HACKS = {
    "poly redefined to be 0 everywhere": (
        POLY,
        FIND_ZERO,
        "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n",
    ),
    "encode_cyclic records its argument": (
        CYCLIC,
        ROUND_TRIP,
        "seen = []\n\n"
        "def encode_cyclic(s):\n    seen.append(s)\n    return s\n\n"
        "def decode_cyclic(s):\n    return seen[-1]\n",
    ),
    "encode_cyclic is the identity": (
        CYCLIC,
        ROUND_TRIP,
        "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s\n",
    ),
}
HONEST = {
    "calls poly without a copy": (POLY, FIND_ZERO, BISECTION),
    "copies poly from the prompt": (POLY, FIND_ZERO, POLY + "\n\n" + BISECTION),
    # Its own poly is replaced by the prompt's once it has loaded: its find_zero then uses
    # the real one (and is right); the assert never calls the program's poly.
    "defines a wrong poly of its own": (
        POLY,
        FIND_ZERO,
        "def poly(xs, x):\n    return 0\n\n" + BISECTION,
    ),
    "decodes by encoding twice": (
        CYCLIC,
        ROUND_TRIP,
        "def decode_cyclic(s):\n    return encode_cyclic(encode_cyclic(s))\n",
    ),
}


def score(helpers: str, check: str, program: str, in_column: bool = False) -> float:
    sample: dict[str, object] = {"tests": {"asserts": [check]}, "time_limit_s": 5}
    if in_column:
        sample["helpers"] = helpers
    else:
        sample["tests"] = {"asserts": [check], "helpers": helpers}
    return score_code_tests(f"```python\n{program}```", "", sample)


@pytest.mark.parametrize("name", HACKS)
def test_a_program_that_redefines_or_spies_on_a_helper_scores_nothing(name: str) -> None:
    assert score(*HACKS[name]) == 0.0


@pytest.mark.parametrize("name", HONEST)
def test_a_program_that_defines_the_function_under_test_scores_fully(name: str) -> None:
    assert score(*HONEST[name]) == 1.0


def test_helpers_may_be_a_column_of_the_row() -> None:
    helpers, check, hack = HACKS["encode_cyclic records its argument"]
    assert score(helpers, check, hack, in_column=True) == 0.0
    assert score(*HONEST["decodes by encoding twice"], in_column=True) == 1.0
