"""Leftover /dev/shm segments of vLLM's CPU TP all-reduce: stale ones go, live ones stay."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from workers.inference.vllm_cpu import remove_stale_cpu_shm

SHM = Path("/dev/shm")


@pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm")
def test_only_this_ranks_unmapped_segment_is_removed() -> None:
    # Rank 7 of TP group [6-7], a group no real test uses.
    stale = SHM / "-tp:0-[6-7]-cpushm_7"
    live = SHM / "rlframe-test-tp:0-[6-7]-cpushm_7"
    other_rank = SHM / "-tp:0-[6-7]-cpushm_6"
    for path in (stale, live, other_rank):
        path.write_bytes(b"\0" * 4096)
    try:
        with live.open("r+b") as f, mmap.mmap(f.fileno(), 4096):
            remove_stale_cpu_shm(rank=7, tp=2)
            assert not stale.exists(), "a segment nobody maps is stale"
            assert live.exists(), "a segment a live process maps must stay"
            assert other_rank.exists(), "another rank's segment is that rank's to handle"
    finally:
        for path in (stale, live, other_rank):
            path.unlink(missing_ok=True)
