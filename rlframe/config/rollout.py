"""The ``rollout`` section: the engines, how they sample, and where they live."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rlframe.config.checks import require, require_positive
from rlframe.core.names import OffPolicyCorrection
from rlframe.core.registry import absolutize


class Placement(str, Enum):
    """Where the rollout engines live. ``colocated``: inside the training ranks (hybrid
    workers, one device set). ``separate``: in a rollout pool of their own."""

    colocated = "colocated"
    separate = "separate"


class StaleGroups(str, Enum):
    """What the producer does about a group that would exceed ``rollout.max_staleness``."""

    drop = "drop"
    wait = "wait"


class RolloutEngineName(str, Enum):
    """Which rollout engine a hybrid worker builds."""

    vllm = "vllm"
    hf = "hf"


@dataclass
class RolloutConfig:
    engine: RolloutEngineName = RolloutEngineName.vllm
    """Rollout engine: vllm (default) or hf (transformers generate, for debugging)."""
    n: int = 4
    """Responses sampled per prompt (the group size for GRPO-style advantages)."""
    max_tokens: int = 256
    """Generation stops at EOS or after this many response tokens."""
    temperature: float = 1.0
    """Sampling temperature; 1.0 keeps rollout log-probs comparable with the trainer's."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may claim for weights and KV cache (cuda only)."""
    cpu_kv_cache_gb: int = 1
    """KV-cache size of each vLLM engine on CPU machines, in whole GiB (VLLM_CPU_KVCACHE_SPACE)."""
    sleep_level: int = 1
    """vLLM sleep during training on cuda: 1 frees the KV cache and offloads weights to CPU RAM,
    2 frees both; a generate that no weight sync precedes then pushes the weights again. vLLM's
    sleep is a no-op on CPU, but level 2 still takes the reload path there."""
    weight_sync_bucket_mb: int = 512
    """Largest bucket of gathered full tensors held at once during the weight sync."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism: this many consecutive ranks on one node hold one engine
    sharded between them and generate the same prompts; must divide the procs_per_node of the
    pool holding the engines (trainer.*, or rollout.* with placement=separate)."""
    expert_parallel: bool = False
    """vLLM expert parallelism (``enable_expert_parallel``) inside each engine: a
    mixture-of-experts layer's experts are spread whole over the engine's
    tensor_parallel_size ranks instead of each rank holding a slice of every expert; attention
    stays tensor-parallel. Needs rollout.engine=vllm, tensor_parallel_size >= 2 and an MoE
    model (checked before Ray). Written for GPU nodes; not run on this project's CPU suite."""
    placement: Placement = Placement.colocated
    """colocated: every training rank also holds a rollout engine and switches between the two
    (one pool, trainer.*). separate: the engines live in a rollout pool of their own
    (rollout.nnodes x rollout.procs_per_node bundles) and receive the weights by broadcast."""
    nnodes: int = 1
    """placement=separate: nodes of the rollout pool."""
    procs_per_node: int = 1
    """placement=separate: rollout processes per node (one GPU each on GPU nodes)."""
    cpus_per_proc: int = 1
    """placement=separate: CPUs of each rollout bundle (OMP threads of its engine on CPU)."""
    worker_cls: str = "workers.rollout_worker.RolloutWorker"
    """placement=separate: dotted path of the rollout pool's worker class."""
    agent: str = "single_turn"
    """How a prompt becomes a response: single_turn (one sample), multi_turn (turns against
    ``agent.env``, observations masked out of the loss), or your own agent as
    ``pkg.module:function`` / ``path/to/file.py:function`` (see rlframe.rollout.agents)."""
    max_staleness: int = 0
    """Asynchronous training: a sample used in an update may have been generated, wholly or
    partly, with weights up to this many versions older than the ones the update starts from.
    0 (default): every sample comes from the current weights (lockstep, on-policy). >= 1: the
    producer keeps generating ahead (rlframe.rollout.producer); see docs/async.md. An agent
    other than single_turn runs each episode whole."""
    stale_groups: StaleGroups = StaleGroups.wait
    """max_staleness >= 1: a group whose oldest token would exceed the bound at its update.
    wait: the trainer waits for such groups to finish and trains on them first (no sample is
    wasted; the step may wait for a long response). drop: the step never waits for them; a
    group over the bound is dropped and its prompt slot refilled (counted in
    off_policy/dropped)."""
    partial_chunk_tokens: int = 0
    """max_staleness >= 1, single_turn: how responses run ahead of the trainer. 0 (default):
    each is a request of the engines' stream; a weight sync (colocated: a step taking its
    batch) ends the requests in flight where they are and continues them on the new weights
    (partial rollouts by abort and continuation), so how far a response got depends on the
    trainer's timing. N > 0: engine calls that add at most N tokens to every response in
    flight, the sync waiting for the call: slower, but a run samples the same every time and
    resumes bit for bit. An episode of another agent is never cut."""
    max_logprob_diff: float | None = None
    """The sync check: the run stops (exit 76) when the engine is not sampling from the trained
    weights. It reads the gap between the engine's and the trainer's log-probs of the tokens
    sampled with the weights the trainer holds (``rollout/logprob_diff``, the mean, and
    ``rollout/logprob_diff_row_max``, the largest row's mean) and a probe scored by both
    after every sync. null (default): thresholds calibrated per run on the honest gap at
    version 0, in the run's dtype (until then 1e-3 in float32 and 0.05 in bfloat16 on the
    mean, plus ln(1/top_p)); a number: a fixed threshold on the mean, in nats; 0: off, the
    probe included. See docs/running.md, "The sync check"."""

    def __post_init__(self) -> None:
        # Dataclasses built in Python (tests, user code) may pass plain strings.
        self.engine = RolloutEngineName(self.engine)
        self.placement = Placement(self.placement)
        self.stale_groups = StaleGroups(self.stale_groups)
        require(
            self.max_staleness >= 0,
            "rollout.max_staleness",
            f"must be >= 0 (weights versions), got {self.max_staleness}",
        )
        require(
            self.partial_chunk_tokens >= 0,
            "rollout.partial_chunk_tokens",
            f"must be >= 0 (0: no partial rollouts), got {self.partial_chunk_tokens}",
        )
        require(
            self.max_logprob_diff is None or self.max_logprob_diff >= 0,
            "rollout.max_logprob_diff",
            f"must be >= 0 nats (0: no sync check; null: by dtype), got {self.max_logprob_diff}",
        )
        # The name is checked against the registry by rlframe.run.preflight.
        self.agent = absolutize(self.agent)
        require(self.n >= 1, "rollout.n", f"must be >= 1 (responses per prompt), got {self.n}")
        require_positive(self.max_tokens, "rollout.max_tokens")
        require(
            self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}"
        )
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        require(
            self.sleep_level in (1, 2),
            "rollout.sleep_level",
            f"must be 1 or 2, got {self.sleep_level}",
        )
        require_positive(self.weight_sync_bucket_mb, "rollout.weight_sync_bucket_mb")
        require_positive(self.tensor_parallel_size, "rollout.tensor_parallel_size")
        require_positive(self.cpu_kv_cache_gb, "rollout.cpu_kv_cache_gb")
        for key in ("nnodes", "procs_per_node", "cpus_per_proc"):
            require_positive(getattr(self, key), f"rollout.{key}")
        require(
            0 < self.gpu_memory_utilization < 1,
            "rollout.gpu_memory_utilization",
            f"must be in (0, 1), got {self.gpu_memory_utilization}",
        )


