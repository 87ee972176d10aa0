"""Every mixture-of-experts family that transformers and vLLM both serve syncs through the one
weight mapping (workers/model_hooks/weight_names.py): a tiny random model of the family
(``tiny-moe-<model_type>:0``) on a real hybrid worker (FSDP2 + vLLM CPU), one update that
moves every weight, one sync, and the engine's log-probs of its own samples match the
trainer's to 1e-4, where the engine before the sync was visibly stale.

Mixtral runs in the default tier: its checkpoint renames the MoE block
(``block_sparse_moe.experts.{e}.w1``), the case that stopped at the first sync with a vLLM
error about an unknown module name (20 s quiet, 126 s under load). The other families (1-2 min each
here) run in ``matrix``: 6 passed on 2026-11-29 (gap 4.8e-7 each).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlframe.data.tiny_moe_families import resolve_tiny_moe_family
from rlframe.models.moe_families import MOE_FAMILIES
from tests.ray.factories import TinyGroups, logprob_gap, prompts_for, tiny_config
from tests.rows_grid import generate_batch

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

IN_DEFAULT_TIER = {"mixtral"}
HEALTHY = 1e-4
"""fp32 on CPU: a sync that delivers every tensor leaves ~1e-6."""
STALE = 1e-3
"""What the update must move the trainer's log-probs by, so that a lost sync would show."""
WIDTH = 6
"""tiny_config's ``rollout.max_tokens``."""


def family_params() -> list[object]:
    return [
        pytest.param(f, marks=() if f in IN_DEFAULT_TIER else pytest.mark.matrix)
        for f in sorted(MOE_FAMILIES)
    ]


@pytest.mark.parametrize("family", family_params())
def test_weight_sync_of_each_moe_family(family: str, tmp_path: Path) -> None:
    name = f"tiny-moe-{family}:0"
    groups = TinyGroups(resolve_tiny_moe_family(name, cache_dir=tmp_path))
    try:
        cfg = tiny_config(1, model={"path": groups.model_path})
        group = groups(cfg)
        batch = generate_batch(group.generate, prompts_for(1), WIDTH)
        before = group.compute_logprobs(batch)["old_logprobs"]
        assert logprob_gap(batch, before) < HEALTHY, "the engine and trainer differ at load"
        mask = batch["response_mask"]
        group.update(
            batch.with_tensors(
                old_logprobs=before, advantages=torch.linspace(-1, 1, len(batch))[:, None] * mask
            )
        )
        moved = group.compute_logprobs(batch)["old_logprobs"]
        assert float(((moved - before).abs() * mask).max()) > STALE, "the update moved nothing"
        group.sync_weights()
        after = generate_batch(group.generate, prompts_for(2), WIDTH)
        gap = logprob_gap(after, group.compute_logprobs(after)["old_logprobs"])
        print(f"{family}: rollout/trainer log-prob gap after a sync {gap:.2e}")
        assert gap < HEALTHY, f"{family}: gap {gap:.2e} after the sync"
    finally:
        groups.tear_down()
