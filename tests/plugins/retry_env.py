from rlframe.envs import StepResult


class RetryEnv:
    """Right answer: reward 1 and done. Wrong: say so and let the model try again."""

    def __init__(self, hint: str = " wrong, try again:") -> None:
        self.hint = hint
        self.answer = ""

    def reset(self, sample: dict) -> list[dict]:
        # sample: the prompt row (prompt, messages, ground_truth and the file's other columns).
        self.answer = sample["ground_truth"]
        return sample["messages"]  # the opening messages; the chat template renders them

    def step(self, action: str) -> StepResult:
        # action: the text of the model's turn, without its end-of-turn token.
        if action.strip() == self.answer:
            return StepResult([], 1.0, True, {})  # (observation messages, reward, done, info)
        return StepResult([{"role": "user", "content": self.hint}], 0.0, False, {})
