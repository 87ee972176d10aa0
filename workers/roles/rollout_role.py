"""The rollout role: a rollout engine (vLLM by default), its sleep/wake state, sampling.

It owns what the engine holds: whether it is awake, whether its weights are usable, and
which weights version they are. A worker composes it with a training role in one process
(:class:`workers.hybrid.HybridWorker`) or runs it alone in a separate rollout pool
(:class:`workers.rollout_worker.RolloutWorker`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch

from rlframe.config import Config, RolloutEngineName
from rlframe.config.agent import compute_response_width
from rlframe.core.names import RouterReplay
from rlframe.core.protocol import ROUTED_EXPERTS, Batch, as_column
from rlframe.rollout.rows import build_response
from rlframe.rollout.turns import TurnRequest, TurnResult
from workers.inference.base import RolloutEngine, RolloutSample, SamplingSpec
from workers.sync.sync_probe import (
    ProbeReading,
    ProbeVerdict,
    StaleWeightsError,
    SyncProbe,
    derive_mean_tolerance,
    derive_probe_tolerance,
    judge_probe,
    pick_probe_tolerance,
)
from workers.training.model_build import pick_dtype


def build_rollout_engine(cfg: Config, model_path: str, device: str, rank: int) -> RolloutEngine:
    dtype = pick_dtype(cfg.model.dtype, device)
    r = cfg.rollout
    # algorithm.router_replay=rollout: every sample carries the experts its tokens went to.
    record = cfg.algorithm.router_replay is RouterReplay.rollout
    if r.engine is RolloutEngineName.hf:
        from workers.inference.hf_rollout import HFRollout

        return HFRollout(
            model_path, device, dtype, cfg.model.trust_remote_code, r.sleep_level, record
        )
    from workers.inference.vllm_rollout import VLLMRollout

    max_len = cfg.data.max_prompt_length + compute_response_width(r.max_tokens, r.agent, cfg.agent)
    # Equal inside a tensor-parallel group (its ranks run one engine), different across them.
    seed = cfg.trainer.seed + rank // r.tensor_parallel_size
    return VLLMRollout(model_path, r, device, max_len, seed, dtype, cfg.model.lora, record)


def build_sampling_spec(prompts: Batch, cfg: Config) -> SamplingSpec:
    """Sampling for one generate call: the run's settings, overridden by the batch's meta
    (``greedy`` for ReMax baselines, ``temperature`` for validation) and per-row caps."""
    meta = prompts.meta
    per_row = (
        tuple(int(m) for m in prompts.tensor("max_tokens")) if "max_tokens" in prompts else None
    )
    return SamplingSpec(
        max_tokens=cfg.rollout.max_tokens,
        temperature=0.0 if meta.get("greedy") else meta.get("temperature", cfg.rollout.temperature),
        top_p=cfg.rollout.top_p,
        stop_token_ids=tuple(meta["stop_token_ids"]),
        max_tokens_per_row=per_row,
    )


STEPS_PER_CALL = 8
"""Engine steps one ``serve`` call runs at most when none of them finishes a request: a
request that arrives meanwhile waits that long to join, and each call is one Ray RPC. A count,
not a time, so the ranks of a tensor-parallel engine step alike."""


class RolloutRole:
    """Args: the run's config, the model directory, ``cuda`` or ``cpu``, and this process's
    rank in its pool (tensor-parallel ranks of one engine share a sampling seed)."""

    def __init__(self, cfg: Config, model_path: str, device: str, rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.engine = build_rollout_engine(cfg, model_path, device, rank)
        # The engine starts awake with the checkpoint's weights, which are version 0.
        self.awake = True
        self.weights_valid = True
        """False after a sleep that discarded the weights (level 2) until they are loaded."""
        self.weights_version = 0
        self.dtype = pick_dtype(cfg.model.dtype, device)
        self.last_probe: ProbeReading | None = None
        """The probe readings after the last verified sync."""
        self.probe_tolerance = pick_probe_tolerance(self.dtype)
        """The broken-sync tolerance of one token: the dtype's floor until noise is measured."""
        self.mean_tolerance: float | None = None
        """The broken-sync tolerance of the probe's mean gap, once noise is measured."""
        self.last_verdict: ProbeVerdict | None = None
        """The receiver check of the last sync, for the driver (``read_sync_check``)."""

    def generate(self, prompts: Batch) -> Batch:
        """One sampled turn per row, in one engine call (the wire of
        :mod:`rlframe.rollout.rows`): columns ``prompt_tokens`` (each row's context) and
        ``seed`` in; columns ``response_tokens``, ``token_logprobs``, ``finish_reason`` and
        the tensor ``weights_version`` (int64, per row) out. The engine must be awake with
        valid weights.

        Meta ``engine_s``: seconds the engine spent generating.

        With ``algorithm.router_replay=rollout`` also the column ``routed_experts``: per row
        int16 [context + response - 1, MoE layers, top_k] (see :mod:`rlframe.models.moe_routing`).

        Optional inputs: a ``max_tokens`` tensor (each row's cap, e.g. what is left of a
        multi-turn budget); meta ``greedy`` (ReMax baselines), ``temperature`` (validation).
        """
        if not (self.awake and self.weights_valid):
            raise RuntimeError("generate needs the rollout engine awake with loaded weights")
        if self.engine.has_unfinished():
            # A blocking call would step the stream's requests too and take their outputs.
            raise RuntimeError(
                "generate while requests of the stream are in the engine: pause the stream "
                "(EngineClient.pause) before a blocking call"
            )
        rows = [[int(t) for t in ids] for ids in prompts.column("prompt_tokens")]
        seeds = [int(s) for s in prompts.column("seed")]
        start = time.perf_counter()
        images = [list(r) for r in prompts["images"]] if "images" in prompts else None
        spec = build_sampling_spec(prompts, self.cfg)
        samples = self.engine.generate(rows, seeds, spec, images)
        # The engine's busy time: the asynchronous producer derives rollout idle time from it.
        meta = {"engine_s": time.perf_counter() - start}
        turns = [(s.response_ids, s.logprobs, s.finish_reason) for s in samples]
        out = build_response(turns, self.weights_version, meta)
        if self.cfg.algorithm.router_replay is RouterReplay.rollout:
            out.columns[ROUTED_EXPERTS] = as_column([s.routed_experts for s in samples])
        return out

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """The stream's call: queue ``requests`` into the running batch, then step the engine
        until a step finishes some request (or :data:`STEPS_PER_CALL` steps, or nothing is
        left); the requests finished. Every rank of a tensor-parallel engine gets the same
        calls, so they add and step alike."""
        if not (self.awake and self.weights_valid):
            raise RuntimeError("serve needs the rollout engine awake with loaded weights")
        for r in requests:
            spec = SamplingSpec(
                max_tokens=r.max_tokens,
                temperature=self.cfg.rollout.temperature
                if r.temperature is None
                else r.temperature,
                # A scoring request reads the model's own distribution: no nucleus cut.
                top_p=1.0 if r.score_from is not None else self.cfg.rollout.top_p,
                stop_token_ids=r.stop_ids,
                score_from=r.score_from,
                top_k=r.top_k,
            )
            self.engine.add_request(r.request_id, r.context, r.seed, spec, list(r.images))
        finished: list[tuple[str, RolloutSample]] = []
        for _ in range(STEPS_PER_CALL):
            if finished or not self.engine.has_unfinished():
                break
            finished = self.engine.step()
        return self.build_results(finished)

    def abort_stream(self) -> list[TurnResult]:
        """End every request of the stream now (a weight sync pauses the stream): each
        sampled one with its tokens so far and the version that sampled them, finish reason
        ``abort``. Its sampler can continue it as a new request (context + those tokens)."""
        return self.build_results(self.engine.abort())

    def build_results(self, samples: list[tuple[str, RolloutSample]]) -> list[TurnResult]:
        return [
            TurnResult(
                request_id,
                s.response_ids,
                s.logprobs,
                s.finish_reason,
                self.weights_version,
                s.cached_tokens,
                s.routed_experts,
                self.rank,
                s.scored,
            )
            for request_id, s in samples
        ]

    def verify_weights(self, probe: SyncProbe) -> None:
        """The receiver check after a sync (:meth:`check_sync`), raising
        :class:`~workers.sync.sync_probe.StaleWeightsError` (naming what the engine serves)
        when it fails."""
        verdict = self.check_sync(probe)
        if verdict.error is not None:
            raise StaleWeightsError(verdict.error)

    def check_sync(self, probe: SyncProbe) -> ProbeVerdict:
        """The receiver check after a sync: the engine's log-probs of the probe match the
        trainer's, and moved when the trainer's did. At version 0 (the checkpoint's weights on
        both sides, adapters still zero) it measures the noise instead, which the tolerances
        are derived from. The verdict is kept for the driver (:attr:`last_verdict`)."""
        if self.weights_version == 0 and self.last_probe is None:
            self.calibrate_probe(probe)
            verdict = ProbeVerdict(0, 0.0, None)
        else:
            engine = torch.tensor(self.engine.compute_prompt_logprobs(probe.ids))
            verdict = judge_probe(
                engine,
                probe.logprobs,
                self.weights_version,
                self.last_probe,
                self.probe_tolerance,
                self.engine.describe_weights(),
                self.mean_tolerance,
            )
            if verdict.error is None:
                self.last_probe = ProbeReading(self.weights_version, engine, probe.logprobs)
        self.last_verdict = verdict
        return verdict

    def calibrate_probe(self, probe: SyncProbe) -> None:
        """Measure the trainer-engine probe gap with the same weights on both sides (the
        checkpoint's, before any update) and derive the sync check's tolerances from it."""
        engine = torch.tensor(self.engine.compute_prompt_logprobs(probe.ids))
        noise = engine - probe.logprobs
        ceiling = 10 * pick_probe_tolerance(self.dtype)
        if float(noise.abs().max()) > ceiling:
            raise StaleWeightsError(
                f"the rollout engine ({self.engine.describe_weights()}) and the trainer "
                f"disagree on the probe by {float(noise.abs().max()):.3g} (> {ceiling:g}) "
                "before any update: they did not load the same model"
            )
        self.probe_tolerance = derive_probe_tolerance(noise, self.dtype)
        self.mean_tolerance = derive_mean_tolerance(noise, self.dtype)
        self.last_probe = ProbeReading(self.weights_version, engine, probe.logprobs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights in place and record their version."""
        self.engine.load_weights(iter(weights))
        self.weights_valid = True
        self.weights_version = version

    def sleep(self) -> None:
        """Free the engine's device memory; a level-2 sleep also discards the weights."""
        self.engine.sleep()
        self.awake = False
        if self.engine.discards_weights_on_sleep:
            self.weights_valid = False

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``["weights"]``, ``["kv_cache"]`` or (None) both; awake once the KV cache is."""
        self.engine.wake_up(tags)
        if tags is None or "kv_cache" in tags:
            self.awake = True


def read_verdict(role: RolloutRole) -> dict[str, Any] | None:
    """The receiver check of the last sync as plain values for the driver (``version``,
    ``ratio``, ``error``; see :class:`~workers.sync.sync_probe.ProbeVerdict`), or None when
    no sync was checked yet. Read once: a later read without a sync in between gives None."""
    verdict, role.last_verdict = role.last_verdict, None
    return None if verdict is None else asdict(verdict)
