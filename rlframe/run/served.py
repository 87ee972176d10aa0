"""Frozen models served beside the policy (teachers, judges), and the request streams into them.

Each is a group of rollout workers built from the model's own folder and never synced, with
an :class:`~rlframe.rollout.engine_client.EngineClient` over its replicas: the driver (the
distillation stage, a judge client) sends it :class:`~rlframe.rollout.turns.TurnRequest` s,
scoring ones (``score_from``) or sampled ones, exactly as agents use the policy's stream.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlframe.config import Config
from rlframe.config.lora import LoraConfig
from rlframe.config.served import ServedModelConfig, ServedPlacement, ServedSpec
from rlframe.core.names import RouterReplay
from rlframe.rollout.engine_client import EngineClient, connect_ray_replicas

if TYPE_CHECKING:
    from rlframe.controller import roles
    from rlframe.core.tokenizer import Tokenizer
    from rlframe.judges.stage import JudgeStage

SERVED_WORKER_CLS = "workers.rollout_worker.RolloutWorker"
"""A served model's worker: the separate placement's rollout worker, never synced."""


def derive_served_config(cfg: Config, serving: ServedModelConfig, path: str) -> Config:
    """The config a served model's rollout worker is built with: the run's, with the model,
    the engine and its size replaced, and nothing that belongs to the policy (LoRA adapters,
    routing capture, sleep level 2, which would discard weights no sync restores). Built by
    copy, not by ``replace``: the result is a worker's view, not a run config to check."""
    derived = copy.deepcopy(cfg)
    derived.model.path = path
    derived.model.lora = LoraConfig()
    derived.algorithm.router_replay = RouterReplay.off
    r = derived.rollout
    r.engine = serving.engine
    r.tensor_parallel_size = serving.tensor_parallel_size
    r.expert_parallel = False
    r.gpu_memory_utilization = serving.gpu_memory_utilization
    r.sleep_level = 1
    if serving.max_model_len:
        # The engine's length is prompt + response width: the whole budget is the "prompt".
        derived.data.max_prompt_length = serving.max_model_len - 1
        r.max_tokens, r.agent = 1, "single_turn"
    return derived


@dataclass
class ServedModel:
    """A served model's workers and the stream into them."""

    spec: ServedSpec
    group: roles.RolloutGroup
    client: EngineClient

    def sleep(self) -> None:
        """Free the device for training (colocated; the next :meth:`EngineClient.open`
        wakes it). A served model of its own pool stays awake."""
        if self.spec.serving.placement is ServedPlacement.colocated:
            self.group.submit("sleep").result()

    def close(self) -> None:
        self.client.close()


def connect_served(spec: ServedSpec, group: roles.RolloutGroup, cfg: Config) -> ServedModel:
    """The stream into ``group``'s replicas; opening it wakes a sleeping engine."""
    tp, timeout = spec.serving.tensor_parallel_size, cfg.ray.call_timeout_s
    replicas = connect_ray_replicas(group.role, group.actors, tp, timeout)
    return ServedModel(spec, group, EngineClient(replicas, group.open_stream))


def build_judge_stage(cfg: Config, served: dict[str, ServedModel], path: str) -> JudgeStage | None:
    """The reward stage's judge (``reward.judge``) over the served ``judge``, with the
    judge's own tokenizer (from ``path``, its folder) and its stop ids; None without one."""
    from rlframe.judges.client import JudgeClient
    from rlframe.judges.stage import JudgeStage

    judge = served.get("judge")
    if judge is None:
        return None
    tokenizer = load_judge_tokenizer(path, cfg.model.trust_remote_code)
    client = JudgeClient(judge.client, tokenizer, cfg.reward.judge, read_stop_ids(path, tokenizer))
    retry = cfg.reward.retry_on_error
    if judge.spec.serving.placement is ServedPlacement.colocated:
        return JudgeStage(client, judge.sleep, judge.client.open, retry)
    return JudgeStage(client, retry=retry)  # its own pool: awake throughout


def load_judge_tokenizer(path: str, trust_remote_code: bool) -> Tokenizer:
    from transformers import AutoTokenizer

    from rlframe.core.tokenizer import as_tokenizer

    return as_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def read_stop_ids(path: str, tokenizer: Tokenizer) -> tuple[int, ...]:
    """What ends the judge's verdict: its tokenizer's EOS and its generation config's EOS ids
    (an instruct model's end-of-turn token: Qwen's ``<|im_end|>``)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
