"""The ``algorithm`` section: advantage, policy loss, KL, mismatch corrections, DAPO."""

from __future__ import annotations

from dataclasses import dataclass

from rlframe.config.checks import require, require_choice, require_positive
from rlframe.config.rollout import RolloutConfig
from rlframe.core.names import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    MISMATCH_LEVELS,
    OFF_POLICY_CORRECTIONS,
    ROUTER_REPLAYS,
    OffPolicyCorrection,
    RouterReplay,
)
from rlframe.core.registry import absolutize


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
    """DAPO: a finished group whose rewards are all equal is dropped and another prompt
    admitted in its place, so a batch is full of groups that carry a signal."""
    max_sampling_rounds: int = 4
    """DAPO: a step admits at most this many times ``data.batch_size`` prompts (its own and
    the replacements); past that, groups of equal rewards are kept to fill the batch."""
    kl_coef: float = 0.0
    """Coefficient of the KL loss against the reference policy; 0 turns the reference off."""
    kl_estimator: str = "k3"
    """KL estimator for the loss: k1, abs, k2, k3, or k1+ / abs+ / k3+ (that value, k2's
    gradient)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models: coefficient of the router's load-balancing loss (Switch
    Transformer's, averaged over MoE layers; 1 at perfect balance), added to the policy loss
    (HF's MoE configs name it the same; Qwen3-MoE's sets 0.001). 0 leaves it out; above 0 on
    a dense model it is refused before Ray (it would have no effect)."""
    policy_loss: str = "ppo_clip"
    """Policy loss: a registered name or ``pkg.module:function`` / ``file.py:function``."""
    loss_agg: str = "token-mean"
    """Loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum,
    seq-mean-token-sum-norm (Dr.GRPO: token sums / loss_agg_norm) or token-sum."""
    loss_agg_norm: int = 0
    """seq-mean-token-sum-norm's constant divisor; 0 means rollout.max_tokens."""
    recompute_old_logprobs: bool = False
    """Always run the old-log-prob forward pass. Off: a step whose update is one optimizer step
    (actor.epochs=1, one mini-batch per step, no in-reward KL), in lockstep or asynchronous,
    skips it and takes the update's own log-probs, detached, as the old ones (the same numbers:
    the weights before the update)."""
    off_policy_correction: OffPolicyCorrection = OffPolicyCorrection.recompute
    """Which log-probs are the update's old policy. recompute: the trainer's forward pass
    (tis_cap / mismatch_mask correct the rollout gap). rollout: the rollout engine's own, with
    no forward pass. decoupled: AReaL's decoupled PPO, the clip against the recomputed proximal
    policy and each token's loss times pi_prox / pi_rollout (see ``behav_weight_cap``)."""
    router_replay: RouterReplay = RouterReplay.off
    """Mixture-of-experts models: off, or rollout (R3: the rollout engine records the experts
    each token was routed to, and the trainer's log-prob pass and update route every token to
    them; the router's weights of those experts are recomputed, so the router still learns).
    Needs a replayable MoE model (rlframe.models.moe_routing), the single_turn agent in
    lockstep, and an engine that records routing: hf anywhere, vllm on CUDA only."""
    behav_weight_cap: float = 5.0
    """decoupled: tokens whose behaviour weight pi_prox / pi_rollout exceeds this are dropped
    from the loss (AReaL's behav_imp_weight_cap); 0 keeps every token. Must be 0 or > 1."""

    def __post_init__(self) -> None:
        # Registered names are checked by rlframe.run.preflight (the registries import torch);
        # file paths are made absolute here so that workers load the same file.
        self.advantage, self.policy_loss = absolutize(self.advantage), absolutize(self.policy_loss)
        require_choice(self.loss_agg, LOSS_AGGREGATIONS, "algorithm.loss_agg")
        require_choice(self.kl_estimator, KL_ESTIMATORS, "algorithm.kl_estimator")
        require_choice(self.kl_reward_estimator, KL_ESTIMATORS[:4], "algorithm.kl_reward_estimator")
        require_choice(self.kl_reward_ctrl, ("fixed", "adaptive"), "algorithm.kl_reward_ctrl")
        require_choice(self.tis_level, MISMATCH_LEVELS, "algorithm.tis_level")
        require_choice(
            self.off_policy_correction, OFF_POLICY_CORRECTIONS, "algorithm.off_policy_correction"
        )
        self.off_policy_correction = OffPolicyCorrection(self.off_policy_correction)
        require_choice(self.router_replay, ROUTER_REPLAYS, "algorithm.router_replay")
        self.router_replay = RouterReplay(self.router_replay)
        require_choice(self.mismatch_mask, ("off", *MISMATCH_LEVELS), "algorithm.mismatch_mask")
        require(
            0 <= self.clip_low <= 1, "algorithm.clip_low", f"must be in [0, 1], got {self.clip_low}"
        )
        require(self.clip_high >= 0, "algorithm.clip_high", f"must be >= 0, got {self.clip_high}")
        for key in (
            "kl_coef",
            "kl_reward_coef",
            "entropy_coef",
            "kl_cov_coef",
            "loss_agg_norm",
            "router_aux_loss_coef",
        ):
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
        require(
            self.tis_cap == 0 or self.tis_cap >= 1,
            "algorithm.tis_cap",
            f"must be 0 (off) or >= 1, got {self.tis_cap}",
        )
        require(
            0 <= self.mismatch_low < 1 < self.mismatch_high,
            "algorithm.mismatch_low",
            "need 0 <= mismatch_low < 1 < mismatch_high, "
            f"got [{self.mismatch_low}, {self.mismatch_high}]",
        )
        self.check_off_policy_correction()
        require(self.pass_k >= 1, "algorithm.pass_k", f"must be >= 1, got {self.pass_k}")
        require(
            self.max_sampling_rounds >= 1,
            "algorithm.max_sampling_rounds",
            f"must be >= 1, got {self.max_sampling_rounds}",
        )
        require(0 <= self.lam <= 1, "algorithm.lam", f"must be in [0, 1], got {self.lam}")
        require(0 < self.gamma <= 1, "algorithm.gamma", f"must be in (0, 1], got {self.gamma}")

    def check_off_policy_correction(self) -> None:
        """Combinations that contradict the chosen old policy fail before Ray starts."""
        mode = self.off_policy_correction
        rollout = mode is OffPolicyCorrection.rollout
        require(
            self.behav_weight_cap == 0 or self.behav_weight_cap > 1,
            "algorithm.behav_weight_cap",
            f"must be 0 (no cap) or > 1, got {self.behav_weight_cap}",
        )
        mismatch_on = self.tis_cap > 0 or self.mismatch_mask != "off"
        # rollout: old == rollout, so the mismatch ratio is 1 and TIS / masking do nothing.
        # decoupled: its behaviour weight is that same ratio; a second weight would square it.
        require(
            mode is OffPolicyCorrection.recompute or not mismatch_on,
            "algorithm.off_policy_correction",
            f"{mode.value} cannot be combined with algorithm.tis_cap / algorithm.mismatch_mask: "
            + (
                "the old policy is the rollout's, so their ratio is always 1"
                if rollout
                else "decoupled already weights each token by pi_prox / pi_rollout (its cap is "
                "algorithm.behav_weight_cap)"
            )
            + "; set tis_cap=0 and mismatch_mask=off, or off_policy_correction=recompute",
        )
        require(
            not rollout or not self.recompute_old_logprobs,
            "algorithm.off_policy_correction",
            "rollout takes the rollout's log-probs as the old ones and runs no old-log-prob "
            "pass, but algorithm.recompute_old_logprobs=true asks for one: drop one of them",
        )

    @property
    def uses_reference(self) -> bool:
        """A reference policy is needed for a KL term in the loss or in the reward."""
        return self.kl_coef > 0 or self.kl_reward_coef > 0


