"""A calculator tool and the tool environment built on it (``agent.env=calculator``).

For arithmetic word problems (GSM8K): the model may call ``calculate`` as often as it likes
within ``agent.max_turns``; the final answer is scored by ``reward.fn`` (math_answer), or
by the env when ``answer_reward`` > 0.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from rlframe.envs.base import ENVS
from rlframe.envs.tools import ToolEnv
from rlframe.rewards import score_math_answer

# One- and two-argument operators, keyed by the ast node type that names them.
OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
# Bounds that keep a hostile expression from eating the driver's CPU or memory.
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100
MAX_LENGTH = 200


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large")
        value = OPERATORS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result is too large")
        return value
    raise ValueError(
        f"unsupported expression element {type(node).__name__}: use numbers, + - * / // % ** and "
        "parentheses"
    )


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 4 / 3".
    """
    if len(expression) > MAX_LENGTH:
        raise ValueError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    value = evaluate(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math assistant. Use the calculate tool for arithmetic. When you know the "
    "answer, reply without a tool call and end with '#### <number>'."
)


@ENVS.register("calculator")
class CalculatorEnv(ToolEnv):
    """ToolEnv with the ``calculate`` tool.

    Args:
        answer_reward: env reward for a final answer that matches the ground truth
            (math_answer rule); 0 leaves answer scoring to ``reward.fn``.
        system_prompt: prepended when the sample has no system message.
        parser, max_calls_per_turn: as for ToolEnv.
    """

    def __init__(
        self,
        answer_reward: float = 0.0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        parser: str = "hermes",
        max_calls_per_turn: int = 4,
    ) -> None:
        super().__init__(
            [calculate],
            parser=parser,
            max_calls_per_turn=max_calls_per_turn,
            system_prompt=system_prompt,
        )
        self.answer_reward = answer_reward

    def score_answer(self, action: str) -> float:
        if self.answer_reward == 0:
            return 0.0
        sample: dict[str, Any] = self.sample
        return self.answer_reward * score_math_answer(
            action, str(sample.get("ground_truth", "")), sample
        )
