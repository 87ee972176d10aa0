"""A running OpenAI-compatible server over a real engine in this process: the tiny model
in transformers (``rollout.engine=hf``, the RolloutRole the workers hold), its plain
template or a ChatML template with tools, and the real ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rlframe.agent_server.app import AgentServer
from rlframe.agent_server.sessions import Session
from rlframe.agent_server.trajectory import Episode
from rlframe.config import (
    ActorConfig,
    AgentConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    RolloutEngineName,
)
from rlframe.data.tiny_model import (
    TinyModelSpec,
    build_tiny_config,
    resolve_model_path,
    save_model_atomically,
)
from rlframe.rollout.engine_client import EngineClient
from tests.unit.chatml_tokenizer import build_chatml_tokenizer
from workers.roles.rollout_role import RolloutRole


def make_config(**agent: Any) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(task="guess", batch_size=4, max_prompt_length=400),
        rollout=RolloutConfig(
            engine=RolloutEngineName.hf, agent="openai", n=2, max_tokens=24, temperature=1.0
        ),
        agent=AgentConfig(max_turns=4, max_obs_tokens=200, **agent),
        actor=ActorConfig(mini_batch_size=8, micro_batch_size=8),
    )


def build_chatml_model(target: Path) -> str:
    """The tiny model's architecture over the ChatML character tokenizer."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_chatml_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        build_tiny_config(TinyModelSpec(), tokenizer, tie_word_embeddings=True)
    )
    save_model_atomically(model, tokenizer, target)
    return str(target)


class Served:
    """A started server, its tokenizer and a way to open episodes on it."""

    def __init__(self, server: AgentServer, tokenizer: Any) -> None:
        self.server, self.tokenizer = server, tokenizer

    def open(self, seed: int = 0) -> Session:
        episode = Episode(self.tokenizer, {int(self.tokenizer.eos_token_id)})
        return self.server.sessions.open({"prompt": "", "ground_truth": "0"}, seed, episode)


def serve(cfg: Config, model_path: str, tokenizer: Any) -> AgentServer:
    role = RolloutRole(cfg, model_path, "cpu", 0)
    server = AgentServer(cfg, EngineClient([role.serve]), tokenizer, "tiny")
    server.sample_like({"stop_token_ids": [tokenizer.eos_token_id]})
    server.start()
    return server


@pytest.fixture(scope="module")
def plain() -> Iterator[Served]:
    from transformers import AutoTokenizer

    path = resolve_model_path("tiny:0")
    tokenizer = AutoTokenizer.from_pretrained(path)
    server = serve(make_config(max_request_bytes=65536), path, tokenizer)
    yield Served(server, tokenizer)
    server.stop()


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = build_chatml_model(tmp_path_factory.mktemp("chatml") / "model")
    tokenizer = build_chatml_tokenizer()
    server = serve(make_config(), path, tokenizer)
    yield Served(server, tokenizer)
    server.stop()
