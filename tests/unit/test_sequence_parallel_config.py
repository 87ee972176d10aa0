"""actor/critic.sequence_parallel_size: refused before Ray where it cannot work (naming the
key), shown as a mesh in the start-up summary; and the pure slicing of a layout over a
sequence-parallel group (which rank holds which positions and predicts which tokens)."""

from __future__ import annotations

import pytest
import torch

from rlframe.config import ConfigError, build_config
from rlframe.core.sequence_layout import build_layout
from rlframe.models.checks import check_sequence_parallel
from rlframe.models.hf_config import read_model_config
from rlframe.observability.logs import describe_mesh
from tests.workers.layout_cases import make_batch


def config(sp: int = 2, procs: int = 2, **extra: dict) -> object:
    tree = {
        "model": {"path": "tiny:0"},
        "trainer": {"procs_per_node": procs, "cpus_per_proc": 1},
        "actor": {"sequence_parallel_size": sp},
    }
    for section, values in extra.items():
        tree.setdefault(section, {}).update(values)
    return build_config(tree)


@pytest.mark.parametrize(
    "overrides,key,text",
    [
        (
            {"procs": 2, "sp": 3},
            "actor.sequence_parallel_size",
            "3 must divide the number of ranks",
        ),
        ({"sp": 0}, "actor.sequence_parallel_size", "must be > 0"),
        (
            {"sp": 1, "critic": {"sequence_parallel_size": 4}},
            "critic.sequence_parallel_size",
            "4 must divide the number of ranks",
        ),
    ],
)
def test_sizes_that_do_not_divide_the_ranks_are_refused(overrides, key, text) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}: .*{text}"):
        config(**overrides)


def test_a_critic_size_without_a_critic_is_refused() -> None:
    """critic.sequence_parallel_size has no effect without a critic: refused like the other
    keys without effect (issue 46: it ran silently)."""
    with pytest.raises(ConfigError, match=r"^critic.sequence_parallel_size: has no effect"):
        config(sp=1, critic={"sequence_parallel_size": 2})
    with_critic = config(sp=1, critic={"sequence_parallel_size": 2}, algorithm={"advantage": "gae"})
    assert with_critic.critic.enable and with_critic.critic.sequence_parallel_size == 2


def test_sizes_that_do_not_divide_the_heads_are_refused() -> None:
    from rlframe.data.tiny_model import resolve_model_path

    path = resolve_model_path("tiny:0")  # 2 attention heads, 1 key/value head
    model = read_model_config(path, False)
    check_sequence_parallel(config(sp=2), path, model)  # the key/value head is repeated
    with pytest.raises(ConfigError, match=r"^actor.sequence_parallel_size: 4 must divide .* 2 "):
        check_sequence_parallel(config(sp=4, procs=4), path, model)


def test_startup_summary_shows_the_mesh() -> None:
    assert describe_mesh(config(sp=2, procs=4), 4) == "2 data x 2 sequence (training)"
    assert describe_mesh(config(sp=1, procs=2), 2) == "2 data x 1 sequence (training)"


@pytest.mark.parametrize("packed", [True, False])
def test_slices_tile_the_sequence_and_each_token_has_one_owner(packed: bool) -> None:
    from workers.training.ulysses import SequenceParallel, shard_layout

    layout = build_layout(make_batch(), packed)
    rows, length = layout.input_ids.shape
    size = 3  # does not divide the length: the tail is padded
    shards = [shard_layout(layout, SequenceParallel(None, r, size, "sdpa")) for r in range(size)]
    ids = torch.cat([s.input_ids for s in shards], dim=1)
    positions = torch.cat([s.position_ids for s in shards], dim=1)
    assert ids.shape[1] % size == 0 and ids.shape[1] - length < size
    assert torch.equal(ids[:, :length], layout.input_ids)
    assert torch.equal(positions[:, :length], layout.position_ids)
    # Every selected token is predicted by exactly one rank, from the position it would be
    # predicted from unsliced, and the targets follow.
    owned = torch.cat(shards[0].owned).sort().values
    assert torch.equal(owned, torch.arange(len(layout.target_ids)))
    local = ids.shape[1] // size
    for r, s in enumerate(shards):
        mine = s.owned[r]
        row, col = s.predict_index // local, s.predict_index % local + r * local
        assert torch.equal(row * length + col, layout.predict_index[mine])
        assert torch.equal(s.target_ids, layout.target_ids[mine])
    # The whole-sequence mask: causal, one segment, padding seen only by itself.
    mask = shards[0].attention_mask
    assert mask.shape == (rows, 1, ids.shape[1], ids.shape[1])
    assert not bool(mask.triu(1).any())
    if packed:  # two packed rows never see each other
        first_row = int((layout.position_ids[0] == 0).nonzero()[1])
        assert not bool(mask[0, 0, first_row:, :first_row].any())
    else:  # left padding is never a key for a real query
        pad = ~layout.attention_mask.bool()
        real_queries = mask[:, 0, :length, :length][~pad]
        assert not bool((real_queries & pad.repeat_interleave((~pad).sum(1), 0)).any())


def test_one_unpadded_sequence_runs_without_a_mask() -> None:
    from workers.training.ulysses import SequenceParallel, shard_layout

    # sdpa's causal kernels then never hold [L, L] scores (bench/sequence_parallel.py).
    layout = build_layout(make_batch().rows([0]), packed=True)
    assert shard_layout(layout, SequenceParallel(None, 1, 4, "sdpa")).attention_mask is None
