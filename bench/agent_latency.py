"""The rollout stage against a per-episode schedule, when env calls take a tool-like latency.

``agent_tiny``'s guessing game (256 episodes a step) with ``agent.env=slow_guess``: every
``reset`` and ``step`` first waits a lognormal latency (median ``--median`` s, ``--sigma``),
drawn per episode from a seeded generator, as an ``async`` wait (see
:mod:`rlframe.envs.slow_guess`). Two runs of ``--steps`` steps, in this process, on one Ray:

- **latency**: the game with the latency; ``timing_s/gen`` is the rollout stage.
- **free**: the same run with ``median_s=0`` (same seed, so the same games: the bench checks
  that rewards and turns match step by step); its ``timing_s/gen`` is the latency-free
  generation time.

Per step it prints the rollout stage, the per-episode bound (the issue's: the slowest
episode's own env time, every call's wall time as the env measured it, plus the latency-free
generation time) and their ratio; then the turn-synchronous model (every turn waits for the
slowest env call of the batch: the sum over turns of the slowest call, plus the latency-free
generation) and, where ``rlframe.rollout.multi_turn`` still has its turn loop, where the
latency run's time went: its engine calls and its turns' env calls, measured in the run, per
turn, and the ratio again with the run's own generation time (the stage less its env calls) in
the bound, which a change of load between the two runs does not move. Medians over steps 2 to
``--steps`` (step 1 warms the engine).

Episode ``k`` of a run waits the same latencies in any design that makes its episodes' envs in
the same order (and plays the same games), so a before and an after run wait the same times.

    python bench/agent_latency.py [--steps 4] [--median 0.1] [--sigma 1.0] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness import call_main, read_metrics, release_all_run_dirs  # noqa: E402

EPISODES_PER_STEP = 256
"""agent_tiny: 16 prompts x 16 episodes."""


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``uptime``'s)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def start_ray() -> None:
    """One local Ray for every run of the bench (a run joins it instead of starting one)."""
    from rlframe.config import RayConfig
    from rlframe.controller.cluster import init_ray

    init_ray(RayConfig(num_cpus=4))


def run_in_process(recipe: str, out: Path, overrides: list[str]) -> list[dict[str, Any]]:
    """``python -m rlframe.main +recipe=RECIPE ...`` in this process; its metrics per step."""
    args = [f"+recipe={recipe}", f"trainer.output_dir={out}", "trainer.val_every=0", *overrides]
    print(f"  running {' '.join(args)} (load {load_average()})", flush=True)
    start = time.perf_counter()
    try:
        code, _, stderr = call_main(args)
    finally:
        release_all_run_dirs()
    if code != 0:
        sys.exit(f"the run failed (exit {code}):\n{stderr[-4000:]}")
    print(f"  done in {time.perf_counter() - start:.0f} s (load {load_average()})", flush=True)
    return read_metrics(out)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


Target = tuple[Any, str]
"""A module or class and the name of a function on it."""


class Clock:
    """Per step, each call of some functions of the product: its seconds and its rows.

    Each call of ``step`` (a function called once per rollout stage) starts a step; each call
    of a ``timed`` function adds ``(seconds, rows)`` under its kind, ``rows`` read from its
    arguments. The functions are wrapped where they are looked up, for the runs in
    :meth:`installed`; where one is gone (the design changed), nothing is timed."""

    def __init__(self, step: Target, timed: dict[str, tuple[Target, Callable[..., int]]]) -> None:
        self.step, self.timed = step, timed
        self.steps: list[dict[str, list[tuple[float, int]]]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[bool]:
        targets = [self.step, *(t for t, _ in self.timed.values())]
        if not all(hasattr(owner, name) for owner, name in targets):
            yield False
            return
        saved = [(owner, name, getattr(owner, name)) for owner, name in targets]
        clock, step_fn = self, getattr(*self.step)

        def step(*args: Any, **kwargs: Any) -> Any:
            clock.steps.append({kind: [] for kind in clock.timed})
            return step_fn(*args, **kwargs)

        def timed(kind: str, fn: Callable[..., Any], rows: Callable[..., int]) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    seconds = time.perf_counter() - start
                    clock.steps[-1][kind].append((seconds, rows(*args, **kwargs)))

            return call

        setattr(*self.step, step)
        for kind, ((owner, name), rows) in self.timed.items():
            setattr(owner, name, timed(kind, getattr(owner, name), rows))
        try:
            yield True
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def totals(self, step: int, kind: str) -> tuple[float, int, int]:
        """Step ``step``'s (0-based) seconds, calls and rows of ``kind``."""
        calls = self.steps[step][kind] if step < len(self.steps) else []
        return sum(c[0] for c in calls), len(calls), sum(c[1] for c in calls)


