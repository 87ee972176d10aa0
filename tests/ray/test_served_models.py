"""A frozen model served on rollout workers of its own (a teacher, a judge): scoring requests
through the request stream read the model's log-probs of given tokens and its top-k, as a
transformers forward of the same folder does; a colocated one sleeps and wakes."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from rlframe.config import Config
from rlframe.config.served import ServedModelConfig, ServedPlacement
from rlframe.config.served_models import ServedSpec
from rlframe.rollout.served import connect_served, derive_served_config
from rlframe.rollout.turns import TurnRequest, TurnResult, build_score_request
from tests.ray.factories import TinyGroups, tiny_config

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

TOP_K = 3


def read_with_transformers(path: str, ids: list[int], start: int) -> tuple[list[float], Any]:
    """The training stack's reading of ``ids[start:]``: log-probs and top-k ids/log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, start - 1 : -1]
    logp = torch.log_softmax(logits.float(), -1)
    given = logp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
    return given.tolist(), logp.topk(TOP_K, -1)


@pytest.mark.parametrize("engine", ["vllm", pytest.param("hf", marks=pytest.mark.matrix)])
def test_served_model_scores_given_tokens_as_transformers_does(
    engine: str, tiny_model_path: str
) -> None:
    """Two replicas of a served tiny model score six sequences (and sample a turn beside
    them): each token's log-prob within 1e-4 of a transformers forward in fp32, the same
    top-k ids in order. A reading shifted by one position is off by nats, not 1e-4."""
    cfg = tiny_config(world=2)
    serving = ServedModelConfig(placement=ServedPlacement.separate, procs_per_node=2, engine=engine)
    spec = ServedSpec("teacher", tiny_model_path, "distill", "distill.teacher", serving)
    groups = TinyGroups(tiny_model_path)
    try:
        from workers.rollout_worker import RolloutWorker

        derived = derive_served_config(cfg, serving, tiny_model_path)
        group = groups(derived, RolloutWorker, role="teacher", world=2)
        served = connect_served(spec, group, cfg)  # type: ignore[arg-type]
        sequences = [[1 + (3 * i + j) % 40 for j in range(8 + i)] for i in range(6)]
        starts = [3 + i % 4 for i in range(6)]
        futures: list[Future[TurnResult]] = [
            served.client.submit(build_score_request(ids, s, TOP_K), f"row{i}")
            for i, (ids, s) in enumerate(zip(sequences, starts, strict=True))
        ]
        sampled = served.client.submit(TurnRequest([1, 2, 3], 7, 4, ()), "episode")
        results = [f.result(timeout=300) for f in futures]
        assert len(sampled.result(timeout=300).ids) == 4
        assert {r.rank for r in results} == {0, 1}  # both replicas served
        worst = 0.0
        for ids, start, result in zip(sequences, starts, results, strict=True):
            assert result.scored is not None
            expected, top = read_with_transformers(tiny_model_path, ids, start)
            got = torch.tensor(result.scored.logprobs)
            assert got.shape == (len(ids) - start,)
            worst = max(worst, float((got - torch.tensor(expected)).abs().max()))
            assert result.scored.top_ids == top.indices.tolist()
            gap = torch.tensor(result.scored.top_logprobs) - top.values
            assert float(gap.abs().max()) < 1e-4
            shifted = torch.tensor(expected[1:]) - got[:-1]
            assert float(shifted.abs().max()) > 0.1
        print(f"{engine}: served vs transformers log-prob gap {worst:.2e}")
        assert worst < 1e-4
        served.close()
    finally:
        groups.tear_down()


def test_colocated_served_model_sleeps_and_the_stream_wakes_it(tiny_model_path: str) -> None:
    """A colocated served model's engine refuses requests while asleep (the policy trains) and
    the stream's ``open`` wakes it; its scores are the same before and after."""
    cfg: Config = tiny_config(world=1)
    serving = ServedModelConfig(placement=ServedPlacement.colocated)
    spec = ServedSpec("teacher", tiny_model_path, "distill", "distill.teacher", serving)
    groups = TinyGroups(tiny_model_path)
    try:
        from workers.rollout_worker import RolloutWorker

        derived = derive_served_config(cfg, serving, tiny_model_path)
        group = groups(derived, RolloutWorker, role="teacher", world=1)
        served = connect_served(spec, group, cfg)  # type: ignore[arg-type]
        request = build_score_request([1, 5, 9, 13, 17], 2)
        before = served.client.submit(request, "a").result(timeout=300)
        served.sleep()
        with pytest.raises(Exception, match="awake"):
            served.client.submit(request, "b").result(timeout=300)
        served.client.open()
        after = served.client.submit(request, "c").result(timeout=300)
        assert before.scored is not None and after.scored is not None
        assert after.scored.logprobs == pytest.approx(before.scored.logprobs, abs=1e-6)
        served.close()
    finally:
        groups.tear_down()
