"""``actor.expert_parallel_size``: refused in one line where it cannot work (a size that does
not divide the ranks or the experts, a dense model, what it does not combine with yet), and
shown on the start-up mesh line."""

from __future__ import annotations

import pytest

from rlframe.config import ConfigError, build_config
from rlframe.models.expert_parallel import check_expert_parallel
from rlframe.models.hf_config import ConfigJson
from rlframe.observability.logs import describe_mesh


def config(ep: int = 2, procs: int = 2, **extra: dict) -> object:
    tree = {
        "model": {"path": "tiny-moe:0"},
        "trainer": {"procs_per_node": procs, "cpus_per_proc": 1},
        "actor": {"expert_parallel_size": ep},
    }
    for section, values in extra.items():
        tree.setdefault(section, {}).update(values)
    return build_config(tree)


@pytest.mark.parametrize(
    "overrides,text",
    [
        ({"procs": 2, "ep": 3}, "3 must divide the number of ranks"),
        ({"ep": 0}, "must be > 0"),
        ({"model": {"lora": {"rank": 4}}}, "does not work with LoRA"),
        ({"actor": {"expert_parallel_size": 2, "sequence_parallel_size": 2}}, "sequence parallel"),
    ],
)
def test_what_expert_parallelism_cannot_do_is_refused(overrides: dict, text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^actor.expert_parallel_size: .*{text}"):
        config(**overrides)


@pytest.mark.parametrize(
    "fields,text",
    [
        ({"model_type": "qwen2", "hidden_size": 8}, "has no experts"),
        ({"model_type": "mixtral", "num_local_experts": 6}, "4 must divide the model's 6 experts"),
    ],
)
def test_the_model_must_have_experts_the_size_divides(fields: dict, text: str) -> None:
    cfg = config(procs=4, ep=4, actor={"expert_parallel_size": 4, "micro_batch_size": 8})
    with pytest.raises(ConfigError, match=rf"^actor.expert_parallel_size: .*{text}"):
        check_expert_parallel(cfg, "some/model", ConfigJson(fields))
    check_expert_parallel(cfg, "some/model", ConfigJson({"num_experts": 8}))


def test_the_mesh_line_names_the_expert_groups() -> None:
    cfg = config(procs=4, ep=2, actor={"expert_parallel_size": 2, "micro_batch_size": 8})
    assert describe_mesh(cfg, 4) == "4 data x 1 sequence (training); experts 2 replica x 2 expert"


def test_routing_replay_with_expert_parallelism_is_accepted() -> None:
    """Replayed experts reach the ranks that hold them (the dispatch reads the replayed
    indices: tests/workers/test_expert_parallel_router_terms.py); no longer refused."""
    cfg = config(algorithm={"router_replay": "rollout"}, rollout={"engine": "hf"})
    assert cfg.actor.expert_parallel_size == 2


GAE = {"algorithm": {"advantage": "gae"}}


@pytest.mark.parametrize(
    "critic,text",
    [
        ({"expert_parallel_size": 2, "enable": False}, "has no effect without a critic"),
        ({"expert_parallel_size": 2, "lora": {"rank": 4}}, "does not work with LoRA"),
        (
            {"expert_parallel_size": 2, "sequence_parallel_size": 2},
            "does not work with sequence parallel",
        ),
        ({"expert_parallel_size": 3}, "3 must divide the number of ranks"),
    ],
)
def test_what_a_critics_expert_parallelism_cannot_do_is_refused(critic: dict, text: str) -> None:
    with pytest.raises(ConfigError, match=rf"^critic.expert_parallel_size: .*{text}"):
        config(ep=1, actor={"expert_parallel_size": 1}, critic=critic, **GAE)


def test_a_critics_expert_parallelism_needs_experts_it_divides() -> None:
    cfg = config(ep=1, actor={"expert_parallel_size": 1}, critic={"expert_parallel_size": 2}, **GAE)
    assert describe_mesh(cfg, 2).endswith("; critic experts 1 replica x 2 expert")
    with pytest.raises(ConfigError, match=r"^critic.expert_parallel_size: .*has no experts"):
        check_expert_parallel(cfg, "some/model", ConfigJson({"model_type": "qwen2"}))
    with pytest.raises(ConfigError, match=r"^critic.expert_parallel_size: 2 must divide .* 5 "):
        check_expert_parallel(cfg, "some/model", ConfigJson({"num_experts": 5}))
