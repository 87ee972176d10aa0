"""The schema's sections other than ``algorithm`` (see :mod:`rlframe.config.algorithm`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from omegaconf import MISSING

from rlframe.algorithms.registry import absolutize
from rlframe.config.checks import require, require_choice, require_positive
from rlframe.data.tasks import TASK_NAMES


class Device(str, Enum):
    """Where workers run. ``auto`` picks cuda when Ray reports GPUs, else cpu."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class RolloutEngineName(str, Enum):
    """Which rollout engine a hybrid worker builds."""

    vllm = "vllm"
    hf = "hf"



@dataclass
class ModelConfig:
    path: str = MISSING
    """HF model id or local directory loaded with ``from_pretrained`` by the workers."""
    dtype: str = "auto"
    """Training parameter dtype: auto (bf16 on cuda, fp32 on cpu), float32 or bfloat16."""
    trust_remote_code: bool = False
    """Passed to transformers when loading the model and tokenizer."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""

    def __post_init__(self) -> None:
        allowed = ("auto", "float32", "bfloat16")
        require(self.dtype in allowed, "model.dtype", f"must be one of {allowed}, got {self.dtype!r}")


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
    2 frees both (weights are re-sent by the sync). No-op on CPU."""
    weight_sync_bucket_mb: int = 512
    """Largest bucket of gathered full tensors held at once during the weight sync."""

    def __post_init__(self) -> None:
        # Dataclasses built in Python (tests, user code) may pass plain strings.
        self.engine = RolloutEngineName(self.engine)
        require(self.n >= 1, "rollout.n", f"must be >= 1 (responses per prompt), got {self.n}")
        require_positive(self.max_tokens, "rollout.max_tokens")
        require(self.temperature >= 0, "rollout.temperature", f"must be >= 0, got {self.temperature}")
        require(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p}")
        require(self.sleep_level in (1, 2), "rollout.sleep_level", f"must be 1 or 2, got {self.sleep_level}")
        require_positive(self.weight_sync_bucket_mb, "rollout.weight_sync_bucket_mb")
        require_positive(self.cpu_kv_cache_gb, "rollout.cpu_kv_cache_gb")
        require(
            0 < self.gpu_memory_utilization < 1,
            "rollout.gpu_memory_utilization",
            f"must be in (0, 1), got {self.gpu_memory_utilization}",
        )


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
    Must hold the longest row, data.max_prompt_length + rollout.max_tokens. 0 = off."""

    def __post_init__(self) -> None:
        require_positive(self.lr, "actor.lr")
        require(self.logprob_chunk_size >= 0, "actor.logprob_chunk_size", f"must be >= 0 (0 = off), got {self.logprob_chunk_size}")
        require(
            self.max_tokens_per_micro_batch >= 0,
            "actor.max_tokens_per_micro_batch",
            f"must be >= 0 (0 = off), got {self.max_tokens_per_micro_batch}",
        )
        require(self.lr_schedule in ("constant", "cosine"), "actor.lr_schedule", f"must be constant or cosine, got {self.lr_schedule!r}")
        require(self.warmup_steps >= 0, "actor.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require_positive(self.mini_batch_size, "actor.mini_batch_size")
        require_positive(self.micro_batch_size, "actor.micro_batch_size")
        require(self.epochs >= 1, "actor.epochs", f"must be >= 1, got {self.epochs}")


@dataclass
class CriticConfig:
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
    warmup_steps: int = 0
    """Training steps at the start in which only the critic learns (the actor waits)."""
    cliprange_value: float = 0.5
    """Clipped value loss: new values may move this far from the old ones before the loss stops rewarding it."""

    def __post_init__(self) -> None:
        require_positive(self.lr, "critic.lr")
        require(self.warmup_steps >= 0, "critic.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require_positive(self.cliprange_value, "critic.cliprange_value")



@dataclass
class RewardConfig:
    overlong_buffer: int = 0
    """DAPO overlong shaping: responses longer than rollout.max_tokens - overlong_buffer lose
    up to ``overlong_penalty``, linearly over the buffer; 0 turns it off."""
    overlong_penalty: float = 1.0
    """Penalty at rollout.max_tokens (overlong shaping)."""
    fn: str = "auto"
    """Reward function: a registered name (char_match, exact_match, math_answer), your own as
    ``pkg.module:function`` / ``path/to/file.py:function``, or ``auto``: char_match for the
    synthetic tasks, exact_match for prompt files."""

    def __post_init__(self) -> None:
        # The name is checked against the registry by rlframe.preflight.
        self.fn = absolutize(self.fn)
        require_positive(self.overlong_penalty, "reward.overlong_penalty")
        require(self.overlong_buffer >= 0, "reward.overlong_buffer", f"must be >= 0, got {self.overlong_buffer}")


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
    """Metric sinks: console (one line per step), jsonl (metrics.jsonl), wandb."""
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
    export_hf: bool = False
    """Also write a Hugging Face model (safetensors, config, tokenizer) into each checkpoint."""
    val_every: int = 0
    """Run validation every this many steps (and after the last step); 0 turns it off."""
    val_before_train: bool = False
    """Run validation once before the first step (logged at step 0)."""

    def __post_init__(self) -> None:
        self.device = Device(self.device)
        require(self.save_every >= 0, "trainer.save_every", f"must be >= 0 (0 never saves), got {self.save_every}")
        require(self.keep_last >= 1, "trainer.keep_last", f"must be >= 1, got {self.keep_last}")
        require(self.val_every >= 0, "trainer.val_every", f"must be >= 0 (0 turns it off), got {self.val_every}")
        require(
            self.resume in ("auto", "never") or bool(self.resume.strip()),
            "trainer.resume",
            "must be auto, never or a checkpoint path",
        )
        require(self.total_steps >= 1, "trainer.total_steps", f"must be >= 1, got {self.total_steps}")
        require(self.nnodes >= 1, "trainer.nnodes", f"must be >= 1, got {self.nnodes}")
        require(
            self.procs_per_node >= 1,
            "trainer.procs_per_node",
            f"must be >= 1, got {self.procs_per_node}",
        )
        require(self.cpus_per_proc >= 1, "trainer.cpus_per_proc", f"must be >= 1, got {self.cpus_per_proc}")
        sinks = ("console", "jsonl", "wandb")
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
        require(self.temperature >= 0, "val.temperature", f"must be >= 0 (0 is greedy), got {self.temperature}")


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

    def __post_init__(self) -> None:
        require_positive(self.call_timeout_s, "ray.call_timeout_s")

