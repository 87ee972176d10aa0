"""The sync check in bfloat16, the dtype users run (issue 45): the trainer (FSDP2) and a real
in-process vLLM engine on ``tiny-moe:0`` in bf16, driven step by step as the loop drives them.
The check calibrates on the version-0 step, honest syncs never stop it, and one lost sync,
two swapped experts and one zeroed projection each stop it at the step of that sync: the
receiver's probe at the sync, and the tokens sampled after it.

Skipped, with the reason printed, on a CPU without bf16 instructions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlframe.core.train_batch import POLICY_UPDATE
from rlframe.loop.step_metrics import compute_logprob_diffs
from rlframe.loop.sync_check import SyncCheck
from tests.plugins.corrupt_experts import corrupt_stream
from tests.ray.factories import prompts_for, tiny_config
from tests.rows_grid import generate_batch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ZEROED = "model.layers.1.self_attn.k_proj.weight"
"""The projection a corrupted sync zeroes (the keys of the last layer: attention turns
uniform there, a subtler fault than a zeroed output projection)."""
WIDTH = 8


def has_bf16_cpu() -> bool:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(flag in flags.split() for flag in BF16_FLAGS)


if not has_bf16_cpu():
    print("test_sync_check_bf16: skipped, this CPU has no avx512_bf16 / amx_bf16")
pytestmark = pytest.mark.skipif(
    not has_bf16_cpu(), reason="this CPU has no bf16 instructions (avx512_bf16 / amx_bf16)"
)


@pytest.fixture(scope="module")
def roles(one_rank_group: None) -> Iterator[tuple[object, object, SyncCheck]]:
    from rlframe.data.tiny_model import resolve_model_path
    from workers.roles.rollout_role import RolloutRole
    from workers.roles.train_role import TrainRole

    cfg = tiny_config(
        1,
        model={"path": "tiny-moe:0", "dtype": "bfloat16"},
        data={"batch_size": 8, "max_prompt_length": 16},
        rollout={"n": 8, "max_tokens": WIDTH, "cpu_kv_cache_gb": 1},
        actor={"lr": 5e-4, "mini_batch_size": 64, "micro_batch_size": 64},
    )
    path = resolve_model_path("tiny-moe:0")
    yield (
        TrainRole(cfg, path, "cpu", 1),
        RolloutRole(cfg, path, "cpu", 0),
        SyncCheck.for_run(cfg, "cpu"),
    )


def sample_and_score(train, rollout, seed: int) -> tuple[dict[str, float], object]:
    """A step's experience: the engine samples 64 rows, the trainer scores them."""
    batch = POLICY_UPDATE.build(generate_batch(rollout.generate, prompts_for(seed, n=8), WIDTH))
    old = train.compute_logprobs(batch)
    metrics = compute_logprob_diffs(batch.rollout_logprobs, old, batch.loss_mask, None, None)
    return metrics, replace(batch, old_logprobs=old)


def corrupt(weights, kind: str | None, version: int, rollout):
    if kind == "lost":  # the version is claimed, the weights stay old
        for _ in weights:
            pass
        rollout.weights_version = version
        return
    if kind == "swap":
        weights = corrupt_stream(weights, "swap")
    elif kind == "zero":
        weights = ((n, torch.zeros_like(t) if n == ZEROED else t) for n, t in weights)
    rollout.load_weights(weights, version)


def test_bf16_honest_syncs_pass_and_each_corruption_stops(roles) -> None:
    train, rollout, check = roles
    assert check.threshold is not None
    probe = train.compute_sync_probe()
    rollout.check_sync(probe)  # version 0: the probe's noise
    metrics, batch = sample_and_score(train, rollout, 0)
    assert check.judge(1, metrics, 0, []) is None
    print(f"bf16 honest gap at version 0: {metrics}, limits {check.limits()}")
    print(
        f"probe tolerances: token {rollout.probe_tolerance:.3g}, mean {rollout.mean_tolerance:.3g}"
    )
    assert check.honest is not None and check.honest < 5e-3
    stopped: dict[str, list[str]] = {}
    for step, kind in enumerate([None, None, "lost", None, "swap", None, "zero", None], start=2):
        mask = batch.response_mask
        adv = torch.linspace(-1, 1, len(batch))[:, None] * mask
        train.update(replace(batch, advantages=adv))
        version = train.publish_weights()
        good = [(n, t.clone()) for n, t in train.weight_source().iter_tensors()]
        corrupt(iter(good), kind, version, rollout)
        verdict = rollout.check_sync(train.compute_sync_probe())
        at_sync: dict[str, float] = {}
        probe_error = check.judge(step, at_sync, version - 1, [verdict.__dict__])
        # The next step's tokens, sampled with the synced weights, scored with the trainer's.
        metrics, batch = sample_and_score(train, rollout, step)
        token_error = check.judge(step + 1, metrics, version, [])
        print(
            f"sync {version} ({kind or 'honest'}): probe {at_sync['rollout/sync_check']:.3g}"
            f" x its tolerance{' (stale)' if verdict.error and 'stale' in verdict.error else ''},"
            f" token mean {metrics['rollout/logprob_diff']:.3g}, largest row"
            f" {metrics['rollout/logprob_diff_row_max']:.3g}, sync_check"
            f" {metrics['rollout/sync_check']:.3g}"
        )
        errors = [str(e) for e in (probe_error, token_error) if e is not None]
        if kind is None:
            assert not errors, errors
            continue
        stopped[kind] = errors
        # The probe stops the run at the sync's own step. The tokens sampled after it see
        # a lost sync and a zeroed projection too (over 10x their threshold); two swapped
        # experts of 8 lift their mean only to about 1.1x it (0.0058 here).
        assert probe_error is not None, (kind, metrics)
        if kind != "swap":
            assert token_error is not None and metrics["rollout/sync_check"] > 10, metrics
        rollout.load_weights(iter(good), version)  # the honest sync of the same version
        rollout.check_sync(train.compute_sync_probe())
        metrics, batch = sample_and_score(train, rollout, 100 + step)
    assert stopped.keys() == {"lost", "swap", "zero"}
