"""The cost of seeded requests in vLLM's CPU sampler: vLLM's own seed draws against rlframe's
in-place ones (:func:`workers.inference.vllm_cpu.use_in_place_seed_draws`), and no seeds.

One in-process engine on ``tiny:0`` generates 32 prompts x 8 responses of exactly 32 tokens
(``ignore_eos``) as rlframe's rollout does (one seeded request per response), the three
variants interleaved round by round so that the machine's drift hits each alike; the
sampler's bound ``forward`` is switched between rounds. It prints the median generate time of
each and checks that both seeded variants sampled the same tokens.

    python bench/cpu_sampler_seeds.py --rounds 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()

    import torch
    from bare_components import build_bare_engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.ops import topk_topp_sampler as ops

    from rlframe.data.tiny_model import resolve_model_path
    from workers.inference.vllm_cpu import prepare_cpu_engine

    prepare_cpu_engine(0, 1)
    ours = ops.TopKTopPSampler.forward_cpu
    forwards = {"vllm's draws": ours.replaces, "in-place draws": ours, "no seeds": ours}
    llm = build_bare_engine(resolve_model_path("tiny:0"), max_num_seqs=256)
    engine = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    runner = engine.model_executor.driver_worker.worker.model_runner
    (sampler,) = [m for m in runner.sampler.modules() if isinstance(m, ops.TopKTopPSampler)]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (6,), generator=gen).tolist() for _ in range(32)]
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(8)]
    seconds: dict[str, list[float]] = {name: [] for name in forwards}
    for r in range(args.rounds + 1):
        tokens = {}
        for name, forward in forwards.items():
            sampler.forward = types.MethodType(forward, sampler)  # type: ignore[method-assign]
            seeds = [None if name == "no seeds" else 1000 * r + i for i in range(len(requests))]
            params = [
                SamplingParams(max_tokens=32, ignore_eos=True, logprobs=0, seed=s, detokenize=False)
                for s in seeds
            ]
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            if r:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
            tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
        if tokens["vllm's draws"] != tokens["in-place draws"]:
            raise SystemExit(f"round {r}: the in-place draws sampled other tokens than vLLM's")
    print(
        f"256 seeded requests x 32 tokens, tiny:0, median of {args.rounds} rounds "
        f"(load {os.getloadavg()[0]:.2f}); the seeded variants sampled the same tokens"
    )
    for name, runs in seconds.items():
        print(f"  {name:<16} {statistics.median(runs):.3f} s  {[round(s, 3) for s in runs]}")


if __name__ == "__main__":
    main()
