"""The routers' terms of an MoE policy on two real gloo ranks, with the experts whole on each
rank (EP 1) and split over the two (EP 2), against one rank (``tiny-moe:0``, fp32).

- The load-balancing loss (``algorithm.router_aux_loss_coef``) is the micro-step's over every
  rank's tokens: its gradient and its reported value equal one rank's that runs the union of
  the ranks' micro-batches as one micro-batch (measured: 10.8 and 2.2 ulps). Computed per
  rank, as before, the gradient came out at a ratio of 1.55 (cosine 0.59) to one rank's, the
  loss 1.038 and 1.142 for one rank's 1.034 and 1.068.
- Routing replay (``algorithm.router_replay=rollout``) under expert parallelism: the routers
  send each token to the recorded experts (random ones here, far from the routers' own), the
  tokens reach the ranks that hold those experts, and the gradient at EP 2 equals EP 1's
  (measured: 6.0 ulps).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from rlframe.data.tiny_model import resolve_model_path
from tests.workers.cases import assert_same_gradient
from tests.workers.layout_cases import free_port
from tests.workers.rank_grads import run_rank
from tests.workers.router_loss_cases import (
    compute_router_loss_case,
    compute_single_rank_router_loss,
)

GRADIENT_ULPS = 64
"""fp32 ulps of a parameter's largest gradient element, for sums taken in another order (the
ranks' statistics added by an all-reduce, the experts' outputs by the all-to-all's backward)."""


def compare_gradients(got: dict, want: dict, what: str) -> float:
    """Every parameter's gradient within GRADIENT_ULPS; returns the largest gap in ulps."""
    assert got.keys() == want.keys()
    worst = 0.0
    for name, expected in want.items():
        actual = got[name]
        scale = float(expected.abs().max())
        if scale == 0:  # a parameter the loss does not reach (the last layer's experts)
            assert not actual.any(), f"{what}: {name}"
            continue
        worst = max(worst, float((actual - expected).abs().max()) / scale / torch.finfo().eps)
        assert_same_gradient(actual, expected, ulps=GRADIENT_ULPS)
    return worst


@pytest.mark.matrix
def test_router_terms_over_ranks_equal_one_ranks(tmp_path) -> None:
    moe = resolve_model_path("tiny-moe:0", cache_dir=tmp_path / "models")
    cases = [
        {"ep": 1, "micro": 2, "packed": True},
        {"ep": 2, "micro": 2, "packed": False},
        {"ep": 1, "micro": 2, "packed": True, "replay": True},
        {"ep": 2, "micro": 2, "packed": True, "replay": True},
    ]
    out = tmp_path / "out.pt"
    mp.start_processes(
        run_rank,
        args=(2, free_port(), moe, cases, str(out), compute_router_loss_case),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    results = torch.load(out)
    for case, got in zip(cases[:2], results[:2]):
        want, losses, routing = compute_single_rank_router_loss(moe, got["steps"], case["packed"])
        assert any(float(g.abs().max()) > 1e-3 for g in want.values())
        flat_got = torch.cat([got["grads"][k].reshape(-1) for k in want]).double()
        flat_want = torch.cat([g.reshape(-1) for g in want.values()]).double()
        cosine = float(torch.nn.functional.cosine_similarity(flat_got, flat_want, dim=0))
        ratio = float(flat_got.norm() / flat_want.norm())
        print(f"{case}: gradient ratio {ratio:.6f}, cosine {cosine:.8f}; loss {got['aux']}")
        worst = compare_gradients(got["grads"], want, str(case))
        assert got["aux"] == pytest.approx(losses, rel=1e-6), case
        assert got["routing"].keys() == routing.keys() and len(routing) == 6
        for key, values in routing.items():
            assert got["routing"][key] == pytest.approx(values, rel=1e-6), (case, key)
        print(f"{case}: load-balancing gradient vs one rank {worst:.1f} ulps, loss {losses}")
    ep1, ep2 = results[2:]
    assert ep1["replayed_exactly"] and ep2["replayed_exactly"]
    worst = compare_gradients(ep2["grads"], ep1["grads"], "replay")
    print(f"routing replay, EP 2 vs EP 1: {worst:.1f} ulps")
