"""The sequence layout of training forwards: padded rows or packed rows, token-budget
micro-batches, and the driver's balancing of rows across data-parallel ranks.

Pure tensor code (no process groups, no model): the training engine turns a
:class:`SequenceLayout` into one forward, and the workers use the planners to cut their
share of a mini-batch. Two masks are read, one per meaning: ``response_mask`` says which
response tokens exist (and are attended to), ``loss_mask`` which of them the policy sampled
and so need a log-prob; a tool observation inside a response has 1 in the first and 0 in
the second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlframe.core.mrope import ImageTokens, compute_mrope_positions
from rlframe.core.protocol import Batch
from rlframe.core.train_batch import TrainBatch


@dataclass
class RowImages:
    """The images of a micro-batch's rows, encoded for the vision tower (rows in order)."""

    pixel_values: torch.Tensor
    """[patches, C * T * P * P] every image's patches."""
    grid_thw: torch.Tensor
    """[images, 3] each image's (time, height, width) patch grid."""
    per_row: list[int]
    """How many of the images each row holds."""
    tokens: ImageTokens
    """The model's image token and patch merge."""

    def row_grids(self) -> list[torch.Tensor]:
        """Each row's [images, 3] grids."""
        return list(self.grid_thw.split(self.per_row))


@dataclass
class SequenceLayout:
    """Model inputs for prompt + response rows, and where the wanted predictions sit.

    ``N`` below is the number of selected (loss-mask) response tokens.
    """

    input_ids: torch.Tensor
    """[b, L] token ids: b = rows when padded, b = 1 when packed."""
    position_ids: torch.Tensor
    """[b, L] positions, restarting at 0 for every packed sequence. With images, mrope's
    [3, b, L] (padded) or [4, 1, L] (packed: the text positions that delimit the packed
    sequences, then the three mrope rows)."""
    attention_mask: torch.Tensor | None
    """[b, L] 1 on real tokens when padded; None when packed, so that transformers derives a
    block-diagonal causal mask from the restarting position ids."""
    predict_index: torch.Tensor
    """[N] index into the flattened [b * L] positions of the one that predicts each selected
    token."""
    target_ids: torch.Tensor
    """[N] the selected response tokens."""
    grid_index: torch.Tensor
    """[N] index of each selected token into the flattened [B, R] response grid."""
    grid_shape: tuple[int, int]
    """(B, R): rows and response width of the micro-batch."""
    routed_experts: torch.Tensor | None = None
    """[b, L, MoE layers, top_k] the experts each input token is to be routed to (-1: the
    model's own choice), laid out like ``input_ids``; None without router replay."""
    pixel_values: torch.Tensor | None = None
    """[patches, D] the rows' images for the vision tower; None without images."""
    image_grid_thw: torch.Tensor | None = None
    """[images, 3] the patch grid of each image in ``pixel_values``."""
    placeholder_ids: torch.Tensor | None = None
    """With images: ``input_ids`` with -1 for each image token in a response (sampled, so
    text to the engine: its own embedding and a text position); what the model's
    image-placeholder mask reads."""

    def flat_routed_experts(self) -> torch.Tensor | None:
        """[b * L, MoE layers, top_k]: the tokens in the order the model's routers see them."""
        if self.routed_experts is None:
            return None
        return self.routed_experts.flatten(0, 1)

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """[N, ...] per selected token -> [B, R, ...] with 0 elsewhere (differentiable)."""
        rows, width = self.grid_shape
        grid = values.new_zeros(rows * width, *values.shape[1:])
        return grid.index_put((self.grid_index,), values).view(rows, width, *values.shape[1:])

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """[B, R, ...] on the response grid -> [N, ...] at the selected tokens, in order."""
        return grid.flatten(0, 1).index_select(0, self.grid_index.to(grid.device))

    def to(self, device: str | torch.device) -> SequenceLayout:
        def move(optional: torch.Tensor | None) -> torch.Tensor | None:
            return None if optional is None else optional.to(device)

        return SequenceLayout(
            self.input_ids.to(device),
            self.position_ids.to(device),
            move(self.attention_mask),
            self.predict_index.to(device),
            self.target_ids.to(device),
            self.grid_index.to(device),
            self.grid_shape,
            move(self.routed_experts),
            move(self.pixel_values),
            move(self.image_grid_thw),
            move(self.placeholder_ids),
        )


