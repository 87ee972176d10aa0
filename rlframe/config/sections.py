"""The schema's sections other than ``algorithm`` (see :mod:`rlframe.config.algorithm`) and
``reward`` (see :mod:`rlframe.config.reward`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from rlframe.config.checks import require, require_choice, require_positive
from rlframe.config.lora import LoraConfig
from rlframe.core.names import TASK_NAMES


class Device(str, Enum):
    """Where workers run. ``auto`` picks cuda when Ray reports GPUs, else cpu."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    """Prompt files (parquet or jsonl). Empty means the synthetic task in ``data.task``."""
    task: str = "arithmetic"
    """Synthetic verifiable task used when ``data.train_files`` is empty."""
    batch_size: int = 8
    """Prompts per training step. Each prompt yields ``rollout.n`` responses."""
    max_prompt_length: int = 256
    """Prompts longer than this many tokens are dropped from the data set."""
    val_files: list[str] = field(default_factory=list)
    """Validation prompt files (parquet or jsonl, same columns as train files). Empty: with a
    synthetic task and ``data.val_size`` > 0, a held-out split of the task."""
    val_size: int = 64
    """Synthetic tasks without ``data.val_files``: prompts held out of training for validation."""

    def __post_init__(self) -> None:
        require_positive(self.batch_size, "data.batch_size")
        require_positive(self.max_prompt_length, "data.max_prompt_length")
        if not self.train_files:
            require_choice(self.task, TASK_NAMES, "data.task")
        require(self.val_size >= 0, "data.val_size", f"must be >= 0, got {self.val_size}")


@dataclass
class ActorConfig:
    worker_cls: str = "workers.hybrid.HybridWorker"
    """Dotted path of the actor/rollout/reference worker class (swap in your own subclass)."""
    lr: float = 1e-6
    """AdamW learning rate."""
    mini_batch_size: int = 32
    """Responses per optimizer step, across all ranks. Must divide the step's responses."""
    micro_batch_size: int = 4
    """Responses per forward/backward on one rank (gradient accumulation unit)."""
    epochs: int = 1
    """Passes over each step's responses (PPO epochs)."""
    grad_clip: float = 1.0
    """Max global gradient norm; <= 0 turns clipping off."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up."""
    lr_schedule: str = "constant"
    """After warm-up: constant, or cosine decay to 10% over the run's optimizer steps."""
    offload: bool = False
    """cuda only: move FSDP parameters and optimizer state to CPU RAM while vLLM generates."""
    logprob_chunk_size: int = 0
    """Tokens sent through the LM head at a time for log-probs and entropy, each chunk's
    logits recomputed in the backward pass: extra peak memory O(chunk x vocab) instead of
    O(tokens x vocab), for one more head matmul. 0 = off (all tokens at once, logits kept)."""
    pack_sequences: bool | None = None
    """Pack a micro-batch's rows into one sequence without padding (positions restart per
    row, no attention mask: transformers builds the block-diagonal mask). false: one padded
    row per response. null: packed where the engine runs flash-attention 2 (varlen kernels),
    padded elsewhere: with sdpa the block-diagonal mask still costs attention over the whole
    packed length, which loses to padded rows on short responses (measured on CPU)."""
    max_tokens_per_micro_batch: int = 0
    """> 0: micro-batches are filled with rows up to this many tokens (prompt + response;
    the padded width when rows are not packed) instead of ``micro_batch_size`` rows.
    Must hold the longest row, data.max_prompt_length + rollout.max_tokens. 0 = off.
    Under sequence parallelism the budget is a rank's share: a group of S ranks takes rows
    of up to S times as many tokens."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism of the policy and the reference: groups of this many
    consecutive ranks share each micro-batch, every rank holding a contiguous slice of the
    sequence (an all-to-all around attention trades it for a slice of the heads). Ranks form
    a data x sequence mesh of (world / S) x S; the batch-size keys keep their meaning per
    data-parallel group. Must divide the ranks and the model's attention heads. Training
    only: the rollout is unaffected."""
    expert_parallel_size: int = 1
    """Expert parallelism of the policy's training (a mixture-of-experts model): groups of
    this many consecutive ranks split each MoE layer's routed experts, every rank holding
    experts / E of them whole (their gradients and optimizer state too), and each token is
    sent (all-to-all) to the rank that holds its expert and back. Dense parameters stay
    FSDP2-sharded over all ranks. Must divide the ranks and the model's experts per layer;
    not with LoRA or sequence parallelism yet (docs/moe.md). Checkpoints
    hold the whole experts and resume at any expert-parallel size.
    The reference, if any, is built the same way. 1 = off."""

    def __post_init__(self) -> None:
        require_positive(self.lr, "actor.lr")
        require_positive(self.sequence_parallel_size, "actor.sequence_parallel_size")
        require_positive(self.expert_parallel_size, "actor.expert_parallel_size")
        require(
            self.logprob_chunk_size >= 0,
            "actor.logprob_chunk_size",
            f"must be >= 0 (0 = off), got {self.logprob_chunk_size}",
        )
        require(
            self.max_tokens_per_micro_batch >= 0,
            "actor.max_tokens_per_micro_batch",
            f"must be >= 0 (0 = off), got {self.max_tokens_per_micro_batch}",
        )
        require(
            self.lr_schedule in ("constant", "cosine"),
            "actor.lr_schedule",
            f"must be constant or cosine, got {self.lr_schedule!r}",
        )
        require(
            self.warmup_steps >= 0, "actor.warmup_steps", f"must be >= 0, got {self.warmup_steps}"
        )
        require_positive(self.mini_batch_size, "actor.mini_batch_size")
        require_positive(self.micro_batch_size, "actor.micro_batch_size")
        require(self.epochs >= 1, "actor.epochs", f"must be >= 1, got {self.epochs}")

    def updates_in_one_pass(self, rows: int) -> bool:
        """True when an update over ``rows`` responses (all ranks) is one optimizer step of
        one epoch: it starts from the weights the responses were scored with, so its own
        log-probs (detached) are the old log-probs and need no pass of their own."""
        return self.epochs == 1 and rows <= self.mini_batch_size


