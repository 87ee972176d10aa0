"""``model.lora`` / ``critic.lora``: low-rank adapters (peft) instead of full fine-tuning.

The base weights stay frozen; only the adapters (and their optimizer state) train, are
checkpointed and, with ``sync=adapter``, travel to the rollout engine. Value checks run in
the schema (:func:`check_lora`); whether the target modules exist in the model is checked
against the model's architecture before Ray starts
(:func:`rlframe.models.lora_targets.check_lora_targets`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from rlframe.config.checks import require

if TYPE_CHECKING:
    import peft

# vLLM's ``max_lora_rank`` choices: it serves adapters of any rank up to the one it is given.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSync(str, Enum):
    merged = "merged"
    """Merge the adapters into the base weights and stream full tensors (any engine)."""
    adapter = "adapter"
    """Stream only the adapter tensors; the engine serves them as a LoRA (vLLM only)."""


@dataclass
class LoraConfig:
    rank: int = 0
    """Rank r of every adapter; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 32.0
    """Adapter scale numerator: the update is ``(alpha / rank) * B @ A``."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training (0: the update sees what sampling saw)."""
    target_modules: list[str] = field(default_factory=list)
    """Names (last path segment) of the linear layers that get adapters, e.g. ``[q_proj,
    v_proj]``. Empty: every linear layer of the decoder (peft's ``all-linear``, no LM head);
    on a mixture-of-experts model, every attention layer (experts and router take none, see
    rlframe/models/lora_targets.py). On a vision-language model they name the language model's
    layers: the vision tower takes no adapters and keeps its loaded weights."""
    sync: LoraSync = LoraSync.merged
    """How the rollout engine gets the trained weights: ``merged`` (full tensors, base plus
    adapter) or ``adapter`` (the adapter tensors only, served by vLLM's LoRA support)."""
    verify_sync: bool = True
    """After each weight sync, compare the engine's log-probs of a fixed probe with the
    trainer's and stop the run when the engine still serves the previous adapter."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def to_peft(self, head: str = "lm", targets: list[str] | None = None) -> peft.LoraConfig:
        """The peft config: ``targets`` when given (:func:`rlframe.models.lora_targets.
        list_peft_targets`: the attention of an MoE model, the language model's layers of a
        vision-language model by their full names), else ``target_modules``, else every
        linear layer of the decoder (``all-linear`` leaves the LM head out). ``head="value"``
        (a critic): peft's TOKEN_CLS task, whose fresh ``score`` head trains in full beside
        the adapters."""
        from peft import LoraConfig as PeftLoraConfig

        return PeftLoraConfig(
            r=self.rank,
            # peft annotates lora_alpha int, but only divides it by r: a float alpha is exact.
            lora_alpha=self.alpha,  # type: ignore[arg-type]
            lora_dropout=self.dropout,
            target_modules=(
                targets if targets is not None else list(self.target_modules) or "all-linear"
            ),
            bias="none",
            task_type={"lm": "CAUSAL_LM", "value": "TOKEN_CLS"}[head],
            # The value head trains in full (modules_to_save): no adapter on it.
            exclude_modules=["score"] if head == "value" else None,
        )

    def describe(self) -> dict[str, object]:
        """What an export needs to rebuild the adapters (saved beside a checkpoint)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "target_modules": list(self.target_modules),
        }


def check_lora(lora: LoraConfig, key: str) -> None:
    """Value checks of one LoRA section; ``key`` is its dotted name (``model.lora``)."""
    lora.sync = LoraSync(lora.sync)
    require(lora.rank >= 0, f"{key}.rank", f"must be >= 0 (0 turns LoRA off), got {lora.rank}")
    require(lora.alpha > 0, f"{key}.alpha", f"must be > 0, got {lora.alpha}")
    require(0 <= lora.dropout < 1, f"{key}.dropout", f"must be in [0, 1), got {lora.dropout}")
    names = lora.target_modules
    require(
        all(isinstance(n, str) and n and "." not in n for n in names),
        f"{key}.target_modules",
        f"must be module names without dots (q_proj, down_proj...), got {names}",
    )


def check_adapter_sync(lora: LoraConfig, engine: str, sleep_level: int) -> None:
    """``model.lora.sync=adapter`` needs an engine that serves adapters (vLLM), at a rank
    vLLM accepts, and an engine that keeps its base weights across a sleep (level 1): only
    the adapters are pushed, so a level-2 sleep would leave the base weights lost."""
    if not lora.enabled or lora.sync is not LoraSync.adapter:
        return
    require(
        engine == "vllm",
        "model.lora.sync",
        f"adapter needs rollout.engine=vllm (the {engine} engine cannot serve adapters); "
        "use model.lora.sync=merged",
    )
    require(
        lora.rank <= max(VLLM_LORA_RANKS),
        "model.lora.rank",
        f"{lora.rank}: with sync=adapter vLLM serves ranks up to {max(VLLM_LORA_RANKS)}",
    )
    require(
        sleep_level == 1,
        "rollout.sleep_level",
        "must be 1 with model.lora.sync=adapter: level 2 discards the engine's base weights, "
        "and an adapter sync does not push them",
    )
