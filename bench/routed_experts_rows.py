"""What routed experts cost on the driver, per token: from the engine's answer to the grid.

Router replay (``algorithm.router_replay=rollout``) brings, per row, the experts the engine
routed every fed token to: an int16 ``[prompt + response - 1, MoE layers, top_k]`` tensor.
On the driver that tensor is filed on the row (:func:`rlframe.rollout.rows.add_turns`) and
laid out into the training grid's ``routed_experts`` ``[rows, P + R, layers, k]``
(:func:`rlframe.rollout.rows.collate`). The bench times those two steps over ``--rows`` rows
of ``--prompt`` + ``--response`` tokens and prints the cost per token, and what it would be
for a step of 512 rows x 8k tokens (issue 45, desk item 7: 24 us per token, ~100 s a step,
when each token's routing was a tensor of its own).

Before (each token's routing a tensor of its own on the row, stacked token by token into the
grid), with the defaults but ``--rows 16``: 34.2 us per token at load 4.7 (50.0 at load 9.5),
143 s for the issue's step, counting the whole collate. After (one array per row, one copy per
row): see the printout, which counts only what routing adds to the collate.

    python bench/routed_experts_rows.py [--rows 32] [--prompt 512] [--response 1536]
        [--layers 48] [--top-k 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from rlframe.core.protocol import ROUTED_EXPERTS, Batch
from rlframe.rollout.rows import TokenRow, add_turns, build_response, collate

STEP_TOKENS = 512 * 8192
"""Tokens of the issue's step: 512 rows of 8k tokens."""


def build_answer(
    rows: int, prompt: int, response: int, layers: int, k: int
) -> tuple[list[list[int]], Batch]:
    """Prompts, and the engine's answer for them: one sampled turn each, with routing."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (prompt,), generator=g).tolist() for _ in range(rows)]
    turns = [(torch.randint(3, 60, (response,), generator=g).tolist(), [-0.5] * response, "length")]
    out = build_response(turns * rows, version=0)
    fed = prompt + response - 1
    out.columns[ROUTED_EXPERTS] = [
        torch.randint(0, 64, (fed, layers, k), generator=g, dtype=torch.int16) for _ in range(rows)
    ]
    return prompts, out


def time_once(prompts: list[list[int]], out: Batch, response: int) -> tuple[float, float, float]:
    """Seconds to file the answer on fresh rows, to collate them, and to collate the same
    rows without their routing (what the grid costs anyway)."""
    rows = [TokenRow(list(p)) for p in prompts]
    bare = Batch(columns={"seed": [0] * len(rows)})
    started = time.perf_counter()
    add_turns(rows, out)
    filed = time.perf_counter()
    grid = collate(rows, bare, width=response, pad_id=0)
    done = time.perf_counter()
    assert grid[ROUTED_EXPERTS].shape[1] == len(prompts[0]) + response
    for row in rows:
        row.routed_experts = None
    started_plain = time.perf_counter()
    collate(rows, bare, width=response, pad_id=0)
    return filed - started, done - filed, time.perf_counter() - started_plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    a = parser.parse_args()
    prompts, out = build_answer(a.rows, a.prompt, a.response, a.layers, a.top_k)
    tokens = a.rows * (a.prompt + a.response)
    runs = [time_once(prompts, out, a.response) for _ in range(a.repeats)]
    file_s = statistics.median(r[0] for r in runs)
    collate_s = statistics.median(r[1] for r in runs)
    plain_s = statistics.median(r[2] for r in runs)
    per_token_us = (file_s + collate_s - plain_s) / tokens * 1e6
    print(
        f"routed experts on the driver: {a.rows} rows x {a.prompt}+{a.response} tokens, "
        f"{a.layers} layers x top-{a.top_k} (load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"  file on rows: {file_s:.3f} s   collate: {collate_s:.3f} s   collate without "
        f"routing: {plain_s:.3f} s   (median of {a.repeats})"
    )
    print(f"  routing per token (file + collate - collate without): {per_token_us:.3f} us")
    print(f"  a step of 512 rows x 8k tokens: {per_token_us * STEP_TOKENS / 1e6:.1f} s")


if __name__ == "__main__":
    main()