@dataclass
class CriticConfig:
    """The value model for PPO/GAE.

    Batching: the critic has no batch-size keys of its own. It updates on the same rows as
    the actor, split the same way: ``actor.mini_batch_size``, ``actor.micro_batch_size`` (or
    ``actor.max_tokens_per_micro_batch``), ``actor.epochs`` and ``actor.pack_sequences``
    apply to the critic too.
    """

    enable: bool | None = None
    """Train a value model. null: on exactly when the advantage estimator needs values (gae)."""
    worker_cls: str = "workers.critic.CriticWorker"
    """Dotted path of the critic worker class."""
    lr: float = 1e-5
    """AdamW learning rate of the critic."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    grad_clip: float = 1.0
    """Max global gradient norm of the critic; <= 0 turns clipping off."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear learning-rate warm-up for the critic."""
    actor_wait_steps: int = 0
    """Training steps at the start in which only the critic learns: the actor neither
    updates nor syncs its weights (formerly ``critic.warmup_steps``, a name that read as
    learning-rate warm-up; that is ``critic.lr_warmup_steps``)."""
    cliprange_value: float = 0.5
    """Clipped value loss: new values may move this far from the old ones before the loss
    stops rewarding it."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Adapters on the critic's backbone (its value head always trains in full). Off by
    default: ``model.lora`` applies to the policy only, the critic trains in full."""
    sequence_parallel_size: int = 1
    """Ulysses sequence parallelism of the critic (see ``actor.sequence_parallel_size``)."""
    expert_parallel_size: int = 1
    """Expert parallelism of a mixture-of-experts critic (see ``actor.expert_parallel_size``):
    groups of this many consecutive ranks split each MoE layer's routed experts. Must divide
    the ranks and the model's experts per layer; not with ``critic.lora`` or
    ``critic.sequence_parallel_size`` > 1. 1 = off."""

    def __post_init__(self) -> None:
        require_positive(self.lr, "critic.lr")
        require_positive(self.sequence_parallel_size, "critic.sequence_parallel_size")
        require_positive(self.expert_parallel_size, "critic.expert_parallel_size")
        require(
            self.actor_wait_steps >= 0,
            "critic.actor_wait_steps",
            f"must be >= 0, got {self.actor_wait_steps}",
        )
        require_positive(self.cliprange_value, "critic.cliprange_value")


