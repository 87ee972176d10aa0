"""The role Protocols the driver is typed against match the default worker classes."""

from __future__ import annotations

import pytest

from rlframe.config import ActorConfig, CriticConfig, RewardModelConfig, RolloutConfig
from rlframe.config.placement import TRAIN_WORKER_CLS
from rlframe.controller import reads, roles
from rlframe.controller.dispatch import Dispatch, dispatch, find_dispatch_methods
from rlframe.controller.worker import Worker
from rlframe.core.protocol import Batch
from rlframe.core.registry import load_class
from rlframe.core.train_batch import TrainReads

DEFAULT_WORKERS = [
    (roles.HybridGroup, ActorConfig().worker_cls),
    (roles.TrainGroup, TRAIN_WORKER_CLS),
    (roles.RolloutGroup, RolloutConfig().worker_cls),
    (roles.CriticGroup, CriticConfig().worker_cls),
    (roles.RewardModelGroup, RewardModelConfig().worker_cls),
]


@pytest.mark.parametrize("role,path", DEFAULT_WORKERS, ids=lambda x: getattr(x, "__name__", x))
def test_every_role_method_is_a_dispatch_method_of_the_default_worker(role, path) -> None:
    worker_cls = load_class(path)
    methods = find_dispatch_methods(worker_cls)
    wanted = roles.find_role_methods(role)
    assert wanted, f"{role.__name__} names no methods"
    assert set(wanted) <= set(methods)
    roles.check_role(role, worker_cls, methods)  # same parameters too


def test_the_colocated_actor_and_the_trainer_share_the_training_methods() -> None:
    trainer_side = set(roles.find_role_methods(roles.ActorGroup))
    assert trainer_side == {
        "compute_logprobs",
        "compute_ref_logprobs",
        "update",
        "save_checkpoint",
        "load_checkpoint",
    }
    assert trainer_side < set(roles.find_role_methods(roles.HybridGroup))
    assert trainer_side < set(roles.find_role_methods(roles.TrainGroup))


def test_tensor_methods_never_read_text_columns() -> None:
    text = {"prompt", "response", "messages", "extra", "ground_truth"}
    for path, names in [
        (ActorConfig().worker_cls, ("generate", "compute_logprobs", "update")),
        (TRAIN_WORKER_CLS, ("compute_logprobs", "compute_ref_logprobs", "update")),
        (RolloutConfig().worker_cls, ("generate",)),
        (CriticConfig().worker_cls, ("compute_values", "update")),
    ]:
        methods = find_dispatch_methods(load_class(path))
        for name in names:
            declared = methods[name].reads
            keys = declared.optional if isinstance(declared, TrainReads) else declared
            assert keys is not None and not text & set(keys), (path, name)
    # The training methods take the typed TrainBatch, the rollout's a Batch of its keys.
    for path, name in [(TRAIN_WORKER_CLS, "update"), (CriticConfig().worker_cls, "update")]:
        assert isinstance(find_dispatch_methods(load_class(path))[name].reads, TrainReads)
    assert find_dispatch_methods(load_class(RolloutConfig().worker_cls))["generate"].reads == (
        reads.GENERATE
    )


class MissingUpdate(Worker):
    @dispatch(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch:
        return batch

    @dispatch(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        return batch

    def update(self, batch: Batch) -> dict:  # not a @dispatch method
        return {}


class WrongParameters(MissingUpdate):
    @dispatch(Dispatch.DP_SPLIT)
    def update(self, rows: Batch, extra: int) -> dict:
        return {}

    @dispatch(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None: ...

    @dispatch(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        return 0


def test_a_worker_class_missing_a_role_method_is_named() -> None:
    with pytest.raises(TypeError, match=r"MissingUpdate cannot serve as a ActorGroup: .*update"):
        roles.check_role(roles.ActorGroup, MissingUpdate, find_dispatch_methods(MissingUpdate))
    with pytest.raises(TypeError, match=r"WrongParameters.update\(self, rows.* does not match"):
        roles.check_role(roles.ActorGroup, WrongParameters, find_dispatch_methods(WrongParameters))
