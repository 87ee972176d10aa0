"""The training update on a real FSDP2 engine (gloo, one rank, in this process)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from rlframe.config import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.data.tiny_model import resolve_model_path
from rlframe.protocol import Batch


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module", autouse=True)
def single_rank_group() -> None:
    """A one-rank gloo process group for this process, as a worker would have."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def make_config(micro: int, loss_agg: str, kl_coef: float = 0.0) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=5),
        actor=ActorConfig(lr=1e-3, mini_batch_size=16, micro_batch_size=micro),
        algorithm=AlgorithmConfig(loss_agg=loss_agg, kl_coef=kl_coef, entropy_coef=0.01),
        trainer=TrainerConfig(total_steps=1, device="cpu"),
    )


def make_batch(seed: int = 0) -> Batch:
    """16 responses of ragged length (one empty) with random advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, 40, (16, 4), generator=g)
    response_ids = torch.randint(3, 40, (16, 5), generator=g)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1, 5, 2, 3, 3, 1, 5, 4, 2])
    response_mask = (torch.arange(5)[None] < lengths[:, None]).float()
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones(16, 4, dtype=torch.long),
            "response_ids": response_ids,
            "response_mask": response_mask,
            "loss_mask": response_mask,
            "advantages": torch.randn(16, 1, generator=g) * response_mask,
            "old_logprobs": -3.0 - torch.rand(16, 5, generator=g),
            "ref_logprobs": -3.0 - torch.rand(16, 5, generator=g),
        }
    )


def updated_weights(model_path: str, micro: int, loss_agg: str) -> tuple[dict[str, float], torch.Tensor]:
    from workers.hybrid import HybridWorker

    worker = HybridWorker(make_config(micro, loss_agg, kl_coef=0.1), model_path, "cpu")
    metrics = worker.update(make_batch())
    weights = torch.cat([p.detach().reshape(-1) for p in worker.actor.model.parameters()])
    return metrics, weights


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_update_does_not_depend_on_micro_batch_size(model_path: str, loss_agg: str) -> None:
    whole, w_whole = updated_weights(model_path, 16, loss_agg)
    split, w_split = updated_weights(model_path, 4, loss_agg)
    print(f"{loss_agg}: grad_norm micro=16 {whole['actor/grad_norm']:.6f} micro=4 {split['actor/grad_norm']:.6f}")
    assert whole["actor/grad_norm"] > 0
    assert whole["actor/grad_norm"] == pytest.approx(split["actor/grad_norm"], rel=1e-5)
    # After one AdamW step: parameters with near-zero gradients amplify summation-order noise
    # (Adam divides by sqrt(v)), so compare to 1% of a step of size lr = 1e-3.
    torch.testing.assert_close(w_whole, w_split, atol=1e-5, rtol=0)
    assert whole["actor/kl"] > 0 and "actor/pg_clipfrac" in whole
