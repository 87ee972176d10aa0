"""``code_tests``: run the response's program against the row's test cases in the sandbox.

Test cases come from the row's ``tests`` column, else from ``ground_truth`` (either as a
JSON string or already parsed), in one of two styles:

- stdin/stdout: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}`` or a list of
  ``{"input": ..., "output": ...}``: the program reads the input and must print the output
  (compared line by line, trailing spaces ignored);
- assert: ``{"asserts": ["assert add(1, 2) == 3", ...]}`` or a plain list of such strings:
  each runs in the reward worker, outside the sandbox, against proxies of the program's
  names among the assert's free names that are not builtins or standard modules
  (:mod:`rlframe.rewards.code_calls`): a case passes only when the assert itself ran to its
  end on plain values the program returned. Exiting early, exception hooks, overridden or
  shadowed builtins or a forged harness's output cannot make it pass. Functions the *prompt*
  defines and the asserts call (HumanEval's ``poly`` beside ``find_zero``, ``encode_cyclic``
  beside ``decode_cyclic``) go in ``helpers`` (a key beside ``asserts``, or a row column):
  the assert calls the prompt's own copy in the reward worker, never the program's, and
  the sandbox binds them over the program's names after it loads. So redefining a helper,
  or recording what it was called with, gains nothing: a passing program must define the
  functions under test, and may call the helpers, copy them or leave them out.

The score is the fraction of test cases passed; each case is one sandboxed run (see
:mod:`rlframe.rewards.sandbox`) of at most ``time_limit_s`` seconds (a row's
``time_limit_s`` column, else 5). The program is the last fenced code block of the
response (```` ```python ````), or the whole response when it has none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlframe.rewards.code_calls import run_assert_case
from rlframe.rewards.registry import REWARDS
from rlframe.rewards.sandbox import detect_isolation, run_python
from rlframe.rewards.sandbox_command import SandboxLimits

FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
DEFAULT_TIME_LIMIT_S = 5.0


@dataclass
class TestCase:
    stdin: str
    """Input fed to the program (stdin style), or empty."""
    expected_stdout: str | None
    """What the program must print (stdin style); None for an assert."""
    check: str
    """The assert (assert style), run outside the sandbox against the program; or empty."""
    helpers: str = ""
    """The prompt's own functions the assert calls (assert style): trusted code, run beside
    the assert and bound over the program's names after it loads; or empty."""


def extract_program(response: str) -> str:
    """The last fenced code block, else the whole response."""
    blocks = FENCED.findall(response)
    return blocks[-1] if blocks else response


def parse_test_cases(spec: Any, helpers: str = "") -> list[TestCase]:
    """Test cases from a row's ``tests`` value or ground truth (see the module docstring);
    ``helpers``: a row's own ``helpers`` column (else the spec's ``helpers`` key)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError:
            raise ValueError(
                f"test cases must be JSON (stdin/stdout or asserts), got {spec[:80]!r}"
            ) from None
    if isinstance(spec, dict) and "inputs" in spec and "outputs" in spec:
        if len(spec["inputs"]) != len(spec["outputs"]):
            raise ValueError(f"{len(spec['inputs'])} inputs but {len(spec['outputs'])} outputs")
        return [TestCase(str(i), str(o), "") for i, o in zip(spec["inputs"], spec["outputs"])]
    if isinstance(spec, dict) and "asserts" in spec:
        helpers = helpers or str(spec.get("helpers") or "")
        spec = spec["asserts"]
    if isinstance(spec, list) and spec and all(isinstance(c, dict) and "input" in c for c in spec):
        return [TestCase(str(c["input"]), str(c["output"]), "") for c in spec]
    if isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec):
        return [TestCase("", None, c, helpers) for c in spec]
    raise ValueError(
        "test cases must be {'inputs': [...], 'outputs': [...]}, [{'input', 'output'}, ...], "
        f"{{'asserts': [...]}} or a list of assert strings; got {str(spec)[:80]!r}"
    )


def normalise_output(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def run_test_case(program: str, case: TestCase, limits: SandboxLimits) -> bool:
    if case.check:
        return run_assert_case(program, case.check, limits, case.helpers)
    result = run_python(program, case.stdin, limits)
    return result.ok and normalise_output(result.stdout) == normalise_output(
        case.expected_stdout or ""
    )


@REWARDS.register("code_tests")
def score_code_tests(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    """Fraction of the row's test cases the response's program passes."""
    detect_isolation()
    spec = sample["tests"] if "tests" in sample else ground_truth
    cases = parse_test_cases(spec, str(sample.get("helpers") or ""))
    limit = float(sample.get("time_limit_s") or DEFAULT_TIME_LIMIT_S)
    limits = SandboxLimits(wall_s=limit, cpu_s=max(1, int(limit) + 1))
    program = extract_program(response)
    return sum(run_test_case(program, case, limits) for case in cases) / len(cases)