MAX_ROWS_AHEAD = 65536
"""Responses the asynchronous producer may hold ahead of the trainer: ``(max_staleness + 1)
* data.batch_size * rollout.n`` past it is refused (each holds its token ids and log-probs
in the driver and the rollout worker)."""


def check_async(r: RolloutConfig, batch_size: int, total_steps: int) -> None:
    """The bound must fit the run (``rollout.max_staleness >= 1``): no more versions than
    its steps, no more responses ahead than :data:`MAX_ROWS_AHEAD`, partial responses only
    for ``single_turn`` (other agents' episodes run whole). In lockstep (0) the async-only
    keys are refused."""
    if r.max_staleness == 0:
        require(
            r.partial_chunk_tokens == 0,
            "rollout.partial_chunk_tokens",
            f"has no effect at rollout.max_staleness=0 (lockstep: every request runs whole), "
            f"got {r.partial_chunk_tokens}; set it 0 or rollout.max_staleness >= 1",
        )
        require(
            r.stale_groups == StaleGroups.wait,
            "rollout.stale_groups",
            "has no effect at rollout.max_staleness=0 (no group is ever stale); leave it wait "
            "or set rollout.max_staleness >= 1",
        )
        return
    require(
        r.max_staleness <= total_steps,
        "rollout.max_staleness",
        f"{r.max_staleness} exceeds the run's trainer.total_steps={total_steps}: the producer "
        "would generate for steps that never come",
    )
    ahead = (r.max_staleness + 1) * batch_size * r.n
    require(
        ahead <= MAX_ROWS_AHEAD,
        "rollout.max_staleness",
        f"{r.max_staleness} lets the producer hold (max_staleness + 1) * data.batch_size * "
        f"rollout.n = {ahead} responses ahead, more than {MAX_ROWS_AHEAD}; at most "
        f"{MAX_ROWS_AHEAD // (batch_size * r.n) - 1} here",
    )
    require(
        r.agent == "single_turn" or r.partial_chunk_tokens == 0,
        "rollout.partial_chunk_tokens",
        f"applies to rollout.agent=single_turn (an episode of {r.agent!r} runs whole), got "
        f"{r.partial_chunk_tokens}; set it 0",
    )


def check_sync_gap(r: RolloutConfig, correction: OffPolicyCorrection) -> None:
    """A threshold set for the sync check needs the trainer's log-probs to compare the
    rollout's with; ``algorithm.off_policy_correction=rollout`` uses the rollout's own as the
    old policy, so there is no ``rollout/logprob_diff`` and the check never runs."""
    require(
        not r.max_logprob_diff or correction is not OffPolicyCorrection.rollout,
        "rollout.max_logprob_diff",
        f"{r.max_logprob_diff} cannot be checked with algorithm.off_policy_correction=rollout "
        "(no trainer log-probs, no rollout/logprob_diff); leave it null or set it 0",
    )