def check_router_replay_setup(
    router_replay: RouterReplay, rollout: RolloutConfig, sequence_parallel_size: int
) -> None:
    """``algorithm.router_replay=rollout`` where the routing cannot reach the trainer whole:
    rows rebuilt by an agent (they carry no routing yet), responses continued over calls of
    different weights (partial rollouts), tokens split across a sequence-parallel group, vLLM
    log-probs of another meaning, or a vLLM engine over several ranks."""
    if router_replay is RouterReplay.off:
        return
    agent, partial_chunk_tokens = rollout.agent, rollout.partial_chunk_tokens
    engine, top_p = rollout.engine.value, rollout.top_p
    key, why = "algorithm.router_replay", "rollout carries each token's routing"
    require(
        agent == "single_turn",
        key,
        f"{why} in single_turn rows only; rollout.agent={agent} rebuilds its rows without it",
    )
    # A continued response's prefix is routed again by the newer weights of its next call:
    # no one routing of it is what sampled every token. Whole responses (lockstep, or
    # asynchronous without partial rollouts) have one.
    require(
        partial_chunk_tokens == 0,
        key,
        f"{why} of responses sampled whole; rollout.partial_chunk_tokens="
        f"{partial_chunk_tokens} continues them over calls that may run on newer weights "
        "(routing their prefix again): set it 0",
    )
    require(
        sequence_parallel_size == 1,
        key,
        f"rollout does not split routing over actor.sequence_parallel_size="
        f"{sequence_parallel_size} yet; set it 1",
    )
    # vLLM returns routing only from Model Runner V2, whose processed log-probs are taken
    # before top-p (V1's, which the rest of rlframe reads, after it).
    require(
        engine != "vllm" or top_p == 1.0,
        key,
        f"rollout with rollout.engine=vllm runs Model Runner V2, whose log-probs ignore "
        f"top-p: set rollout.top_p=1 (got {top_p})",
    )
    # vLLM keeps the captured routing on the first rank of a tensor-parallel group; under
    # external_launcher every rank schedules, and the others' schedulers assert at the first
    # token (read in vLLM 0.32's source; a GPU-only path).
    require(
        engine != "vllm" or (rollout.tensor_parallel_size == 1 and not rollout.expert_parallel),
        key,
        f"rollout with rollout.engine=vllm records routing on one rank per engine: "
        f"rollout.tensor_parallel_size={rollout.tensor_parallel_size} and "
        f"rollout.expert_parallel={rollout.expert_parallel} spread an engine over several; "
        "set tensor_parallel_size=1",
    )
