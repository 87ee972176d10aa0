"""A scripted policy in place of the actor group's generate, and the configs and prompts of
the driver-side multi-turn tests (tests/unit/test_multi_turn*.py)."""

from __future__ import annotations

from typing import Any

import torch

from rlframe.config import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
)
from rlframe.core.protocol import Batch
from rlframe.data.loader import build_prompt_batch
from rlframe.data.prompts import PromptRecord
from rlframe.data.tiny_model import build_tiny_tokenizer
from rlframe.rollout import AgentContext
from rlframe.rollout.multi_turn import run_episodes
from rlframe.rollout.rows import build_response
from tests.rows_grid import run_agent

TOKENIZER = build_tiny_tokenizer()
EOS = TOKENIZER.eos_token_id


def encode(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptedPolicy:
    """Stands in for the actor group's generate. Row r (told apart by its prompt) answers turn
    k with ``turns[r][k]`` (cut at the row's max_tokens); log-prob of a token = -(its id)/100.
    Records each call's contexts and caps."""

    def __init__(self, prompts: list[str], turns: list[list[str]], width: int) -> None:
        self.prompts = [encode(p) for p in prompts]
        self.turns = turns
        self.width = width
        self.calls: list[dict[str, Any]] = []

    def __call__(self, batch: Batch) -> Batch:
        contexts = [list(c) for c in batch["prompt_tokens"]]
        caps = batch["max_tokens"].tolist()
        self.calls.append({"contexts": contexts, "max_tokens": caps, "meta": dict(batch.meta)})
        turns = []
        for context, cap in zip(contexts, caps):
            row = next(r for r, p in enumerate(self.prompts) if context[: len(p)] == p)
            turn = (
                sum(
                    1
                    for c in self.calls
                    if any(
                        ctx[: len(self.prompts[row])] == self.prompts[row] for ctx in c["contexts"]
                    )
                )
                - 1
            )
            text = self.turns[row][turn]
            sampled = (
                encode(text.removesuffix("<eos>")) + ([EOS] if text.endswith("<eos>") else [])
            )[:cap]
            logprobs = (-torch.tensor(sampled, dtype=torch.float) / 100).tolist()
            turns.append(
                (sampled, logprobs, "stop" if sampled and sampled[-1] == EOS else "length")
            )
        return build_response(turns, 3)

    def contexts_of(self, row: int) -> list[list[int]]:
        """Row ``row``'s requests' contexts, turn by turn."""
        prompt = self.prompts[row]
        return [c for call in self.calls for c in call["contexts"] if c[: len(prompt)] == prompt]


def make_config(env: str, n_prompts: int, max_tokens: int = 12, **agent: Any) -> Config:
    agent = {"max_turns": 4, "max_obs_tokens": 16} | agent
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=n_prompts, max_prompt_length=16),
        rollout=RolloutConfig(agent="multi_turn", n=1, max_tokens=max_tokens),
        agent=AgentConfig(env=env, **agent),
        actor=ActorConfig(mini_batch_size=n_prompts, micro_batch_size=n_prompts),
        algorithm=AlgorithmConfig(advantage="reinforce_pp"),
    )


def make_prompts(prompts: list[str], truths: list[str]) -> Batch:
    records = [
        PromptRecord(p, encode(p), t, {}, [{"role": "user", "content": p}])
        for p, t in zip(prompts, truths)
    ]
    batch = build_prompt_batch(records, 1, 0, TOKENIZER.pad_token_id, seed=5)
    batch.meta |= {"stop_token_ids": [EOS], "pad_token_id": TOKENIZER.pad_token_id}
    return batch


def run(cfg: Config, policy: ScriptedPolicy, prompts: Batch) -> Batch:
    return run_agent(run_episodes, prompts, AgentContext(policy, TOKENIZER, cfg))


GUESS = "guess_number"
HINTS = {"hint_format": " {hint}:"}
