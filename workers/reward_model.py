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

from rlframe.config import Config
from rlframe.controller import reads
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch
from rlframe.core.tokenizer import Tokenizer, as_tokenizer
from workers.training.layout_forward import run_as_root_forward
from workers.training.model_build import apply_fsdp, pick_attention, pick_dtype
from workers.training.rank0_load import load_rank0_state


def render_conversation(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], response: str, max_length: int
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
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        self.cfg, self.device = cfg, device
        self.init_process_group(device)
        rm = cfg.reward.model
        self.tokenizer = as_tokenizer(
            AutoTokenizer.from_pretrained(model_path, trust_remote_code=rm.trust_remote_code)
        )
        dtype = pick_dtype(rm.dtype, device)
        kwargs = {
            "dtype": dtype,
            "attn_implementation": pick_attention(device, dtype),
            "trust_remote_code": rm.trust_remote_code,
        }
        # With several ranks only rank 0 reads the weights (see the policy's build_train_model).
        spread, rank0 = dist.get_world_size() > 1, dist.get_rank() == 0
        if rank0 or not spread:
            model = AutoModelForSequenceClassification.from_pretrained(model_path, **kwargs)
        else:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=rm.trust_remote_code)
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config, **kwargs)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward model {model_path} has {model.config.num_labels} labels; "
                "a reward model has 1"
            )
        self.pad_id = first_not_none(self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.pad_id  # HF refuses batches > 1 without one
        model.eval()
        # The policy's sharding. fully_shard moves each unit's full tensors to the device to
        # cut them, so every rank passes one unit at a time through the device.
        full_state = model.state_dict() if spread and rank0 else {}
        apply_fsdp(model, init_device_mesh(device, (dist.get_world_size(),)), dtype)
        self.model = load_rank0_state(model, full_state, device) if spread else model.to(device)

    @dispatch(Dispatch.DP_SPLIT, reads=reads.REWARD_MODEL)
    def compute_rm_scores(self, batch: Batch) -> Batch:
        """``rm_score`` for each row of ``messages`` (chat turns) and ``response`` (text).

        DP_SPLIT pads the batch to a multiple of the ranks, so every rank runs the same number
        of forward passes: FSDP's all-gathers must match across ranks.
        """
        rows = [
            render_conversation(self.tokenizer, list(m), str(r), self.cfg.reward.model.max_length)
            for m, r in zip(batch.column("messages"), batch.column("response"))
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
        ids, mask = ids.to(self.device), mask.to(self.device)
        head = getattr(self.model, "score", None)
        if not isinstance(head, nn.Module):  # HF's own pick: the last token that is not pad
            logits: torch.Tensor = self.model(input_ids=ids, attention_mask=mask).logits
            return logits[:, 0].float().cpu()
        last = mask.sum(1) - 1

        def forward() -> torch.Tensor:
            # The head reads each row's last real token, whatever the pad id is; inside the
            # FSDP root's forward, so the root's gathered parameters are in place.
            backbone = getattr(self.model, self.model.base_model_prefix)
            hidden = backbone(input_ids=ids, attention_mask=mask, use_cache=False)[0]
            values: torch.Tensor = head(hidden[torch.arange(len(rows), device=self.device), last])
            return values[:, 0]

        return run_as_root_forward(self.model, forward).float().cpu()


def first_not_none(*values: int | None) -> int:
    return next(v for v in values if v is not None)
