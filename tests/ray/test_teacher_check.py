"""The teacher stage and its alignment check on served teachers: two teachers chosen by the
prompt's ``task``; the check passes honest readings (fp32: within 1e-4 of transformers) and
fails a reading shifted by one position and a stage that serves one task's rows with the
other task's teacher."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from rlframe.config.distill import DistillConfig
from rlframe.config.served_models import ServedSpec
from rlframe.core.protocol import Batch
from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
from rlframe.distill.alignment import TeacherCheck
from rlframe.distill.teachers import TeacherReading, TeacherStage, measure_reading
from rlframe.rollout.served import ServedModel, connect_served, derive_served_config
from tests.ray.factories import TinyGroups, tiny_config

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

TASKS = ("arithmetic", "copy")


@pytest.fixture(scope="module")
def teachers() -> Iterator[tuple[DistillConfig, dict[str, ServedModel], dict[str, str]]]:
    """Two served teachers (the hf engine: the check is the driver's, not the engine's) by
    task: the tiny teacher and a random tiny model."""
    from workers.rollout_worker import RolloutWorker

    paths = {"teacher/arithmetic": resolve_tiny_vl_path("tiny-teacher:0")}
    paths["teacher/copy"] = resolve_tiny_vl_path("tiny:1")
    d = DistillConfig(
        teachers={t: paths[f"teacher/{t}"] for t in TASKS}, teacher_column="task", engine="hf"
    )
    cfg = tiny_config(world=1)
    groups = TinyGroups("")
    served = {}
    try:
        for name, path in paths.items():
            spec = ServedSpec(name, path, "distill", f"distill.teachers.{name[8:]}", d)
            groups.model_path = path
            group = groups(derive_served_config(cfg, d, path), RolloutWorker, role=name, world=1)
            served[name] = connect_served(spec, group, cfg)  # type: ignore[arg-type]
        yield d, served, paths
    finally:
        for model in served.values():
            model.close()
        groups.tear_down()


def make_batch() -> Batch:
    """Four rows, two per task: left-padded prompts, responses of 3, 2, 1 and 3 tokens."""
    prompts = [[8, 9, 10, 11], [12, 13], [14, 15, 16], [17, 18, 19, 20]]
    responses = [[21, 22, 23], [24, 25], [26], [27, 28, 29]]
    width, longest = 3, max(map(len, prompts))
    prompt_ids = torch.zeros(4, longest, dtype=torch.long)
    prompt_mask = torch.zeros(4, longest, dtype=torch.long)
    response_ids = torch.zeros(4, width, dtype=torch.long)
    response_mask = torch.zeros(4, width)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, longest - len(p) :], prompt_mask[i, longest - len(p) :] = torch.tensor(p), 1
        response_ids[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1
    tensors = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "loss_mask": response_mask.clone(),
        "rollout_logprobs": -torch.ones(4, width) * response_mask,
    }
    return Batch(tensors, {"extra": [{"task": TASKS[i % 2]} for i in range(4)]})


def test_honest_readings_pass_and_a_shift_or_a_wrong_teacher_fails(
    teachers: tuple[DistillConfig, dict[str, ServedModel], dict[str, str]],
) -> None:
    d, served, paths = teachers
    batch = make_batch()
    check = TeacherCheck(replace(d, check_rows=4), paths, 1e-3)
    reading = TeacherStage(d, served, 300).read(batch)
    assert reading.teachers == ["teacher/arithmetic", "teacher/copy"] * 2
    honest = check.measure(batch, reading)
    print(f"honest reading: teacher_logprob_diff {honest:.2e}")
    assert honest < 1e-4 and not check.fails(honest)
    assert (reading.logprobs[batch.tensor("response_mask") == 0] == 0).all()
    metrics = measure_reading(reading, batch)
    assert set(metrics) == {
        "distill/reverse_kl",
        "distill/reverse_kl/arithmetic",
        "distill/reverse_kl/copy",
    }

    # A reading one position late (an off-by-one in the plumbing).
    shifted = TeacherReading(torch.roll(reading.logprobs, 1, dims=1), None, None, reading.teachers)
    gap = check.measure(batch, shifted)
    print(f"shifted by one position: {gap:.3g}")
    assert check.fails(gap)

    # A stage that serves each task's rows with the other task's teacher.
    swapped = {
        "teacher/arithmetic": served["teacher/copy"],
        "teacher/copy": served["teacher/arithmetic"],
    }
    wrong = TeacherStage(d, swapped, 300).read(batch)
    gap = check.measure(batch, wrong)
    print(f"the other task's teacher: {gap:.3g}")
    assert check.fails(gap)
