"""The reward-model worker: an ``AutoModelForSequenceClassification`` under FSDP2 that scores
prompt + response, placed on the actor's bundles like the critic.

The reward model has its own tokenizer and chat template: the driver sends the prompt as
chat turns (before the policy's template) and the decoded response; each rank renders
``turns + [assistant: response]`` with the reward model's template (or joins the texts when
it has none), tokenises, keeps the last ``reward.model.max_length`` tokens, and reads the
model's one-label score at the last token. No optimizer: it only scores.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from rlframe.config import Config
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.protocol import Batch
from workers.engines.fsdp import pick_attention, pick_dtype


def shard_scoring_model(model: nn.Module, device: str, dtype: torch.dtype) -> None:
    """FSDP2 over all ranks: each decoder layer, then the root (embeddings, norm, score head).

    Sharding happens on CPU; ``to(device)`` then moves only the local shards."""
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    backbone = getattr(model, model.base_model_prefix, model)
    for layer in getattr(backbone, "layers", []):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def render_conversation(
    tokenizer: Any, messages: list[dict[str, Any]], response: str, max_length: int
) -> list[int]:
    """Token ids of prompt turns + the response as the reward model reads them, keeping the end."""
    conversation = [*messages, {"role": "assistant", "content": response}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer("".join(str(m["content"]) for m in conversation))["input_ids"]
    return list(ids[-max_length:])


class RewardModelWorker(Worker):
    """Args: the run's config, the resolved reward-model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.init_process_group(device)
        rm = cfg.reward.model
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=rm.trust_remote_code
        )
        dtype = pick_dtype(rm, device)  # type: ignore[arg-type]  # reads .dtype only
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path,
            dtype=dtype,
            attn_implementation=pick_attention(device),
            trust_remote_code=rm.trust_remote_code,
        )
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward model {model_path} has {model.config.num_labels} labels; a reward model has 1"
            )
        self.pad_id = first_not_none(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.pad_id  # HF refuses batches > 1 without one
        model.eval()
        shard_scoring_model(model, device, dtype)
        self.model = model.to(device)
        # The per-token scores, read at each row's last real token (whatever the pad id is).
        self.token_scores: torch.Tensor | None = None
        head = getattr(self.model, "score", None)
        if isinstance(head, nn.Module):
            head.register_forward_hook(self.keep_token_scores)

    def keep_token_scores(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self.token_scores = output

    @dispatch(Dispatch.DP_SPLIT)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_score`` for each row of ``messages`` (chat turns) and ``response`` (text).

        DP_SPLIT pads the batch to a multiple of the ranks, so every rank runs the same number
        of forward passes: FSDP's all-gathers must match across ranks.
        """
        rows = [
            render_conversation(self.tokenizer, list(m), str(r), self.cfg.reward.model.max_length)
            for m, r in zip(batch["messages"], batch["response"])
        ]
        size = self.cfg.reward.model.micro_batch_size
        scores = [self.score_rows(rows[i : i + size]) for i in range(0, len(rows), size)]
        return Batch({"rm_score": torch.cat(scores) if scores else torch.zeros(0)})

    @torch.no_grad()
    def score_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Right-padded forward pass; the score at each row's last real token, in fp32 on CPU."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        out = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        if self.token_scores is None:
            return out.logits[:, 0].float().cpu()
        last = (mask.sum(1) - 1).to(self.device)
        scores = self.token_scores[torch.arange(len(rows), device=self.device), last, 0]
        self.token_scores = None
        return scores.float().cpu()


def first_not_none(*values: int | None) -> int:
    return next(v for v in values if v is not None)
