"""Routed experts: the replay hooks on a real transformers MoE block, the per-token batch key
(placement, padding, agreement) and the checks of ``algorithm.router_replay``."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlframe.config import ActorConfig, Config, ConfigError, DataConfig, ModelConfig, RolloutConfig
from rlframe.config.algorithm import AlgorithmConfig, check_router_replay_setup
from rlframe.core.names import RouterReplay
from rlframe.core.protocol import ROUTED_EXPERTS, Batch, as_column
from rlframe.data.tiny_model import resolve_model_path
from rlframe.models.hf_config import read_model_config
from rlframe.models.moe_routing import (
    check_router_replay,
    compute_routing_agreement,
)
from rlframe.rollout.rows import TokenRow, add_turns, build_response, collate
from rlframe.rollout.sampling import concat_groups
from tests.unit.cli_errors import check_config_error

TOKENS, HIDDEN, EXPERTS, TOP_K = 12, 32, 8, 2


def build_moe_block(norm_topk_prob: bool):  # -> Qwen3MoeSparseMoeBlock
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
    return block


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_replaying_its_own_routing_changes_nothing(norm_topk_prob: bool) -> None:
    from workers.model_hooks.router_replay import RouterReplay, RoutingRecorder

    block = build_moe_block(norm_topk_prob)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    recorder = RoutingRecorder(block)
    native = block(x)
    routing = recorder.take()
    recorder.remove()
    assert routing.shape == (TOKENS, 1, TOP_K) and routing.dtype == torch.int16
    replay = RouterReplay(block)
    with replay.replaying(routing):
        replayed = block(x)
    # The recomputed weights of the same experts are the router's own, bit for bit.
    assert torch.equal(replayed, native)
    assert replay.take_agreement() == 1.0
    assert replay.take_agreement() is None  # taken: the count starts again


def test_replay_routes_to_the_given_experts_and_the_router_learns() -> None:
    from workers.model_hooks.router_replay import RouterReplay, RoutingRecorder

    block = build_moe_block(norm_topk_prob=True)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    recorder = RoutingRecorder(block)
    native_out = block(x).detach()
    native = recorder.take()
    # Other experts for every token but the last, which is unrecorded (-1): its own choice.
    target = ((native.long() + 3) % EXPERTS).to(torch.int16)
    target[-1] = -1
    recorder.remove()
    replay = RouterReplay(block)
    used = RoutingRecorder(block)  # registered after the replay: records what it routed
    with replay.replaying(target):
        out = block(x)
    routed = used.take()
    assert torch.equal(routed[:-1], target[:-1]) and torch.equal(routed[-1], native[-1])
    # Each expert sums its tokens in another order now: equal to rounding.
    torch.testing.assert_close(out[0, -1], native_out[0, -1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(out[0, :-1], native_out[0, :-1])
    assert replay.take_agreement() == 0.0  # none of the recorded tokens agreed
    out.square().sum().backward()
    assert float(block.gate.weight.grad.abs().sum()) > 0
    # Outside the block the router chooses again.
    assert torch.equal(block(x).detach(), native_out)


def test_replay_hooks_never_wait_for_the_device() -> None:
    """The replay hook of every MoE layer runs without a host wait: no value read, no
    boolean-mask index, no copy of the host's int16 routing (on a GPU each stalls the queue,
    per layer and again in a checkpointed backward). The routing is checked and moved once per
    ``replaying`` block and the agreement read once by ``take_agreement``. Before: 3 waits and
    a host copy per layer."""
    from tests.host_syncs import HostSyncCounter, counting_in_hooks
    from workers.model_hooks.router_replay import RouterReplay, RoutingRecorder

    block = build_moe_block(norm_topk_prob=True)
    x = torch.randn(1, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    recorder = RoutingRecorder(block)
    block(x)
    target = recorder.take()
    recorder.remove()
    target[::3] = -1  # some unrecorded tokens
    replay = RouterReplay(block)
    with counting_in_hooks(replay.routers, copies_of=torch.int16) as in_hooks:
        with HostSyncCounter(copies_of=torch.int16) as per_block, replay.replaying(target):
            block(x)
            block(x)  # as a checkpointed backward re-runs the layer
        with HostSyncCounter() as reading:
            agreement = replay.take_agreement()
    print(f"host waits in the hooks {dict(in_hooks.counts)}; per block {dict(per_block.counts)}")
    assert in_hooks.total == 0, in_hooks.counts
    assert per_block.counts["host_copy"] == 1  # the routing, once
    assert reading.total == 1 and agreement == 1.0


def test_routing_crosses_the_wire_into_the_grid_aligned_with_prompt_and_response() -> None:
    # Row 0: prompt of 2 (left-padded to 3), response of 3 -> 2 + 3 - 1 = 4 routed tokens.
    # Row 1: prompt of 3, response of 1 -> 3 routed tokens.
    rows = [TokenRow([5, 6]), TokenRow([7, 8, 9])]
    out = build_response([([11, 12, 13], [-0.1] * 3, "length"), ([21], [-0.2], "stop")], 0)
    out.columns[ROUTED_EXPERTS] = as_column(
        [
            torch.arange(8, dtype=torch.int16).view(4, 1, 2),
            torch.arange(10, 16, dtype=torch.int16).view(3, 1, 2),
        ]
    )
    add_turns(rows, out)
    # One array per row, kept as the engine sent it: never a tensor per token (issue 45,
    # desk item 7: 24 us a token on the driver; bench/routed_experts_rows.py).
    assert all(r.routed_experts is x for r, x in zip(rows, out.column(ROUTED_EXPERTS)))
    grid = collate(rows, Batch(columns={"seed": [0, 0]}), width=4, pad_id=0)
    routing = grid[ROUTED_EXPERTS]
    assert routing.shape == (2, 7, 1, 2) and routing.dtype == torch.int16
    # Prompt positions, then response positions; the last response token was never fed.
    assert routing[0, :, 0, 0].tolist() == [-1, 0, 2, 4, 6, -1, -1]
    assert routing[1, :, 0, 0].tolist() == [10, 12, 14, -1, -1, -1, -1]
    # A row's later call would route its earlier response again: not carried.
    with pytest.raises(ValueError, match="continued row"):
        add_turns(rows[1:], out.rows([1]))


def test_routing_agreement_compares_expert_sets_of_recorded_pairs() -> None:
    first = torch.tensor([[[1, 2]], [[3, 4]], [[5, 6]], [[-1, -1]]])
    second = torch.tensor([[[2, 1]], [[3, 5]], [[5, 6]], [[0, 1]]])
    # Order inside a top-k set does not count; the unrecorded pair is left out.
    assert compute_routing_agreement(first, second) == pytest.approx(2 / 3)


def test_concat_groups_pads_routing_with_the_prompts() -> None:
    def group(prompt_width: int) -> Batch:
        routing = torch.zeros(2, prompt_width + 3, 1, 2, dtype=torch.int16)
        return Batch(
            {
                "prompt_ids": torch.ones(2, prompt_width, dtype=torch.long),
                "prompt_mask": torch.ones(2, prompt_width, dtype=torch.long),
                ROUTED_EXPERTS: routing,
            }
        )

    merged = concat_groups([group(2), group(4)])
    assert merged[ROUTED_EXPERTS].shape == (4, 7, 1, 2)
    assert bool((merged[ROUTED_EXPERTS][:2, :2] == -1).all())
    assert bool((merged[ROUTED_EXPERTS][:2, 2:] == 0).all())


def make_config(**rollout: object) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        rollout=RolloutConfig(**{"engine": "hf", "n": 4, **rollout}),
        actor=ActorConfig(mini_batch_size=16, micro_batch_size=16),
        algorithm=AlgorithmConfig(router_replay="rollout"),
    )


def test_router_replay_refuses_a_dense_model(tmp_path: Path) -> None:
    cfg = make_config()
    moe = resolve_model_path("tiny-moe:0", cache_dir=tmp_path)
    check_router_replay(cfg, moe, read_model_config(moe, False))
    with pytest.raises(ConfigError, match="algorithm.router_replay: .*no routed experts"):
        dense = resolve_model_path("tiny:0", cache_dir=tmp_path)
        check_router_replay(cfg, dense, read_model_config(dense, False))


@pytest.mark.parametrize(
    ("rollout", "text"),
    [
        ({"agent": "multi_turn"}, "rollout.agent=multi_turn"),
        ({"max_staleness": 1, "partial_chunk_tokens": 2}, "partial_chunk_tokens=2"),
        ({"engine": "vllm", "top_p": 0.9}, "rollout.top_p=1"),
    ],
)
def test_router_replay_refuses_rows_without_routing(rollout: dict, text: str) -> None:
    with pytest.raises(ConfigError, match=f"algorithm.router_replay: .*{text}"):
        make_config(**rollout)


def test_router_replay_runs_ahead_with_whole_responses() -> None:
    """Asynchronous rows keep their routing (the producer's state included,
    tests/unit/test_producer_state.py) when each response is sampled in one call."""
    assert make_config(max_staleness=1).rollout.max_staleness == 1


def test_router_replay_with_vllm_on_cpu_stops_before_ray() -> None:
    check_config_error(
        "+recipe=grpo_tiny",
        "model.path=tiny-moe:0",
        "algorithm.router_replay=rollout",
        key="algorithm.router_replay",
        text="CUDA only",
    )


@pytest.mark.parametrize("spread", [{"tensor_parallel_size": 2}, {"expert_parallel": True}])
def test_router_replay_refuses_a_vllm_engine_over_several_ranks(spread: dict) -> None:
    """vLLM keeps the captured routing on an engine's first rank; the other ranks' schedulers
    assert at the first token (GPU only), so the setting stops before Ray."""
    rollout = RolloutConfig(engine="vllm", n=4, **{"tensor_parallel_size": 2, **spread})
    with pytest.raises(ConfigError, match="algorithm.router_replay: .*one rank per engine"):
        check_router_replay_setup(RouterReplay.rollout, rollout, 1)
    check_router_replay_setup(RouterReplay.rollout, RolloutConfig(engine="vllm", n=4), 1)
    check_router_replay_setup(RouterReplay.rollout, replace(rollout, engine="hf"), 1)


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_router_replay_refuses_a_model_with_dense_layers(tmp_path: Path, dense: dict) -> None:
    cfg = make_config()
    moe = resolve_model_path("tiny-moe:0", cache_dir=tmp_path)
    config = copy.deepcopy(read_model_config(moe, False))  # the reader's cache stays intact
    check_router_replay(cfg, moe, config)
    for key, value in dense.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match="algorithm.router_replay: .*has dense layers"):
        check_router_replay(cfg, moe, config)