def select_tokens(rows: TrainBatch) -> torch.Tensor:
    """[B, R] bool: response tokens that need a prediction (sampled by the policy)."""
    return rows.response_mask.bool() & rows.loss_mask.bool()


def build_padded_layout(rows: TrainBatch, images: RowImages | None = None) -> SequenceLayout:
    """One row per response: prompts left-padded, responses right-padded, positions counted
    over real tokens (mrope's with ``images``), an attention mask hiding the padding."""
    prompt_ids, response_ids = rows.prompt_ids, rows.response_ids
    rows_count, prompt_width = prompt_ids.shape
    width = response_ids.shape[1]
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([rows.prompt_mask, rows.response_mask], dim=1).long()
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    placeholders = None
    if images is not None:
        placeholders = mark_placeholders(rows, images.tokens)
        position_ids = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        for i, grids in enumerate(images.row_grids()):
            real = attention_mask[i].bool()
            position_ids[:, i, real] = compute_mrope_positions(
                placeholders[i][real], grids, images.tokens
            )
    row, col = select_tokens(rows).nonzero(as_tuple=True)
    # Position t predicts token t + 1: the last prompt position predicts the first response token.
    predict_index = row * (prompt_width + width) + prompt_width + col - 1
    return SequenceLayout(
        input_ids,
        position_ids,
        attention_mask,
        predict_index,
        response_ids[row, col],
        row * width + col,
        (rows_count, width),
        rows.routed_experts,
        *attach_images(images),
        placeholders,
    )


def attach_images(images: RowImages | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layout's (pixel values, image grids): None without images."""
    if images is None or not images.grid_thw.numel():
        return None, None
    return images.pixel_values, images.grid_thw


def mark_placeholders(rows: TrainBatch, tokens: ImageTokens) -> torch.Tensor:
    """[B, P + R] prompt and response ids with -1 for every image token the policy sampled: it
    stands for no image there (vLLM embeds it as text and gives it a text position). The
    image tokens of an observation inside a response (loss mask 0) stand for its images."""
    sampled = select_tokens(rows) & (rows.response_ids == tokens.image_token_id)
    return torch.cat([rows.prompt_ids, rows.response_ids.masked_fill(sampled, -1)], dim=1)


def build_packed_layout(rows: TrainBatch, images: RowImages | None = None) -> SequenceLayout:
    """All rows' real tokens (prompt, then response) in one sequence of shape [1, T], without
    padding, positions restarting at 0 for each row and no attention mask. With ``images``
    the text positions come first, then each row's mrope positions."""
    prompt_ids, response_ids = rows.prompt_ids, rows.response_ids
    prompt_width = prompt_ids.shape[1]
    rows_count, width = response_ids.shape
    real = torch.cat([rows.prompt_mask, rows.response_mask], dim=1).bool()
    if not bool(rows.prompt_mask.bool().any(1).all()):
        raise ValueError(
            "every row needs at least one prompt token: it predicts the first response token"
        )
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)[real]
    position_ids = (real.long().cumsum(1) - 1)[real][None]
    placeholders = None
    if images is not None:
        marked = mark_placeholders(rows, images.tokens)
        mrope = [
            compute_mrope_positions(marked[i][real[i]], grids, images.tokens)
            for i, grids in enumerate(images.row_grids())
        ]
        position_ids = torch.cat([position_ids, torch.cat(mrope, dim=1)])
        placeholders = marked[real][None]
    # Where each real (row, column) token lands in the packed sequence.
    packed_at = torch.full(real.shape, -1, dtype=torch.long)
    packed_at[real] = torch.arange(int(real.sum()))
    row, col = select_tokens(rows).nonzero(as_tuple=True)
    # A row's tokens are contiguous, so the previous packed token is the same row's previous
    # real token.
    predict_index = packed_at[row, prompt_width + col] - 1
    routing = rows.routed_experts
    return SequenceLayout(
        input_ids[None],
        position_ids[:, None] if images is not None else position_ids,
        None,
        predict_index,
        response_ids[row, col],
        row * width + col,
        (rows_count, width),
        None if routing is None else routing[real][None],
        *attach_images(images),
        placeholders,
    )


