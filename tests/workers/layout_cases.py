"""Shared pieces of the log-prob, packing and micro-batch tests: configs, ragged batches,
one-rank process-group environments, gathered gradients, an untied tiny model."""

from __future__ import annotations

import os
from pathlib import Path

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
from rlframe.core.train_batch import TrainBatch
from tests.harness import free_port  # noqa: F401 (also used by importers)

ROWS, PROMPT, RESPONSE = 16, 6, 9
LOSS_AGGS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """The environment a worker of a ``world_size`` group reads (see rlframe.controller.worker)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )


def join_one_rank_group() -> None:
    """This process as rank 0 of a one-rank gloo group, as a lone worker would be; a new
    group when there is none (a vLLM engine's shutdown destroys the default group)."""
    import torch.distributed as dist

    set_rank_env(0, 1, free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def make_config(
    loss_agg: str = "token-mean",
    micro: int = 16,
    budget: int = 0,
    packed: bool = True,
    chunk: int = 0,
    world_size: int = 1,
    entropy_coef: float = 0.01,
    kl_coef: float = 0.1,
    temperature: float = 1.0,
    sp: int = 1,
    mini: int = ROWS,
    lr: float = 1e-3,
    checkpointing: bool = False,
    lora_rank: int = 0,
    ep: int = 1,
) -> Config:
    from rlframe.config.lora import LoraConfig

    return Config(
        model=ModelConfig(
            path="tiny:0",
            gradient_checkpointing=checkpointing,
            lora=LoraConfig(rank=lora_rank, alpha=16),
        ),
        data=DataConfig(batch_size=4, max_prompt_length=PROMPT),
        rollout=RolloutConfig(engine="hf", n=4, max_tokens=RESPONSE, temperature=temperature),
        actor=ActorConfig(
            lr=lr,
            mini_batch_size=mini,
            micro_batch_size=micro,
            max_tokens_per_micro_batch=budget,
            pack_sequences=packed,
            logprob_chunk_size=chunk,
            sequence_parallel_size=sp,
            expert_parallel_size=ep,
        ),
        algorithm=AlgorithmConfig(loss_agg=loss_agg, kl_coef=kl_coef, entropy_coef=entropy_coef),
        trainer=TrainerConfig(total_steps=1, device="cpu", procs_per_node=world_size),
    )


def make_batch(seed: int = 0) -> TrainBatch:
    """16 rows: left-padded prompts of 1-6 tokens, responses of 0-9 tokens (one empty), the
    last token of some responses an observation (attended, not in the loss mask)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, PROMPT + 1, (ROWS,), generator=g)
    response_lengths = torch.tensor([9, 1, 3, 0, 2, 9, 4, 1, 5, 2, 3, 8, 1, 5, 4, 2])
    prompt_mask = (torch.arange(PROMPT)[None] >= PROMPT - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(RESPONSE)[None] < response_lengths[:, None]).float()
    loss_mask = response_mask.clone()
    for row in (0, 6, 11):
        loss_mask[row, int(response_lengths[row]) - 1] = 0
    return TrainBatch(
        prompt_ids=torch.randint(3, 40, (ROWS, PROMPT), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(3, 40, (ROWS, RESPONSE), generator=g) * response_mask.long(),
        response_mask=response_mask,
        loss_mask=loss_mask,
        advantages=torch.randn(ROWS, 1, generator=g) * loss_mask,
        old_logprobs=(-3.0 - torch.rand(ROWS, RESPONSE, generator=g)) * loss_mask,
        ref_logprobs=(-3.0 - torch.rand(ROWS, RESPONSE, generator=g)) * loss_mask,
        rollout_logprobs=(-3.0 - torch.rand(ROWS, RESPONSE, generator=g)) * loss_mask,
    )


def gather_grads(model: torch.nn.Module) -> torch.Tensor:
    """All gradients as one flat vector of full tensors (a collective under FSDP)."""
    from workers.training.fsdp import full_tensor

    return torch.cat([full_tensor(p.grad).reshape(-1) for p in model.parameters()])


def build_untied_model(source: str, target: Path) -> str:
    """The tiny model with its own LM head (the embeddings plus noise), saved to ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tied = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = tied.config
    config.tie_word_embeddings = False
    untied = type(tied)(config)
    untied.load_state_dict(tied.state_dict(), strict=False)
    g = torch.Generator().manual_seed(1)
    head = tied.get_input_embeddings().weight.detach().clone() + 0.05 * torch.randn(
        tied.get_input_embeddings().weight.shape, generator=g
    )
    untied.get_output_embeddings().weight.data = head
    untied.save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return str(target)
