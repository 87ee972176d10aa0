"""transformers ``generate`` as a rollout engine: slow, but runs any HF model; for debugging."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from rlframe.rollout.turns import ABORTED, ScoredTokens, score_with_model
from workers.inference.base import RolloutSample, SamplingSpec
from workers.model_hooks.router_replay import RoutingRecorder
from workers.model_hooks.weight_names import ModelSlots


class HFRollout:
    """``sleep_level`` as in vLLM: 1 keeps the weights across a sleep (nothing to free on a
    host), 2 frees them; the next ``wake_up`` allocates uninitialised storage that only
    ``load_weights`` makes valid again, the contract vLLM's level 2 has on a GPU."""

    def __init__(
        self,
        path: str,
        device: str,
        dtype: torch.dtype,
        trust_remote_code: bool = False,
        sleep_level: int = 1,
        record_routing: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
        self.model.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) types `to` unbound
        self.device = device
        self.discards_weights_on_sleep = sleep_level == 2
        self.shapes: dict[str, torch.Size] = {}
        # Forward hooks on the MoE routers: every sample then carries its routed experts.
        self.recorder = RoutingRecorder(self.model) if record_routing else None
        self.queued: deque[tuple[str, list[int], int, SamplingSpec]] = deque()
        """Streamed requests not served yet (``step`` serves one, whole)."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        spec: SamplingSpec,
        images: list[list[bytes]] | None = None,
    ) -> list[RolloutSample]:
        if images and any(images):
            raise NotImplementedError("rollout.engine=hf samples text prompts only: use vllm")
        return [
            self.generate_one(p, s, spec.for_row(i))
            for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
        ]

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        seed: int,
        spec: SamplingSpec,
        images: list[bytes] | None = None,
    ) -> None:
        if images:
            raise NotImplementedError("rollout.engine=hf samples text prompts only: use vllm")
        self.queued.append((request_id, prompt, seed, spec))

    @torch.no_grad()
    def step(self) -> list[tuple[str, RolloutSample]]:
        """No continuous batching here (a debugging engine): one queued request, whole."""
        if not self.queued:
            return []
        request_id, prompt, seed, spec = self.queued.popleft()
        if spec.score_from is not None:
            scored = self.score(prompt, spec.score_from, spec.top_k)
            return [(request_id, RolloutSample([], [], "length", None, -1, scored))]
        return [(request_id, self.generate_one(prompt, seed, spec))]

    def has_unfinished(self) -> bool:
        return bool(self.queued)

    def abort(self) -> list[tuple[str, RolloutSample]]:
        """Every queued request, with nothing sampled: ``step`` serves one whole, so none
        is part-way between two calls."""
        aborted = [(request_id, RolloutSample([], [], ABORTED)) for request_id, *_ in self.queued]
        self.queued.clear()
        return aborted

    def generate_one(self, prompt: list[int], seed: int, spec: SamplingSpec) -> RolloutSample:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        if self.recorder is not None:
            self.recorder.clear()  # what other forwards (the sync probe) routed
        ids = torch.tensor([prompt], device=self.device)
        response: list[int] = []
        logprobs: list[float] = []
        past = None
        for _ in range(spec.max_tokens):
            out = self.model(
                input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True
            )
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            logp = torch.log_softmax(
                logits / spec.temperature if spec.temperature > 0 else logits, -1
            )
            token = sample_token(logp, spec, generator)
            response.append(token)
            logprobs.append(float(logp[token]))
            ids = torch.cat([ids, torch.tensor([[token]], device=self.device)], dim=1)
            if token in spec.stop_token_ids:
                return self.build_sample(response, logprobs, "stop")
        return self.build_sample(response, logprobs, "length")

    def build_sample(
        self, response: list[int], logprobs: list[float], reason: str
    ) -> RolloutSample:
        """The sample, with the routing of the prompt and every response token but the last
        (the one forward per token made: the prefill, then one per decoding step)."""
        routing = self.recorder.take() if self.recorder is not None else None
        return RolloutSample(response, logprobs, reason, routing)

    @torch.no_grad()
    def compute_prompt_logprobs(self, ids: list[int]) -> list[float]:
        """Log-probs of ``ids[1:]`` given their prefixes (temperature 1): the sync probe."""
        return self.score(ids, 1, 0).logprobs

    def score(self, ids: list[int], start: int, top_k: int) -> ScoredTokens:
        """Log-probs of ``ids[start:]`` given their prefixes (temperature 1), and the
        ``top_k`` most likely tokens at each of those positions."""
        return score_with_model(self.model, ids, start, top_k)

    def describe_weights(self) -> str:
        return "the weights loaded last"

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        # Built on every load: sleep level 2 replaces the parameters' storage.
        slots = ModelSlots(self.model)
        for name, tensor in weights:
            slots.load(name, tensor)

    def sleep(self) -> None:
        if not self.discards_weights_on_sleep or self.shapes:
            return
        # named_parameters() yields a tied weight once, so ties survive the re-allocation.
        for name, param in self.model.named_parameters():
            self.shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.shapes or (tags is not None and "weights" not in tags):
            return
        for name, param in self.model.named_parameters():
            param.data = torch.empty(self.shapes[name], dtype=param.dtype, device=param.device)
        self.shapes = {}


def sample_token(logp: torch.Tensor, spec: SamplingSpec, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else nucleus sampling from ``logp``."""
    if spec.temperature == 0:
        return int(logp.argmax())
    probs = logp.exp()
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(0) - sorted_probs < spec.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
