"""Ulysses sequence parallelism on two real gloo ranks (CPU, fp32): a group of two ranks
sharing every sequence gives what two data-parallel ranks give: the token log-probs, a value
model's values, the gradient, the update metrics (entropy and KL included), the gradient each
of two optimizer steps applied and the optimizer state after them; packed or padded, with chunked
log-probs, token budgets, gradient checkpointing and LoRA. The tiny model has 2 query heads
and 1 key/value head, so each rank of the group gets one query head and a repeat of the
key/value head; a model with 4 query and 2 key/value heads gives each rank its own."""

from __future__ import annotations

import pytest
import torch

from rlframe.data.tiny_model import TinyModelSpec, build_tiny_model, resolve_model_path
from tests.workers.rank_grads import run_two_ranks
from tests.workers.router_loss_cases import (
    compute_router_loss_case,
    compute_single_rank_router_loss,
)
from tests.workers.sequence_parallel_cases import compute_sequence_parallel_case

CASES = [
    {"micro": 2, "packed": False, "chunk": 3, "loss_agg": "seq-mean-token-mean", "values": True},
    # A budget counts a rank's share: the group's micro-batches hold twice the tokens.
    {"budget": 15, "packed": True, "chunk": 4, "checkpointing": True},
    {"micro": 4, "packed": True, "lora_rank": 4, "loss_agg": "seq-mean-token-sum", "model": "kv2"},
    # One packed row per micro-batch (the long-sequence case), half of them of odd length: the
    # last rank's padded tail once restarted its positions and sdpa got a slice-sized mask.
    {"micro": 1, "packed": True},
]


def test_sequence_parallel_matches_data_parallel(model_path: str, tmp_path) -> None:
    # 4 query heads over 2 key/value heads: each rank gets its own key/value head, no repeat.
    kv2 = tmp_path / "kv2"
    build_tiny_model(TinyModelSpec(num_heads=4, num_kv_heads=2), kv2)
    cases = [{**case, "model": str(kv2)} if case.get("model") == "kv2" else case for case in CASES]
    runs = [{**case, "sp": sp} for case in cases for sp in (1, 2)]
    results = run_two_ranks(
        model_path, runs, str(tmp_path / "out.pt"), compute_sequence_parallel_case
    )
    for case, want, got in zip(cases, results[::2], results[1::2]):
        msg = lambda m, case=case: f"{case}: {m}"  # noqa: E731
        assert bool((want["logprobs"] < 0).sum() > 50)
        torch.testing.assert_close(got["logprobs"], want["logprobs"], atol=1e-5, rtol=1e-5, msg=msg)
        if "values" in want:  # the critic's forward
            assert want["values"].abs().max() > 1e-2
            torch.testing.assert_close(got["values"], want["values"], atol=1e-5, rtol=1e-5)
        assert want["grads"].abs().max() > 1e-3
        torch.testing.assert_close(got["grads"], want["grads"], atol=1e-5, rtol=1e-5, msg=msg)
        assert set(got["metrics"]) == set(want["metrics"])
        # Metrics are means over micro-batches: equal where both cut the rows alike.
        keys = ["actor/grad_norm"] if "budget" in case else want["metrics"]
        for key in keys:
            value = want["metrics"][key]
            assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, key)
        assert bool((got["step"] == 2).all() and (want["step"] == 2).all())
        # What each of the update's two optimizer steps applied, and Adam's moments (sqrt of
        # the second: gradient units), as tight as the gradient. Not the weights after the
        # steps: Adam moves a weight by about lr whatever its gradient's size, so weights of
        # near-zero gradients differ by up to 2 lr where the rounding differs (another CPU).
        for step in range(2):
            torch.testing.assert_close(
                got["step_grads"][step], want["step_grads"][step], atol=1e-5, rtol=1e-5, msg=msg
            )
        torch.testing.assert_close(got["exp_avg"], want["exp_avg"], atol=1e-6, rtol=1e-5, msg=msg)
        torch.testing.assert_close(
            got["exp_avg_sq"].sqrt(), want["exp_avg_sq"].sqrt(), atol=1e-6, rtol=1e-5, msg=msg
        )


# Two two-rank MoE engines, about a minute on 2 shared cores: a cross product (SP x MoE x the
# router loss), so it runs in the matrix tier.
@pytest.mark.matrix
def test_router_aux_loss_matches_one_rank(tmp_path) -> None:
    """An MoE model's load-balancing loss under S=2 is the micro-batch's, padding left out:
    its gradient (the only one: zero advantages), its value and the expert-load metrics equal
    one rank's on the same micro-batches. Summed per slice, padding in, it came out 2.2x
    (cosine 0.87) packed and 0.77x (cosine 0.27) padded against data parallelism."""
    moe = resolve_model_path("tiny-moe:0", cache_dir=tmp_path / "models")
    # Packed rows two per micro-batch, and one padded row per micro-batch (left-padded
    # prompts; odd lengths give the last rank a padded tail).
    cases = [{"micro": 2, "packed": True}, {"micro": 1, "packed": False}]
    runs = [{**case, "sp": 2} for case in cases]
    results = run_two_ranks(moe, runs, str(tmp_path / "out.pt"), compute_router_loss_case)
    for case, got in zip(cases, results):
        want, losses, routing = compute_single_rank_router_loss(moe, got["steps"], case["packed"])
        flat_got = torch.cat([got["grads"][k].reshape(-1) for k in want]).double()
        flat_want = torch.cat([g.reshape(-1) for g in want.values()]).double()
        cosine = torch.nn.functional.cosine_similarity(flat_got, flat_want, dim=0)
        ratio = flat_got.norm() / flat_want.norm()
        print(f"{case}: gradient ratio {float(ratio):.6f}, cosine {float(cosine):.8f}")
        assert flat_want.abs().max() > 1e-2
        torch.testing.assert_close(flat_got, flat_want, atol=1e-6, rtol=1e-5)
        assert got["aux"] == pytest.approx(losses, rel=1e-6), case
        assert got["routing"].keys() == routing.keys() and len(routing) == 6
        for key, values in routing.items():
            assert got["routing"][key] == pytest.approx(values, rel=1e-6), (case, key)