@dataclass
class TrainerConfig:
    total_steps: int = 100
    """Training steps to run."""
    output_dir: str = "outputs/${now:%Y-%m-%d_%H-%M-%S}"
    """Run directory: resolved config, metrics.jsonl, sample rollouts, checkpoints."""
    seed: int = 0
    """Seed for data order, sampling and model initialisation."""
    nnodes: int = 1
    """Nodes to place workers on."""
    procs_per_node: int = 1
    """Worker processes per node: one per GPU on GPU nodes, one per bundle of CPUs on CPU nodes."""
    cpus_per_proc: int = 1
    """CPUs reserved per worker process (the size of a CPU bundle)."""
    device: Device = Device.auto
    """auto, cuda or cpu. auto picks cuda when the Ray cluster has GPUs."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Metric sinks: console (one line per step), jsonl (metrics.jsonl), tensorboard
    (``<output_dir>/tensorboard``), wandb."""
    project: str = "rlframe"
    """Project name for wandb."""
    experiment: str = "run"
    """Run name for wandb."""
    rollouts_to_log: int = 4
    """Sample rollouts written to rollouts.jsonl each step."""
    save_every: int = 0
    """Save a checkpoint every this many steps (and after the last step); 0 never saves."""
    keep_last: int = 2
    """Checkpoints kept in ``<output_dir>/checkpoints``; older ones are deleted after a save."""
    resume: str = "auto"
    """auto: continue from the latest checkpoint in ``output_dir`` if there is one; never: start
    fresh (an ``output_dir`` that already holds a run is then an error); or a checkpoint path."""
    resume_changes: str = "refuse"
    """Resuming with a changed model.path, critic on/off or algorithm family (critic-based vs
    critic-free advantage): ``refuse`` stops with one line; ``allow`` resumes anyway. Other
    changed keys are printed and accepted."""
    export_hf: bool = False
    """Also write a Hugging Face model (safetensors, config, tokenizer) into each checkpoint."""
    val_every: int = 0
    """Run validation every this many steps (and after the last step); 0 turns it off."""
    val_before_train: bool = False
    """Run validation once before the first step (logged at step 0)."""
    log_level: str = "warning"
    """Console threshold: debug, info, warning or error. Everything at INFO and above (DEBUG
    with debug) also goes to the files under ``<output_dir>/logs/``."""

    def __post_init__(self) -> None:
        self.device = Device(self.device)
        require(
            self.save_every >= 0,
            "trainer.save_every",
            f"must be >= 0 (0 never saves), got {self.save_every}",
        )
        require(self.keep_last >= 1, "trainer.keep_last", f"must be >= 1, got {self.keep_last}")
        require(
            self.val_every >= 0,
            "trainer.val_every",
            f"must be >= 0 (0 turns it off), got {self.val_every}",
        )
        require(
            self.resume_changes in ("refuse", "allow"),
            "trainer.resume_changes",
            f"must be refuse or allow, got {self.resume_changes!r}",
        )
        require(
            self.resume in ("auto", "never") or bool(self.resume.strip()),
            "trainer.resume",
            "must be auto, never or a checkpoint path",
        )
        require(
            self.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {self.total_steps}"
        )
        require(self.nnodes >= 1, "trainer.nnodes", f"must be >= 1, got {self.nnodes}")
        require(
            self.procs_per_node >= 1,
            "trainer.procs_per_node",
            f"must be >= 1, got {self.procs_per_node}",
        )
        require(
            self.cpus_per_proc >= 1,
            "trainer.cpus_per_proc",
            f"must be >= 1, got {self.cpus_per_proc}",
        )
        levels = ("debug", "info", "warning", "error")
        require(
            self.log_level in levels,
            "trainer.log_level",
            f"must be one of {levels}, got {self.log_level!r}",
        )
        sinks = ("console", "jsonl", "tensorboard", "wandb")
        unknown = [x for x in self.loggers if x not in sinks]
        require(not unknown, "trainer.loggers", f"unknown {unknown}; choose from {sinks}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node


@dataclass
class ValConfig:
    n: int = 1
    """Responses sampled per validation prompt (k of pass@k runs over powers of 2 up to n)."""
    temperature: float = 0.0
    """Sampling temperature for validation; 0 is greedy."""
    pass_threshold: float = 1.0
    """A response counts as correct for pass@k when its score is at least this."""

    def __post_init__(self) -> None:
        require(self.n >= 1, "val.n", f"must be >= 1, got {self.n}")
        require(
            self.temperature >= 0,
            "val.temperature",
            f"must be >= 0 (0 is greedy), got {self.temperature}",
        )


@dataclass
class RayConfig:
    address: str | None = None
    """Cluster to join: null starts a local Ray (or joins RAY_ADDRESS if set); ``auto`` joins a
    running cluster; ``ray://host:10001`` connects a client."""
    num_cpus: int | None = None
    """CPUs the local Ray advertises when it is started here (null: all of this machine's)."""
    include_dashboard: bool = False
    """Start the dashboard with a local Ray. It listens on 127.0.0.1 only."""
    call_timeout_s: float = 3600.0
    """Longest wait for one worker call before it is reported as hung."""
    placement_timeout_s: float = 600.0
    """Longest wait for the workers' resources when the cluster could provide them later (in
    use, or an autoscaler adding nodes). A request no node could ever hold fails at once."""

    def __post_init__(self) -> None:
        require_positive(self.call_timeout_s, "ray.call_timeout_s")
        require_positive(self.placement_timeout_s, "ray.placement_timeout_s")