def multi_turn_clock() -> Clock:
    """``multi_turn``'s turn loop: its engine calls (one per turn) and its env calls (reset,
    then one batch of steps per turn)."""
    from rlframe.rollout import multi_turn

    return Clock(
        (getattr(multi_turn, "EpisodeRunner", None), "run"),
        {
            "engine": ((multi_turn, "sample_turns"), lambda generate, rows, *_: len(rows)),
            "env": ((multi_turn, "run_env_calls"), lambda calls, *_: len(calls)),
        },
    )


def env_figures(record: list[Any], steps: int) -> list[dict[str, Any]]:
    """Per step: the slowest episode's own env time, and the sum over turns of the slowest
    call of that turn (call k of every episode that made one: reset, then step k)."""
    from rlframe.envs.slow_guess import EpisodeTimes

    # Envs made and never played (the launcher's check of the env makes one) are left out.
    record = [e for e in record if e.wall_s]
    if len(record) != steps * EPISODES_PER_STEP:
        sys.exit(f"{len(record)} episodes recorded, expected {steps} x {EPISODES_PER_STEP}")
    figures = []
    for s in range(steps):
        episodes: list[EpisodeTimes] = record[s * EPISODES_PER_STEP : (s + 1) * EPISODES_PER_STEP]
        calls = max(len(e.wall_s) for e in episodes)
        slowest_per_call = [
            max(e.wall_s[k] for e in episodes if len(e.wall_s) > k) for k in range(calls)
        ]
        figures.append(
            {
                "slowest_episode": max(sum(e.wall_s) for e in episodes),
                "turn_sync_env": sum(slowest_per_call),
                "mean_episode": statistics.mean(sum(e.wall_s) for e in episodes),
                "calls": float(calls),
                "slowest_per_call": slowest_per_call,
            }
        )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--median", type=float, default=0.1, help="median latency of a call, s")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    parser.add_argument("--seed", type=int, default=0, help="the latencies' seed")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is warm-up)")
    from rlframe.envs import slow_guess

    start_ray()
    print(
        f"agent_tiny with slow_guess (median {args.median} s, sigma {args.sigma}, seed "
        f"{args.seed}), {args.steps} steps, load {load_average()}",
        flush=True,
    )
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agent-latency-") as tmp:
        for name, latency in (("latency", args.median), ("free", 0.0)):
            record = slow_guess.start_recording()
            clock = multi_turn_clock()
            with clock.installed() as timed:
                metrics = run_in_process(
                    "agent_tiny",
                    Path(tmp) / name,
                    [
                        f"trainer.total_steps={args.steps}",
                        "agent.env=slow_guess",
                        f"+agent.env_kwargs.median_s={latency}",
                        f"+agent.env_kwargs.sigma={args.sigma}",
                        f"+agent.env_kwargs.seed={args.seed}",
                    ],
                )
            slow_guess.stop_recording()
            runs[name] = (metrics, env_figures(record, args.steps), clock if timed else None)
    report(runs, args.steps)


