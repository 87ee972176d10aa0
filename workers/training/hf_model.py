"""The type of the model an engine trains or scores: a transformers model, or the peft model
that wraps one with LoRA adapters (which hands unknown attributes on to the model it wraps).

Only for annotations: importing this module imports neither transformers nor peft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

HFModel: TypeAlias = "PreTrainedModel | PeftModel"
