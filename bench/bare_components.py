"""rlframe's GRPO step against the same work done by bare components (issue 47).

The yardstick: the same generate in plain vLLM (one ``LLM.generate`` of every prompt's ``n``
responses) and the same update in plain transformers (one forward, backward and AdamW step over
the same number of sequences, in the same micro-batches, padded rows, no rlframe code), beside
the stage times rlframe's own run logs (``timing_s/*`` of ``python -m rlframe.main
+recipe=grpo_tiny`` with the matching shape, through :func:`grpo_step.run`). It prints each
ratio, and the two bounds a step can reach:

- lockstep: bare generate + bare update (the weight sync costs a few ms);
- asynchronous (``rollout.max_staleness=1``): the slower of the two, the other hidden under it.

On a shared machine the run-to-run figures move with the load, so the update is also compared
in one process, interleaved, on the same batch (``TrainRole.update`` on a one-rank FSDP2 actor
against the bare update; random tokens, response lengths of the generated mean): wall and CPU
seconds, on one thread (``--ab-threads``), where CPU time counts the work and not the waiting.

The shape is the issue's: 32 prompts x 8 responses of at most 32 tokens, one optimizer step a
step, on ``tiny:0`` (a 2.4M Qwen2) and a wider random Qwen2 (``--wide``). Medians of steps 3 on.

    python bench/bare_components.py                  # tiny:0
    python bench/bare_components.py --rounds 3       # bare and rlframe alternated, medians
    python bench/bare_components.py --models tiny wide
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from grpo_step import run

PROMPTS, N, MAX_TOKENS, MICRO, LR = 32, 8, 32, 128, 5e-4
WIDE = {"hidden_size": 512, "num_layers": 4, "num_heads": 8, "intermediate_size": 1024}
"""The larger tiny model: a random Qwen2 of about 13M parameters (head_dim 64)."""
KEYS = tuple(f"timing_s/{s}" for s in ("gen", "old_logprob", "update", "sync", "step")) + (
    "response_length/mean",
)


def resolve_model(name: str, folder: Path) -> str:
    """The model directory of ``tiny`` (tiny:0) or ``wide`` (built into ``folder``)."""
    from rlframe.data.tiny_model import TinyModelSpec, build_tiny_model, resolve_model_path

    if name == "tiny":
        return resolve_model_path("tiny:0")
    target = folder / "qwen2-wide"
    if not target.exists():
        build_tiny_model(TinyModelSpec(**WIDE), target)
    return str(target)


def build_bare_engine(model: str, **extra: Any) -> Any:
    """A plain in-process ``vllm.LLM`` on ``model`` as the benches time it: token ids in and
    out, fp32, eager, log-probs after temperature, as rlframe's engine returns them."""
    from vllm import LLM

    return LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=64,
        enforce_eager=True,
        seed=0,
        logprobs_mode="processed_logprobs",
        **extra,
    )


