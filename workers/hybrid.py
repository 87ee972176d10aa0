"""The hybrid worker: a training role and a rollout role composed in one process.

Each rank holds the policy under FSDP2 (and, when a KL term is on, the frozen reference) and
a rollout engine for the same model (vLLM by default). It switches between rollout mode
(engine awake, FSDP state optionally offloaded) and train mode (engine asleep) around each
stage, so the device never holds both working sets at once; weights move in-process. The
training endpoints are :class:`workers.train_endpoints.TrainEndpoints`'; each enters train
mode first.
"""

from __future__ import annotations

from typing import Any

from rlframe.config import Config
from rlframe.controller import reads
from rlframe.controller.dispatch import Dispatch, dispatch
from rlframe.core.protocol import Batch
from rlframe.rollout.turns import TurnRequest, TurnResult
from workers.roles.rollout_role import RolloutRole, read_verdict
from workers.sync.weight_sync import InProcessSink
from workers.train_endpoints import TrainEndpoints


class HybridWorker(TrainEndpoints):
    """Args: the run's config, the resolved model directory, and ``cuda`` or ``cpu``."""

    def __init__(self, cfg: Config, model_path: str, device: str) -> None:
        super().__init__(cfg, model_path, device)
        self.rollout_role = RolloutRole(cfg, model_path, device, self.rank)
        self.startup.mark("rollout_engine")
        self.sink = InProcessSink(self.rollout_role)
        # Same weights on both sides now: the probe gap measured here is pure noise.
        probe = self.sync_probe()
        if probe is not None:
            self.rollout_role.calibrate_probe(probe)
        # The engine starts awake with the checkpoint's weights: the first stage is rollout.
        self.train_role.offload()
        # The engine's first request: on vLLM it compiles the log-prob gather (seconds).
        self.startup.mark("sync_probe")

    # -- mode switch ---------------------------------------------------------------------
    #
    # Rollout mode is "the engine is awake" (the rollout role's state); train mode is "the
    # engine sleeps" (FSDP state reloaded when actor.offload). A level-2 sleep discards the
    # engine's weights, so waking it must then come with a weight push. sync_weights always
    # pushes; every other way into rollout mode (a second DAPO sampling round, ReMax's greedy
    # baseline, generation during critic warm-up, validation) pushes only when the weights
    # were discarded. The pushed weights are the actor's, which on those paths equal the last
    # synced ones, so they keep the version the engine had.

    def enter_rollout_mode(self) -> None:
        if self.rollout_role.awake:
            return
        if self.rollout_role.weights_valid:
            self.train_role.offload()
            self.rollout_role.wake_up()
        else:
            self.push_weights(self.rollout_role.weights_version)

    def enter_train_mode(self) -> None:
        if not self.rollout_role.awake:
            return
        self.rollout_role.sleep()
        self.train_role.reload()

    def weights_loaded(self, version: int) -> None:
        """A loaded checkpoint goes into the rollout engine under its saved weights version."""
        self.push_weights(version)

    def push_weights(self, version: int) -> None:
        """Stream the actor's weights into the sleeping engine and wake it fully.

        Order matters on a GPU: wake the engine's weights only, load them from the (still
        resident) FSDP shards, offload FSDP, and only then re-allocate the KV cache, so
        old weights, new weights and the KV cache never share the device at once. Every
        rank streams every full tensor in the same order (the gathers are collectives);
        with tensor parallelism each rank's vLLM loader keeps its own shard.
        """
        self.rollout_role.wake_up(tags=["weights"])
        self.sink.push(self.train_role.weight_source(), version)
        self.train_role.offload()
        self.rollout_role.wake_up(tags=["kv_cache"])

    # -- stages --------------------------------------------------------------------------

    @dispatch(Dispatch.ROLLOUT_DP_SPLIT, reads=reads.GENERATE)
    def generate(self, prompts: Batch) -> Batch:
        """See :meth:`RolloutRole.generate`. Meta ``more_turns``: more calls of this
        generation phase follow (an episode's next turn, a partial response's next chunk), so
        the engine stays awake; the next training call (log-probs, update, sync) puts it to
        sleep."""
        self.enter_rollout_mode()
        out = self.rollout_role.generate(prompts)
        if not prompts.meta.get("more_turns"):
            self.enter_train_mode()
        return out

    @dispatch(Dispatch.ONE_TO_ALL)
    def open_stream(self) -> None:
        """Rollout mode on every rank before the stream's requests come (waking may push
        weights, a collective); the next training call ends it."""
        self.enter_rollout_mode()

    def serve(self, requests: list[TurnRequest]) -> list[TurnResult]:
        """One call of the request stream (:meth:`RolloutRole.serve`), made on this rank's
        actor by :class:`rlframe.rollout.engine_client.EngineClient`."""
        return self.rollout_role.serve(requests)

    def abort_stream(self) -> list[TurnResult]:
        """The stream's pause (:meth:`RolloutRole.abort_stream`); the engine must be awake
        (an engine put to sleep holds no request: the producer pauses the stream first)."""
        return self.rollout_role.abort_stream()

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> int:
        """Stream the trained weights into the rollout engine; returns the new version."""
        self.enter_train_mode()
        version = self.train_role.publish_weights()
        probe = self.sync_probe()
        self.push_weights(version)
        if probe is not None:
            self.rollout_role.check_sync(probe)
        return version

    @dispatch(Dispatch.ONE_TO_ALL)
    def read_sync_check(self) -> dict[str, Any] | None:
        """See :func:`workers.roles.rollout_role.read_verdict`."""
        return read_verdict(self.rollout_role)
