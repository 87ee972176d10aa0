"""Multi-turn episodes of a vision-language model whose observations carry images, on the
driver with a scripted policy in place of the engine (the whole run with vLLM is in
tests/e2e/test_vision_run.py): an observation's image pads are expanded as the model's
processor expands them, and the row's ``images`` extra lists the prompt's image and then the
observations', in the order of their pads, on every engine call and in the training grid."""

from __future__ import annotations

import random
from typing import Any

import pytest
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
from rlframe.data.prompts import tokenize_prompts
from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
from rlframe.data.visual_tasks import COLOURS, draw_square, make_colour
from rlframe.envs import ChatFormat, EnvError
from rlframe.envs.colour_quiz import ColourQuizEnv
from rlframe.models.images import decode_image, load_processor
from rlframe.rollout import AgentContext
from rlframe.rollout.multi_turn import run_episodes
from rlframe.rollout.rows import build_response
from tests.rows_grid import run_agent


@pytest.fixture(scope="module")
def processor() -> Any:
    return load_processor(resolve_tiny_vl_path("tiny-vl:0"))


def pad_of(processor: Any) -> int:
    return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def test_an_observation_image_is_expanded_as_the_processor_expands_it(processor: Any) -> None:
    chat = ChatFormat(processor.tokenizer)
    image = decode_image(draw_square(random.Random(1), COLOURS["red"]))  # a PIL image
    parts = [{"type": "image", "image": image}, {"type": "text", "text": "again?"}]
    ids, cut = chat.observation_ids([{"role": "user", "content": parts}], 64)

    # The processor's own expansion of the same text (its single pad) with the same image.
    pad = pad_of(processor)
    collapsed = [t for k, t in enumerate(ids) if t != pad or ids[k - 1] != pad]
    text = processor.tokenizer.decode(collapsed, skip_special_tokens=False)
    expected = processor(text=[text], images=[image])["input_ids"][0]
    assert ids == list(expected) and not cut
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert ids.count(pad) == int(grid.prod()) // 4 > 1

    # Text parts of an image observation are never cut to fit: it is refused instead.
    with pytest.raises(EnvError, match="raise agent.max_obs_tokens"):
        chat.observation_ids([{"role": "user", "content": parts}], len(ids) - 1)


class QuizPolicy:
    """The engine: answers each episode's turn k with ``answers[k]`` (one token, cut at 1, so
    the runner closes it), recording every request's context and images by episode (told
    apart by its prompt's image, which every request of the episode carries first)."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.requests: dict[bytes, list[tuple[list[int], list[bytes]]]] = {}

    def __call__(self, batch: Batch) -> Batch:
        turns = []
        for context, images in zip(batch["prompt_tokens"], batch["images"], strict=True):
            seen = self.requests.setdefault(images[0], [])
            turns.append(([self.answers[len(seen)]], [-0.5], "length"))
            seen.append((list(context), list(images)))
        return build_response(turns, 1)


def run_quiz(processor: Any, answers: list[int], rows: int = 2) -> tuple[Batch, QuizPolicy]:
    tokenizer = processor.tokenizer
    examples = [make_colour(random.Random(i)) for i in range(rows)]
    rows_in = [
        ({"prompt": p, "ground_truth": a, "images": im}, f"row {i}")
        for i, (p, a, im) in enumerate(examples)
    ]
    records = tokenize_prompts(rows_in, tokenizer, 32).records
    prompts = build_prompt_batch(records, 1, 0, tokenizer.pad_token_id, seed=3)
    prompts.meta |= {
        "stop_token_ids": [tokenizer.eos_token_id],
        "pad_token_id": tokenizer.pad_token_id,
    }
    cfg = Config(
        model=ModelConfig(path="tiny-vl:0"),
        data=DataConfig(batch_size=rows, max_prompt_length=32),
        rollout=RolloutConfig(agent="multi_turn", n=1, max_tokens=2),
        agent=AgentConfig(
            env="colour_quiz",
            max_turns=2,
            max_tokens_per_turn=1,
            close_cut_turns=True,
            max_obs_tokens=32,
        ),
        actor=ActorConfig(mini_batch_size=rows, micro_batch_size=rows),
        algorithm=AlgorithmConfig(advantage="reinforce_pp"),
    )
    policy = QuizPolicy(answers)
    return run_agent(run_episodes, prompts, AgentContext(policy, tokenizer, cfg)), policy


def test_an_observation_image_joins_the_row_after_the_prompt_image(processor: Any) -> None:
    tokenizer = processor.tokenizer
    r = tokenizer.convert_tokens_to_ids("r")
    batch, policy = run_quiz(processor, [r, r])
    pad, eos = pad_of(processor), tokenizer.eos_token_id
    for i in range(2):
        prompt_image = make_colour(random.Random(i))[2][0]
        env = ColourQuizEnv()
        env.reset({"prompt": "colour?", "ground_truth": "r", "images": [prompt_image]})
        # Both turns' requests and the grid carry the prompt's image, then the observation's.
        (first, first_images), (second, second_images) = policy.requests[prompt_image]
        assert first_images == [prompt_image]
        assert second_images == [prompt_image, env.second]
        assert batch["images"][i] == [prompt_image, env.second]
        # The second request continues the first: prompt + turn + close + the observation,
        # whose pads are its image's.
        obs = second[len(first) + 2 :]
        assert second[: len(first) + 2] == [*first, r, eos]
        expected, _ = ChatFormat(tokenizer).observation_ids(env.step("r").observation, 32)
        assert obs == expected and obs.count(pad) > 1
        n = int(batch["response_mask"][i].sum())
        assert batch["response_ids"][i, :n].tolist() == [r, eos, *obs, r]
        assert batch["loss_mask"][i, :n].tolist() == [1] + [0] * (len(obs) + 1) + [1]
    assert batch["agent_obs_images"].tolist() == [1.0, 1.0]
    assert batch["agent_turns"].tolist() == [2.0, 2.0]


def test_a_sampled_image_pad_ends_an_episode_with_images(processor: Any) -> None:
    """The engine could not serve a context holding a pad that stands for no image."""
    r = processor.tokenizer.convert_tokens_to_ids("r")
    batch, policy = run_quiz(processor, [pad_of(processor), r], rows=1)
    (requests,) = policy.requests.values()
    assert len(requests) == 1 and batch["agent_turns"].tolist() == [1.0]
    assert len(batch["images"][0]) == 1 and batch["agent_obs_images"].tolist() == [0.0]
    assert torch.equal(batch["loss_mask"][0, :1], torch.ones(1))