def measure_bare(model: str, steps: int) -> dict[str, float]:
    """Bare generate and update, ``steps`` times, in one process as rlframe's colocated
    worker has them (vLLM in-process, ``OMP_NUM_THREADS`` as the worker's): the medians after
    two warm-up steps, and the mean response length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    llm = build_bare_engine(model)
    policy = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="sdpa"
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"gen": [], "update": []}
    lengths: list[float] = []
    for _ in range(steps):
        operands = torch.randint(0, 5, (PROMPTS, 2), generator=gen).tolist()
        prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in operands]
        params = SamplingParams(
            n=N, temperature=1.0, max_tokens=MAX_TOKENS, stop_token_ids=[eos], logprobs=0
        )
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        times["gen"].append(time.perf_counter() - start)
        rows = [(p, list(c.token_ids)) for p, o in zip(prompts, outs) for c in o.outputs]
        lengths.append(sum(len(r) for _, r in rows) / len(rows))
        start = time.perf_counter()
        update_bare(policy, optimizer, rows, pad, gen)
        times["update"].append(time.perf_counter() - start)
        # No weight sync: the engine keeps the initial weights, so the responses keep the
        # initial model's lengths (rlframe's barely move in 10 steps); a bare update that
        # taught the engine would change the work being timed.
    return {k: statistics.median(v[2:]) for k, v in times.items()} | {
        "length": statistics.mean(lengths[2:])
    }


def update_bare(  # type: ignore[no-untyped-def]
    policy, optimizer, rows: list[tuple[list[int], list[int]]], pad: int, gen
) -> None:
    """One GRPO-shaped optimizer step: padded rows (prompts left, responses right) in
    micro-batches of MICRO, the response tokens' log-probs from the full logits, a
    token-mean policy-gradient loss with group-normalised advantages (of random rewards: the
    time does not depend on them), clip, AdamW."""
    import torch

    prompt_w = max(len(p) for p, _ in rows)
    response_w = max(1, max(len(r) for _, r in rows))
    ids = torch.full((len(rows), prompt_w + response_w), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, prompt_w - len(p) : prompt_w + len(r)] = torch.tensor(p + r)
        mask[i, prompt_w - len(p) : prompt_w + len(r)] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    reward = torch.rand(len(rows), generator=gen).view(-1, N)
    advantages = (reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-6)
    advantages = advantages.view(-1, 1)
    loss_mask = mask[:, prompt_w:].float()
    tokens = loss_mask.sum()
    policy.train()
    for part in torch.arange(len(rows)).split(MICRO):
        logits = policy(
            input_ids=ids[part], attention_mask=mask[part], position_ids=positions[part]
        ).logits[:, prompt_w - 1 : -1]
        logp = logits.float().log_softmax(-1).gather(-1, ids[part, prompt_w:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        loss = -(ratio * advantages[part] * loss_mask[part]).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def compare_updates(model: str, length: float, reps: int) -> dict[str, float]:
    """rlframe's update and the bare one on the same 256 rows, interleaved ``reps`` times
    after a warm-up: median wall and CPU seconds of each."""
    import torch
    from transformers import AutoModelForCausalLM
    from update_throughput import set_single_rank_env

    from rlframe.config import (
        ActorConfig,
        AlgorithmConfig,
        Config,
        DataConfig,
        ModelConfig,
        RolloutConfig,
        TrainerConfig,
    )
    from rlframe.config.rollout import RolloutEngineName
    from rlframe.config.sections import Device
    from rlframe.core.train_batch import TrainBatch
    from workers.train_worker import TrainWorker

    set_single_rank_env()
    gen = torch.Generator().manual_seed(0)
    rows, vocab = PROMPTS * N, 40
    lengths = torch.distributions.Geometric(probs=torch.tensor(1 / length)).sample((rows,))
    lengths = lengths.long().clamp(1, MAX_TOKENS)
    mask = (torch.arange(MAX_TOKENS)[None] < lengths[:, None]).float()
    prompts = torch.randint(3, vocab, (rows, 4), generator=gen)
    responses = torch.randint(3, vocab, (rows, MAX_TOKENS), generator=gen) * mask.long()
    batch = TrainBatch(
        prompt_ids=prompts,
        prompt_mask=torch.ones_like(prompts),
        response_ids=responses,
        response_mask=mask,
        loss_mask=mask,
        advantages=torch.randn(rows, 1, generator=gen) * mask,
        rollout_logprobs=-3.0 * mask,
    )
    cfg = Config(
        model=ModelConfig(path="unused"),
        data=DataConfig(batch_size=PROMPTS, max_prompt_length=32),
        rollout=RolloutConfig(engine=RolloutEngineName.hf, n=N, max_tokens=MAX_TOKENS),
        actor=ActorConfig(lr=LR, mini_batch_size=rows, micro_batch_size=MICRO, grad_clip=1.0),
        algorithm=AlgorithmConfig(clip_low=0.2, clip_high=0.28),
        trainer=TrainerConfig(total_steps=100, device=Device.cpu),
    )
    role = TrainWorker(cfg, model, "cpu").train_role
    policy = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="sdpa"
    )
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    bare_rows = [
        (prompts[i].tolist(), responses[i, : int(lengths[i])].tolist()) for i in range(rows)
    ]
    updates = {
        "rlframe": lambda: role.update(batch),
        "bare": lambda: update_bare(policy, optimizer, bare_rows, 0, gen),
    }
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in updates}
    for i in range(reps + 1):
        for name, update in updates.items():
            wall, cpu = time.perf_counter(), time.process_time()
            update()
            if i:  # the first round warms up
                seconds[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        f"{name} {what}": statistics.median(s[k] for s in runs)
        for name, runs in seconds.items()
        for k, what in enumerate(("wall", "cpu"))
    }


def run_bare_child(model: str, steps: int, threads: int) -> dict[str, float]:
    """:func:`measure_bare` in a fresh interpreter (vLLM fixes the process's thread count)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    return run_child(["--bare-child", model, "--steps", str(steps)], env)


def run_child(args: list[str], env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def report(  # type: ignore[no-untyped-def]
    name: str,
    bare: dict[str, float],
    lock: dict[str, float],
    sync: dict[str, float],
    forced: dict[str, float] | None,
):
    load = os.getloadavg()
    print(f"\n{name}  (load {load[0]:.2f} {load[1]:.2f})")
    print(
        f"  response length: bare {bare['length']:.1f}, rlframe lockstep "
        f"{lock['response_length/mean']:.1f}, async {sync['response_length/mean']:.1f} tokens"
    )
    print(f"  {'':<26}{'bare':>8}{'rlframe':>9}{'ratio':>8}")

    def row(label: str, ours: float, theirs: float, note: str = "") -> None:
        print(f"  {label:<26}{theirs:>8.3f}{ours:>9.3f}{ours / theirs:>7.2f}x  {note}")

    row("gen (lockstep)", lock["timing_s/gen"], bare["gen"])
    row("update (lockstep)", lock["timing_s/update"], bare["update"])
    row("lockstep step", lock["timing_s/step"], bare["gen"] + bare["update"], "(gen + update)")
    overlap = max(bare["gen"], bare["update"])
    row("async step (staleness 1)", sync["timing_s/step"], overlap, "(max(gen, update))")
    if forced is not None:
        row("async, pass forced", forced["timing_s/step"], overlap, "(recompute_old_logprobs)")
        print(f"  async with the pass forced: old_logprob {forced['timing_s/old_logprob']:.3f}")
    print(
        f"  async stages: update {sync['timing_s/update']:.3f}, old_logprob "
        f"{sync['timing_s/old_logprob']:.3f}, sync {sync['timing_s/sync']:.3f}; lockstep sync "
        f"{lock['timing_s/sync']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=["tiny", "wide"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--rounds", type=int, default=1, help="bare + rlframe rounds, back to back (medians)"
    )
    parser.add_argument("--threads", type=int, default=2, help="the workers' cpus_per_proc")
    parser.add_argument("--ab-threads", type=int, default=1, help="threads of the A/B update")
    parser.add_argument("--ab-reps", type=int, default=6)
    parser.add_argument("--bare-child", help=argparse.SUPPRESS)
    parser.add_argument("--ab-child", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=float, default=24.0, help=argparse.SUPPRESS)
    parser.add_argument("--skip-rlframe", action="store_true", help="bare figures alone")
    parser.add_argument(
        "--forced-pass",
        action="store_true",
        help="also the async run with algorithm.recompute_old_logprobs=true (the pass before "
        "issue 47 skipped it)",
    )
    args = parser.parse_args()
    if args.bare_child:
        print(json.dumps(measure_bare(args.bare_child, args.steps)))
        return
    if args.ab_child:
        print(json.dumps(compare_updates(args.ab_child, args.length, args.ab_reps)))
        return
    here = str(Path(__file__).resolve().parents[1])
    folder = Path(tempfile.mkdtemp(prefix="rlframe-bare-"))
    print(
        f"GRPO, {PROMPTS} prompts x {N} responses of at most {MAX_TOKENS} tokens, one optimizer "
        f"step a step; medians of steps 3-{args.steps}"
    )
    for name in args.models:
        model = resolve_model(name, folder)
        bare = run_bare_child(model, args.steps, args.threads)
        ab_args = ["--ab-child", model, "--length", str(bare["length"]), "--ab-reps"]
        ab_env = dict(os.environ, OMP_NUM_THREADS=str(args.ab_threads))
        ab = run_child([*ab_args, str(args.ab_reps)], ab_env)
        print(
            f"\n{name}: update on the same batch in one process, {args.ab_threads} thread(s), "
            f"median of {args.ab_reps} (load {os.getloadavg()[0]:.2f}):"
        )
        for what in ("wall", "cpu"):
            ours, theirs = ab[f"rlframe {what}"], ab[f"bare {what}"]
            print(f"  {what:<5} rlframe {ours:.3f} s, bare {theirs:.3f} s: {ours / theirs:.2f}x")
        if args.skip_rlframe:
            print(name, bare, f"load {os.getloadavg()[0]:.2f}")
            continue
        common = [f"model.path={model}", f"trainer.cpus_per_proc={args.threads}"]
        rounds = [measure_round(here, common, args, folder / f"{name}-0", bare)]
        for r in range(1, args.rounds):
            fresh = run_bare_child(model, args.steps, args.threads)
            rounds.append(measure_round(here, common, args, folder / f"{name}-{r}", fresh))
        report(f"{name} ({model})", *median_round(rounds))
        if args.rounds > 1:
            print_ratios("lockstep / (gen + update)", [r.lock_ratio() for r in rounds])
            print_ratios("async / max(gen, update)", [r.async_ratio() for r in rounds])


class Round(NamedTuple):
    """One round's runs, back to back: the bare components, then rlframe's (``forced``: the
    async run with the old-log-prob pass forced; empty when not measured)."""

    bare: dict[str, float]
    lock: dict[str, float]
    sync: dict[str, float]
    forced: dict[str, float]

    def lock_ratio(self) -> float:
        return self.lock["timing_s/step"] / (self.bare["gen"] + self.bare["update"])

    def async_ratio(self) -> float:
        return self.sync["timing_s/step"] / max(self.bare["gen"], self.bare["update"])


def print_ratios(label: str, ratios: list[float]) -> None:
    """A step's ratio to its bound in each round, and their median."""
    shown = ", ".join(f"{x:.2f}" for x in ratios)
    print(f"  {label} per round: {shown}; median {statistics.median(ratios):.2f}x")


def measure_round(  # type: ignore[no-untyped-def]
    here: str, common: list[str], args, out: Path, bare: dict[str, float]
) -> Round:
    """One round, right after its bare run: rlframe lockstep, async (and the forced pass)."""
    lock = run(here, common, args.steps, out / "lockstep", KEYS)
    sync = run(here, [*common, "rollout.max_staleness=1"], args.steps, out / "async", KEYS)
    forced: dict[str, float] = {}
    if args.forced_pass:
        overrides = [*common, "rollout.max_staleness=1", "algorithm.recompute_old_logprobs=true"]
        forced = run(here, overrides, args.steps, out / "forced", KEYS)
    return Round(bare, lock, sync, forced)


def median_round(rounds: list[Round]) -> tuple[dict[str, float], ...]:
    """Each figure's median over the rounds, as :func:`report` takes them (the forced run:
    None when not measured)."""
    bare, lock, sync, forced = (
        {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for runs in zip(*rounds, strict=True)
    )
    return bare, lock, sync, forced or None  # type: ignore[return-value]


if __name__ == "__main__":
    main()
