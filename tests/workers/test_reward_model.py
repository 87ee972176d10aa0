"""The reward-model worker on a real FSDP2 model (gloo, one rank, in this process) scores what
a plain transformers forward pass scores, through the reward model's own chat template."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch

from rlframe.config import (
    ActorConfig,
    Config,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RewardModelConfig,
    TrainerConfig,
)
from rlframe.core.protocol import Batch
from rlframe.data.tiny_reward_model import CHAT_TEMPLATE, resolve_reward_model_path


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_reward_model_path("tiny-rm:0", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", autouse=True)
def single_rank_group() -> None:
    if "MASTER_PORT" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def make_config(micro: int, max_length: int = 4096) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        actor=ActorConfig(mini_batch_size=16),
        reward=RewardConfig(
            model=RewardModelConfig(path="tiny-rm:0", micro_batch_size=micro, max_length=max_length)
        ),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def make_request() -> Batch:
    turns = [
        [{"role": "user", "content": "3+4="}],
        [{"role": "user", "content": "copy abc:"}],
        [{"role": "user", "content": "9+9="}],
    ]
    messages = np.empty(len(turns), dtype=object)
    for i, t in enumerate(turns):
        messages[i] = t
    return Batch(columns={"messages": messages, "response": ["7", "abc and more", "18"]})


def reference_scores(path: str, request: Batch) -> list[float]:
    """One transformers forward per conversation, no padding, no FSDP."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    scores = []
    for turns, response in zip(request["messages"], request["response"]):
        text = f"user: {turns[0]['content']}\nassistant: {response}\n"  # CHAT_TEMPLATE written out
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    return scores


def test_tiny_reward_model_has_its_own_template(rm_path: str) -> None:
    from transformers import AutoConfig, AutoTokenizer

    assert AutoTokenizer.from_pretrained(rm_path).chat_template == CHAT_TEMPLATE
    config = AutoConfig.from_pretrained(rm_path)
    assert config.num_labels == 1 and config.architectures == ["Qwen2ForSequenceClassification"]


def test_worker_scores_match_transformers(rm_path: str) -> None:
    from workers.reward_model import RewardModelWorker

    request = make_request()
    expected = reference_scores(rm_path, request)
    worker = RewardModelWorker(make_config(micro=2), rm_path, "cpu")
    scores = worker.compute_rm_scores(request)["rm_score"]
    assert scores.shape == (3,) and scores.dtype == torch.float32
    # Padded micro-batches of 2 and one-by-one reference passes agree.
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5), (scores, expected)
    assert len(set(np.round(expected, 4))) == 3  # a random head still tells responses apart


def test_long_inputs_keep_their_end(rm_path: str) -> None:
    from transformers import AutoTokenizer

    from workers.reward_model import render_conversation

    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    ids = render_conversation(
        tokenizer, [{"role": "user", "content": "x" * 50}], "the end", max_length=12
    )
    tail = tokenizer("assistant: the end\n", add_special_tokens=False)["input_ids"]
    assert len(ids) == 12 and ids == tail[-12:]