def build_layout(rows: TrainBatch, packed: bool, images: RowImages | None = None) -> SequenceLayout:
    """The packed or padded layout of ``rows``; ``images`` (a vision-language model's rows'
    images, encoded) adds the vision inputs and mrope positions."""
    return build_packed_layout(rows, images) if packed else build_padded_layout(rows, images)


def count_row_tokens(
    prompt_mask: torch.Tensor, response_mask: torch.Tensor, packed: bool
) -> torch.Tensor:
    """[B] tokens each row of these masks costs in a forward: its real tokens when packed,
    the padded width otherwise."""
    if packed:
        return (prompt_mask.sum(1) + response_mask.sum(1)).long()
    width = prompt_mask.shape[1] + response_mask.shape[1]
    return torch.full((len(prompt_mask),), width, dtype=torch.long)


def plan_micro_batches(costs: list[int], budget: int, min_count: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch: rows filled longest first into the first micro-batch
    with room under ``budget`` tokens (a row above the budget goes alone), then the fullest
    micro-batches halved until there are at least ``min_count`` of them (every rank of an
    FSDP group must run the same number of forwards). Rows keep their order inside a
    micro-batch; there are never more micro-batches than rows.
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + costs[i] <= budget:
                bins[b].append(i)
                loads[b] += costs[i]
                break
        else:
            bins.append([i])
            loads.append(costs[i])
    while len(bins) < min(min_count, len(costs)):
        b = max((b for b in range(len(bins)) if len(bins[b]) > 1), key=lambda b: loads[b])
        halves = split_in_two(bins[b], costs)
        bins[b : b + 1] = halves
        loads[b : b + 1] = [sum(costs[i] for i in h) for h in halves]
    return [sorted(b) for b in bins]


def split_in_two(rows: list[int], costs: list[int]) -> list[list[int]]:
    """Two non-empty parts of about equal tokens (longest first, each to the lighter part)."""
    parts: list[list[int]] = [[], []]
    loads = [0, 0]
    for i in sorted(rows, key=lambda i: -costs[i]):
        k = 0 if not parts[0] else 1 if not parts[1] else int(loads[1] < loads[0])
        parts[k].append(i)
        loads[k] += costs[i]
    return parts


def balance_ranks(costs: torch.Tensor, world_size: int, mini_batch_size: int) -> torch.Tensor:
    """A row order that gives every data-parallel rank about the same tokens.

    Rows stay in their mini-batch (``mini_batch_size`` consecutive rows) and every rank gets
    the same number of rows of each (longest first, each to the lightest rank with room).
    In the returned order, rank r's rows of every mini-batch follow each other in mini-batch
    order, so that a consecutive split into ``world_size`` parts (DP_SPLIT), then into
    mini-batches of ``mini_batch_size / world_size`` rows, finds each rank's share.
    """
    rows = len(costs)
    if rows % mini_batch_size or mini_batch_size % world_size:
        raise ValueError(
            f"{rows} rows do not split into mini-batches of {mini_batch_size} "
            f"over {world_size} ranks"
        )
    per_rank = mini_batch_size // world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for start in range(0, rows, mini_batch_size):
        parts: list[list[int]] = [[] for _ in range(world_size)]
        loads = [0] * world_size
        block = range(start, start + mini_batch_size)
        for i in sorted(block, key=lambda i: -int(costs[i])):
            r = min(
                (r for r in range(world_size) if len(parts[r]) < per_rank), key=lambda r: loads[r]
            )
            parts[r].append(i)
            loads[r] += int(costs[i])
        for r in range(world_size):
            shares[r] += sorted(parts[r])
    return torch.tensor([i for share in shares for i in share], dtype=torch.long)


def balance_rows(batch: Batch, world_size: int, mini_batch_size: int) -> torch.Tensor:
    """The row order of :func:`balance_ranks` for an update's batch, rows costed in real
    tokens whether or not the workers pack them (identity on one rank)."""
    if world_size == 1:
        return torch.arange(len(batch))
    costs = count_row_tokens(batch.tensor("prompt_mask"), batch.tensor("response_mask"), True)
    return balance_ranks(costs, world_size, mini_batch_size)
