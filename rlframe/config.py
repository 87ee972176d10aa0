"""The config schema: typed dataclasses, the one source of config truth.

Recipes in ``recipes/`` and command-line overrides only change values of this schema.
Hydra/OmegaConf enforce key names and types while composing; ``build_config`` then turns
the composed tree into these plain dataclasses and runs the value and cross-field checks in
``__post_init__``. Every check raises :class:`ConfigError` naming the full key and what is
allowed, so a bad run stops before Ray starts. Workers receive these dataclasses, never a
DictConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from rlframe.algorithms.names import (
    GROUP_RELATIVE,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    MISMATCH_LEVELS,
    NEEDS_CRITIC,
)
from rlframe.algorithms.registry import absolutize
from rlframe.data.tasks import TASK_NAMES

if not OmegaConf.has_resolver("now"):
    # Hydra registers ``now`` too; register it here so the schema resolves outside Hydra.
    from datetime import datetime

    OmegaConf.register_new_resolver("now", lambda pattern: datetime.now().strftime(pattern))


class ConfigError(ValueError):
    """A config value or combination is invalid. ``key`` is the full dotted key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class Device(str, Enum):
    """Where workers run. ``auto`` picks cuda when Ray reports GPUs, else cpu."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"


class RolloutEngineName(str, Enum):
    """Which rollout engine a hybrid worker builds."""

    vllm = "vllm"
    hf = "hf"


def require(ok: bool, key: str, message: str) -> None:
    """Raise ConfigError for ``key`` unless ``ok``."""
    if not ok:
        raise ConfigError(key, message)


def require_positive(value: float, key: str) -> None:
    require(value > 0, key, f"must be > 0, got {value}")


def require_choice(value: str, allowed: tuple[str, ...], key: str) -> None:
    require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")


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

    def __post_init__(self) -> None:
        require_positive(self.lr, "actor.lr")
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
class AlgorithmConfig:
    advantage: str = "grpo"
    """Advantage estimator: a registered name or ``pkg.module:function`` / ``file.py:function``."""
    norm_by_std: bool = True
    """GRPO: divide by the group's reward std. False gives Dr.GRPO."""
    pass_k: int = 4
    """grpo_passk: the k of pass@k that the advantage optimises (at most rollout.n)."""
    gamma: float = 1.0
    """Discount over response tokens (GAE, REINFORCE++)."""
    lam: float = 1.0
    """GAE's lambda: 1 is Monte-Carlo returns minus values, 0 is one-step TD."""
    clip_low: float = 0.2
    """PPO-clip lower range: the ratio is clipped at 1 - clip_low (in [0, 1]). CISPO and GMPO
    use the same range for their IS weight / token ratio."""
    clip_high: float = 0.2
    """PPO-clip upper range: the ratio is clipped at 1 + clip_high (DAPO's clip-higher: 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (loss <= -A * c); <= 1 turns it off."""
    clip_cov_ratio: float = 2e-4
    """clip_cov: share of loss tokens, drawn among those whose covariance lies in
    [clip_cov_lb, clip_cov_ub], whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the centred log-prob x advantage covariance of candidate tokens."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of that covariance."""
    kl_cov_ratio: float = 2e-3
    """kl_cov: share of loss tokens, those of largest covariance, that get the KL penalty."""
    kl_cov_coef: float = 1.0
    """kl_cov: coefficient of |log p - log p_old| on the selected tokens."""
    tis_cap: float = 0.0
    """Truncated importance sampling against the rollout engine's log-probs, weights capped
    at this value (e.g. 2.0); 0 turns the correction off."""
    tis_level: str = "token"
    """token: one weight per token; sequence: one weight per response, the product of its
    token ratios, capped at ``tis_cap``."""
    mismatch_mask: str = "off"
    """Masked IS (IcePop-style rejection): off, token (drop tokens whose trainer/rollout
    ratio is outside [mismatch_low, mismatch_high]) or sequence (drop whole responses whose
    geometric-mean ratio is outside it)."""
    mismatch_low: float = 0.5
    """Lowest trainer/rollout probability ratio kept by ``mismatch_mask``."""
    mismatch_high: float = 2.0
    """Highest trainer/rollout probability ratio kept by ``mismatch_mask``."""
    kl_reward_coef: float = 0.0
    """Coefficient of the KL penalty in the reward; 0 turns it off."""
    kl_reward_estimator: str = "k1"
    """KL estimator for the in-reward penalty (k1, abs, k2, k3)."""
    kl_reward_ctrl: str = "fixed"
    """fixed, or adaptive: the in-reward KL coefficient follows ``kl_target``."""
    kl_target: float = 0.1
    """Adaptive controller: target KL, as the batch mean of each response's per-token mean KL
    (veRL's convention, so targets from veRL recipes carry over)."""
    kl_horizon: int = 10000
    """Adaptive controller: responses over which the coefficient moves by at most 20%."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and sample more prompts until the batch
    is full of groups that carry a signal."""
    max_sampling_rounds: int = 4
    """DAPO: most generation rounds per step; a step that still lacks groups trains on what it has."""
    kl_coef: float = 0.0
    """Coefficient of the KL loss against the reference policy; 0 turns the reference off."""
    kl_estimator: str = "k3"
    """KL estimator for the loss: k1, abs, k2, k3, or k1+ / k3+ (that value, k2's gradient)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""
    policy_loss: str = "ppo_clip"
    """Policy loss: a registered name or ``pkg.module:function`` / ``file.py:function``."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr.GRPO: token sums / loss_agg_norm) or token-sum."""
    loss_agg_norm: int = 0
    """seq-mean-token-sum-norm's constant divisor; 0 means rollout.max_tokens."""

    def __post_init__(self) -> None:
        # Registered names are checked by rlframe.preflight (the registries import torch);
        # file paths are made absolute here so that workers load the same file.
        self.advantage, self.policy_loss = absolutize(self.advantage), absolutize(self.policy_loss)
        require_choice(self.loss_agg, LOSS_AGGREGATIONS, "algorithm.loss_agg")
        require_choice(self.kl_estimator, KL_ESTIMATORS, "algorithm.kl_estimator")
        require_choice(self.kl_reward_estimator, KL_ESTIMATORS[:4], "algorithm.kl_reward_estimator")
        require_choice(self.kl_reward_ctrl, ("fixed", "adaptive"), "algorithm.kl_reward_ctrl")
        require_choice(self.tis_level, MISMATCH_LEVELS, "algorithm.tis_level")
        require_choice(self.mismatch_mask, ("off", *MISMATCH_LEVELS), "algorithm.mismatch_mask")
        require(0 <= self.clip_low <= 1, "algorithm.clip_low", f"must be in [0, 1], got {self.clip_low}")
        require(self.clip_high >= 0, "algorithm.clip_high", f"must be >= 0, got {self.clip_high}")
        for key in ("kl_coef", "kl_reward_coef", "entropy_coef", "kl_cov_coef", "loss_agg_norm"):
            value = getattr(self, key)
            require(value >= 0, f"algorithm.{key}", f"must be >= 0, got {value}")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, key)
            require(0 < value <= 1, f"algorithm.{key}", f"must be in (0, 1], got {value}")
        require(
            self.clip_cov_lb < self.clip_cov_ub,
            "algorithm.clip_cov_ub",
            f"must be above algorithm.clip_cov_lb={self.clip_cov_lb}, got {self.clip_cov_ub}",
        )
        require_positive(self.kl_target, "algorithm.kl_target")
        require_positive(self.kl_horizon, "algorithm.kl_horizon")
        require(self.tis_cap == 0 or self.tis_cap >= 1, "algorithm.tis_cap", f"must be 0 (off) or >= 1, got {self.tis_cap}")
        require(
            0 <= self.mismatch_low < 1 < self.mismatch_high,
            "algorithm.mismatch_low",
            f"need 0 <= mismatch_low < 1 < mismatch_high, got [{self.mismatch_low}, {self.mismatch_high}]",
        )
        require(self.pass_k >= 1, "algorithm.pass_k", f"must be >= 1, got {self.pass_k}")
        require(self.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", f"must be >= 1, got {self.max_sampling_rounds}")
        require(0 <= self.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        require(0 < self.gamma <= 1, "algorithm.gamma", f"must be in (0, 1], got {self.gamma}")

    @property
    def uses_reference(self) -> bool:
        """A reference policy is needed for a KL term in the loss or in the reward."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0


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


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    val: ValConfig = field(default_factory=ValConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        a = self.algorithm
        require(
            self.rollout.n > 1 or a.advantage not in GROUP_RELATIVE,
            "rollout.n",
            f"algorithm.advantage={a.advantage} compares the responses to one prompt: with "
            "rollout.n=1 every advantage is 0 and nothing is learned; set rollout.n >= 2",
        )
        require(
            a.advantage != "grpo_passk" or a.pass_k <= self.rollout.n,
            "algorithm.pass_k",
            f"{a.pass_k} exceeds the responses per prompt, rollout.n = {self.rollout.n}",
        )
        check_batch_sizes(self)
        if a.loss_agg_norm == 0:
            a.loss_agg_norm = self.rollout.max_tokens
        validates = self.trainer.val_every > 0 or self.trainer.val_before_train
        require(
            not validates or bool(self.data.val_files) or (not self.data.train_files and self.data.val_size > 0),
            "data.val_files",
            "validation is on (trainer.val_every / trainer.val_before_train) but there are no validation "
            "prompts: set data.val_files (a held-out split, data.val_size, exists only for synthetic tasks)",
        )
        if self.critic.enable is None:
            self.critic.enable = self.algorithm.advantage in NEEDS_CRITIC
        require(
            self.critic.enable or self.algorithm.advantage not in NEEDS_CRITIC,
            "critic.enable",
            f"algorithm.advantage={self.algorithm.advantage} needs a critic; set critic.enable=true (or null)",
        )


def check_batch_sizes(cfg: Config) -> None:
    """Mini- and micro-batches must tile a step's responses exactly on every rank.

    Padding is fine for generation but not for updates: a padded response would be trained
    on twice. So the step's responses split into whole mini-batches, each mini-batch splits
    evenly across ranks, and each rank's share splits into whole micro-batches.
    """
    responses = cfg.data.batch_size * cfg.rollout.n
    world = cfg.trainer.world_size
    mini, micro = cfg.actor.mini_batch_size, cfg.actor.micro_batch_size
    require(
        responses % mini == 0,
        "actor.mini_batch_size",
        f"{mini} must divide the responses per step, data.batch_size * rollout.n = "
        f"{cfg.data.batch_size} * {cfg.rollout.n} = {responses}",
    )
    require(
        mini % world == 0,
        "actor.mini_batch_size",
        f"{mini} must be a multiple of the number of ranks, trainer.nnodes * "
        f"trainer.procs_per_node = {world}",
    )
    require(
        (mini // world) % micro == 0,
        "actor.micro_batch_size",
        f"{micro} must divide each rank's share of a mini-batch, actor.mini_batch_size / ranks "
        f"= {mini} / {world} = {mini // world}",
    )


def build_config(tree: DictConfig | dict[str, Any]) -> Config:
    """Turn a composed config tree into a validated :class:`Config`.

    Raises:
        ConfigError: for an unknown key, a wrong type, a missing value or an invalid value,
            with the full key in the message.
    """
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), tree)
        cfg = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        cause = e.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        key = getattr(e, "full_key", None) or "config"
        if isinstance(e, MissingMandatoryValue):
            raise ConfigError(key, "has no value: set it with key=value or pick a recipe (+recipe=NAME)") from None
        raise ConfigError(key, first_line(e)) from None
    assert isinstance(cfg, Config)
    return cfg


def first_line(error: BaseException) -> str:
    """OmegaConf errors append a multi-line context block; keep the sentence."""
    return str(error).strip().splitlines()[0]
