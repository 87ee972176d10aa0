"""What routed experts cost on the driver, per token: from the engine's answer to the grid.

Router replay (``algorithm.router_replay=rollout``) brings, per row, the experts the engine
routed every fed token to: an int16 ``[prompt + response - 1, MoE layers, top_k]`` tensor.
On the driver that tensor is filed on the row (:func:`rlframe.rollout.rows.add_turns`) and
laid out into the training grid's ``routed_experts`` ``[rows, P + R, layers, k]``
(:func:`rlframe.rollout.rows.collate`). The bench times those two steps over ``--rows`` rows
of ``--prompt`` + ``--response`` tokens and prints the cost per token, and what it would be
for a step of 512 rows x 8k tokens (issue 45, desk item 7: 24 us per token, ~100 s a step,
when each token's routing was a tensor of its own).

It also times the design before, each token's routing a tensor of its own on the row and
stacked token by token into the grid, interleaved with the current one so that both see the
same load. Measured with the code before this change, whole collate included, defaults but
``--rows 16``: 34.2 us per token at load 4.7 (50.0 at load 9.5), 143 s for the issue's step.

    python bench/routed_experts_rows.py [--rows 32] [--prompt 512] [--response 1536]
        [--layers 48] [--top-k 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
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


def time_per_token_tensors(prompts: list[list[int]], out: Batch, response: int) -> float:
    """Seconds the design before took for the routing alone: each token's routing a tensor of
    its own on the row (prompt tokens, response tokens, None for the last), laid into the grid
    token by token (``torch.as_tensor`` and a stack per row)."""
    started = time.perf_counter()
    kept = []
    for prompt, routing in zip(prompts, out.column(ROUTED_EXPERTS)):
        kept.append((list(routing[: len(prompt)]), [*list(routing[len(prompt) :]), None]))
    width = len(prompts[0]) + response
    known = [torch.as_tensor(v) for p, r in kept for v in [*p, *r] if v is not None]
    grid = torch.full((len(kept), width, *known[0].shape), -1, dtype=known[0].dtype)
    for i, (prompt_part, response_part) in enumerate(kept):
        values = [*prompt_part, *response_part]
        at = [j for j, v in enumerate(values) if v is not None]
        grid[i, torch.tensor(at)] = torch.stack([torch.as_tensor(values[j]) for j in at])
    return time.perf_counter() - started


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
    runs, before = [], []
    for _ in range(a.repeats):  # interleaved: the machine's load changes alike for both
        runs.append(time_once(prompts, out, a.response))
        before.append(time_per_token_tensors(prompts, out, a.response))
    file_s = min(r[0] for r in runs)
    collate_s = min(r[1] for r in runs)
    plain_s = min(r[2] for r in runs)
    per_token_us = (file_s + collate_s - plain_s) / tokens * 1e6
    before_us = min(before) / tokens * 1e6
    print(
        f"routed experts on the driver: {a.rows} rows x {a.prompt}+{a.response} tokens, "
        f"{a.layers} layers x top-{a.top_k} (load {os.getloadavg()[0]:.1f})"
    )
    print(
        f"  file on rows: {file_s:.3f} s   collate: {collate_s:.3f} s   collate without "
        f"routing: {plain_s:.3f} s   (best of {a.repeats}: the machine is shared)"
    )
    print(
        f"  routing per token, one array per row (file + collate - collate without): "
        f"{per_token_us:.3f} us; a step of 512 rows x 8k tokens: "
        f"{per_token_us * STEP_TOKENS / 1e6:.1f} s"
    )
    print(
        f"  routing per token, a tensor per token (the design before): {before_us:.3f} us; "
        f"a step of 512 rows x 8k tokens: {before_us * STEP_TOKENS / 1e6:.1f} s"
    )


if __name__ == "__main__":
    main()
