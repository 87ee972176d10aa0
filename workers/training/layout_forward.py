"""The forwards of a :class:`~rlframe.core.sequence_layout.SequenceLayout`: final hidden states,
chunked log-probs and values of the selected tokens, whole or (sequence parallelism) this
rank's slice of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import nn

from rlframe.core.sequence_layout import SequenceLayout
from workers.training.hf_model import HFModel
from workers.training.token_logprobs import TokenLogprobs, compute_token_logprobs
from workers.training.ulysses import SequenceParallel, ShardedLayout, shard_layout

T = TypeVar("T")


def run_as_root_forward(model: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` called as the forward of ``model``, the FSDP2 root.

    FSDP2 gathers the root's own parameters (embeddings, final norm, the LM head) in the
    root's forward pre-hook and hooks the backward on its outputs; a sharded weight read
    outside that forward is only this rank's shard. So the backbone and the chunked head run
    inside one call of the root module, with ``fn`` standing in for its ``forward``.
    """
    # An instance attribute shadows the class's forward for this call. The call passes one
    # keyword: before torch 2.13 FSDP2's root pre-forward moves the inputs to the device and
    # indexes the result, which fails (IndexError) on a call without any (CUDA only).
    model.forward = lambda **_: fn()
    try:
        # Module.__call__ is typed Any; the forward it runs here is fn.
        return cast(T, model(root_call=True))
    finally:
        del model.forward


def find_vision_language_backbone(model: nn.Module) -> HFModel | None:
    """The backbone of a vision-language model (the module holding both the vision tower and
    the language model, Qwen2-VL's ``model``), wherever a wrapper put it; None for a text
    model."""
    for module in model.modules():
        if hasattr(module, "visual") and hasattr(module, "language_model"):
            # Qwen2-VL's backbone is a transformers PreTrainedModel (Qwen2VLModel).
            return cast("HFModel", module)
    return None


def compute_layout_hidden(model: HFModel, layout: SequenceLayout) -> torch.Tensor:
    """[N, H] final hidden states at the positions that predict the selected tokens. A
    vision-language model runs its vision tower on the layout's images first."""
    backbone = find_vision_language_backbone(model)
    inputs: dict[str, Any] = {"input_ids": layout.input_ids}
    if backbone is not None and layout.placeholder_ids is not None:
        # Every token embedded as itself, then the images' features put where the
        # placeholder ids (sampled image tokens masked out) say.
        inputs = {
            "input_ids": layout.placeholder_ids,
            "inputs_embeds": backbone.get_input_embeddings()(layout.input_ids),
            "pixel_values": layout.pixel_values,
            "image_grid_thw": layout.image_grid_thw,
        }
    out = (backbone or model.get_decoder())(
        **inputs,
        attention_mask=layout.attention_mask,
        position_ids=layout.position_ids,
        use_cache=False,
        **compute_varlen_kwargs(model, layout),
    )
    hidden: torch.Tensor = out.last_hidden_state
    return hidden.reshape(-1, hidden.shape[-1]).index_select(0, layout.predict_index)


def compute_varlen_kwargs(model: HFModel, layout: SequenceLayout) -> dict[str, Any]:
    """flash-attention's varlen lengths of a packed layout, computed once for the forward
    (transformers otherwise re-derives them from the position ids in every layer, with a
    host sync each time); nothing for other kernels, which ignore them."""
    if layout.attention_mask is not None or "flash" not in model.config._attn_implementation:
        return {}
    # The text positions: the first row of mrope's [4, 1, T] as well.
    positions = layout.position_ids.reshape(-1, layout.position_ids.shape[-1])[0]
    starts = (positions == 0).nonzero().squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([len(positions)])])
    cu = torch.cat([starts, starts.new_tensor([len(positions)])]).to(torch.int32)
    longest = int((ends - starts).max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def compute_own_hidden(
    model: HFModel, layout: SequenceLayout, sp: SequenceParallel | None
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(hidden [n, H], targets [n], gather): the final hidden states of the selected tokens
    this rank predicts, and the function that turns [n] values into the layout's [N] (all
    of them without sequence parallelism; this rank's slice's with it)."""
    if sp is None:
        return compute_layout_hidden(model, layout), layout.target_ids, lambda values: values
    shard = shard_layout(layout, sp)
    hidden = run_sharded_forward(model.get_decoder(), shard).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, shard.predict_index)
    return hidden, shard.target_ids, shard.gather


def compute_layout_logprobs(
    model: HFModel,
    layout: SequenceLayout,
    temperature: float,
    chunk: int,
    with_entropy: bool,
    entropy_grad: bool = False,
    sp: SequenceParallel | None = None,
    extra_ids: torch.Tensor | None = None,
) -> TokenLogprobs:
    """[N] log-probs (and entropy) of a causal LM's selected tokens from its final hidden
    states: ``chunk`` tokens through the LM head at a time (0: all at once), all inside the
    root module's forward. Works on a plain HF model as well as on an FSDP2 root. Under
    sequence parallelism each rank of the group projects its own tokens only.
    ``extra_ids`` [N, K]: also the log-probs of these ids at each selected token's position
    (``extra``; the same projection, not sharded by sequence parallelism)."""
    if extra_ids is not None and sp is not None:
        raise NotImplementedError("extra ids under sequence parallelism")

    def forward() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        hidden, targets, gather = compute_own_hidden(model, layout, sp)
        if extra_ids is not None:
            targets = torch.cat([targets.unsqueeze(-1), extra_ids.to(targets.device)], -1)
        head = model.get_output_embeddings().weight
        out = compute_token_logprobs(
            hidden, head, targets, temperature, chunk, with_entropy, entropy_grad
        )
        entropy = None if out.entropy is None else gather(out.entropy)
        if extra_ids is None:
            return gather(out.logprobs), entropy, None
        return out.logprobs[:, 0], entropy, out.logprobs[:, 1:]

    logprobs, entropy, extra = run_as_root_forward(model, forward)
    return TokenLogprobs(logprobs, entropy, extra)


def run_sharded_forward(model: nn.Module, shard: ShardedLayout) -> Any:
    """The model called on this rank's slice; the Ulysses attention reads ``sequence_shard``."""
    return model(
        input_ids=shard.input_ids,
        attention_mask=shard.attention_mask,
        position_ids=shard.position_ids,
        use_cache=False,
        sequence_shard=shard.shard,
    )


def compute_layout_values(
    model: HFModel, layout: SequenceLayout, sp: SequenceParallel | None = None
) -> torch.Tensor:
    """[N] value-head outputs (a token classifier with one label) at the positions that
    predict the selected tokens."""
    if sp is not None:
        shard = shard_layout(layout, sp)
        logits: torch.Tensor = run_sharded_forward(model, shard).logits
        own = logits.reshape(-1, logits.shape[-1]).index_select(0, shard.predict_index)
        return shard.gather(own[:, 0].float())
    # use_cache=False: with a cache, transformers does not look for packed sequences.
    out = model(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask,
        position_ids=layout.position_ids,
        use_cache=False,
        **compute_varlen_kwargs(model, layout),
    )
    logits = out.logits
    return logits.reshape(-1, logits.shape[-1]).index_select(0, layout.predict_index)[:, 0].float()