def report(runs: dict[str, Any], steps: int) -> None:
    (lat, lat_env, clock), (free, _, _) = runs["latency"], runs["free"]
    for a, b in zip(lat, free, strict=True):
        for key in ("reward/mean", "agent/turns/mean"):
            if a[key] != b[key]:
                print(f"  NOTE step {a['step']}: {key} {a[key]} (latency) != {b[key]} (free)")
    print(
        "\nstep | rollout | free gen | slowest episode env | bound | rollout/bound | "
        "turn-sync model (sum of slowest calls + free gen) | engine calls | env calls | "
        "rollout/bound with this run's generation (rollout - env calls)"
    )
    rows = []
    for s in range(steps):
        rollout, gen_free = lat[s]["timing_s/gen"], free[s]["timing_s/gen"]
        env = lat_env[s]
        bound = env["slowest_episode"] + gen_free
        model = env["turn_sync_env"] + gen_free
        engine, engine_calls, _ = clock.totals(s, "engine") if clock else (0.0, 0, 0)
        env_s, env_calls, _ = clock.totals(s, "env") if clock else (0.0, 0, 0)
        row = {
            "rollout": rollout,
            "free": gen_free,
            "slowest": env["slowest_episode"],
            "bound": bound,
            "ratio": rollout / bound,
            "model": model,
            "engine": engine,
            "env": env_s,
            # The same bound with this run's own generation (the stage less its env calls):
            # no second run, so no change of load between the two.
            "in_run_ratio": rollout / (env["slowest_episode"] + rollout - env_s) if clock else 0.0,
        }
        rows.append(row)
        print(
            f"{s + 1} | {rollout:.2f} s | {gen_free:.2f} s | {env['slowest_episode']:.2f} s "
            f"(mean {env['mean_episode']:.2f} s, {env['calls']:.0f} calls) | {bound:.2f} s | "
            f"{row['ratio']:.2f}x | {model:.2f} s (env {env['turn_sync_env']:.2f} s) | "
            + (
                f"{engine:.2f} s in {engine_calls} | {env_s:.2f} s in {env_calls} | "
                f"{row['in_run_ratio']:.2f}x"
                if clock
                else "- | - | -"
            )
        )
    if clock:
        print("\nper turn of the latency run: engine call (rows) + env calls (rows; slowest call)")
        for s in range(steps):
            engine, env_calls = clock.steps[s]["engine"], clock.steps[s]["env"]
            slowest = lat_env[s]["slowest_per_call"]
            parts = [f"reset {env_calls[0][0]:.2f} s ({env_calls[0][1]}; {slowest[0]:.2f} s)"]
            for t, (seconds, n) in enumerate(engine):
                part = f"turn {t + 1}: {seconds:.2f} s ({n})"
                if t + 1 < len(env_calls):
                    wall, m = env_calls[t + 1]
                    part += f" + {wall:.2f} s ({m}; {slowest[t + 1]:.2f} s)"
                parts.append(part)
            print(f"{s + 1} | " + " | ".join(parts))
    kept = rows[1:]
    med = {k: median([r[k] for r in kept]) for k in rows[0]}
    print(
        f"\nmedian of steps 2-{steps}: rollout {med['rollout']:.2f} s, bound "
        f"{med['bound']:.2f} s (slowest episode env {med['slowest']:.2f} s + latency-free "
        f"generation {med['free']:.2f} s); rollout/bound per step, median {med['ratio']:.2f}x "
        f"(target <= 1.2x); "
        f"turn-synchronous model {med['model']:.2f} s ({med['model'] / med['bound']:.2f}x the "
        f"bound)"
    )
    if clock:
        print(
            f"in the latency run: engine calls {med['engine']:.2f} s, env calls {med['env']:.2f} "
            f"s, the rest of the stage {med['rollout'] - med['engine'] - med['env']:.2f} s; "
            f"rollout/bound with this run's own generation, median {med['in_run_ratio']:.2f}x"
        )
    print(f"load average at the end: {load_average()}")


if __name__ == "__main__":
    main()
