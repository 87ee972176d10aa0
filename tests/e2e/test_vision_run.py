"""Vision-language runs on the tiny VLM (``+recipe=vlm_tiny``): the images reach vLLM and the
trainer, every delivered sync reads clean (``rollout/logprob_diff`` < 1e-4) while one that
loses the vision tower does not, and the exported checkpoint with its processor loads and
generates with an image in transformers and in vLLM; multi-turn episodes whose observations
carry images sync as clean. Under ``matrix``: the recipe learns, the separate placement gives
the colocated metrics, and a run resumed with image rows in flight gives the straight run's
metrics."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlframe.models.images import PROCESSOR_FILES
from rlframe.rollout.state_json import decode_state
from tests.checkpoints import resume_from_copy
from tests.harness import (
    REPO,
    clean_env,
    deterministic,
    mean_reward_gain,
    read_metrics,
    run_recipe,
    shipped_by_value,
)
from tests.plugins import lost_vision_sync

pytestmark = pytest.mark.usefixtures("ray_cluster")

CLEAN = 1e-4
"""The rollout/trainer gap of tokens sampled with the trainer's weights (fp32)."""
SHORT = [
    "data.batch_size=8",
    "rollout.n=8",
    "actor.mini_batch_size=64",
    "actor.micro_batch_size=64",
    "actor.lr=2e-3",
    # Moves every weight from step 1 on: a step whose rewards are all equal (likely early on
    # for a random policy) has no advantage, so the sync after it would change nothing.
    "algorithm.entropy_coef=0.01",
]


@pytest.fixture
def shipped_plugin() -> Iterator[None]:
    with shipped_by_value(lost_vision_sync):
        yield


def read_diffs(metrics: list[dict]) -> dict[int, float]:
    return {m["step"]: m["rollout/logprob_diff"] for m in metrics}


@pytest.mark.slow
@pytest.mark.usefixtures("shipped_plugin")
def test_lost_vision_sync_lifts_logprob_diff_and_export_generates(tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = run_recipe(
        run,
        *SHORT,
        "trainer.total_steps=4",
        "trainer.save_every=4",
        "actor.worker_cls=tests.plugins.lost_vision_sync.LostVisionHybridWorker",
        # The gap itself is under test (and the steps after it): the stop on a broken sync
        # (tests/e2e/test_sync_check.py) would end the run at the lost step.
        "rollout.max_logprob_diff=0",
        recipe="vlm_tiny",
    )
    diffs = read_diffs(result.metrics)
    print(f"logprob_diff by step {diffs}")
    # Step s samples with version s - 1; version 2 arrived without its vision tower.
    lost_step = lost_vision_sync.LOST_VERSION + 1
    assert diffs[lost_step] > 10 * CLEAN
    assert all(d < CLEAN for s, d in diffs.items() if s != lost_step), diffs

    export = tmp_path / "export"
    subprocess.run(
        [sys.executable, "-m", "rlframe.export", str(run), str(export)],
        check=True,
        capture_output=True,
        cwd=REPO,
        timeout=300,
    )
    out = tmp_path / "generated.json"
    check = subprocess.run(
        [sys.executable, str(REPO / "tests/e2e/vision_export_check.py"), str(export), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}),
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-3000:]
    generated = json.loads(out.read_text())
    print(generated)
    # The processor expanded the image to its tokens the same way in both loaders, and
    # greedy decoding of the trained weights agrees.
    assert generated["vllm_prompt_ids"] == generated["prompt_ids"]
    assert generated["prompt_ids"].count(54) == 6  # a 56 x 84 image: 4 x 6 patches
    assert generated["vllm"] == generated["hf"] and len(generated["hf"]) == 6


# Both syncs are proven at the worker level on image rows
# (tests/workers/test_lora_vision.py::test_lora_on_the_language_model_syncs_image_logprobs),
# and the checks before Ray accept the run (tests/unit/test_lora_config.py); the whole runs,
# which add only the pools' plumbing that text LoRA runs cover, are the matrix tier's.
@pytest.mark.matrix
@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_on_the_language_model_syncs_clean_every_step(tmp_path: Path, sync: str) -> None:
    """LoRA on the tiny VLM's language model: step 2 samples image prompts with the synced
    adapters (the adapter tensors, or the merged weights without the vision tower,
    which keeps its loaded weights) at the trainer's log-probs."""
    metrics = run_recipe(
        tmp_path / "run",
        *SHORT,
        "trainer.total_steps=2",
        "model.lora.rank=8",
        f"model.lora.sync={sync}",
        recipe="vlm_tiny",
    ).metrics
    diffs = read_diffs(metrics)
    print(f"{sync}: logprob_diff by step {diffs}")
    assert sorted(diffs) == [1, 2] and max(diffs.values()) < CLEAN
    assert all(m["actor/grad_norm"] > 0 for m in metrics)


@pytest.mark.matrix
def test_vlm_tiny_learns_with_clean_syncs(tmp_path: Path) -> None:
    metrics = run_recipe(tmp_path / "run", recipe="vlm_tiny").metrics
    first, last = mean_reward_gain(metrics)
    print(f"reward {first:.3f} (first 5) -> {last:.3f} (last 5)")
    assert last - first > 0.2
    assert max(read_diffs(metrics).values()) < CLEAN


@pytest.mark.matrix
def test_separate_placement_gives_the_colocated_metrics(tmp_path: Path) -> None:
    # One CPU a process in both placements: vLLM's sums then run in the same order.
    common = [*SHORT, "trainer.total_steps=3", "trainer.cpus_per_proc=1", "ray.num_cpus=2"]
    colocated = run_recipe(tmp_path / "colocated", *common, recipe="vlm_tiny").metrics
    separate = run_recipe(
        tmp_path / "separate",
        *common,
        "rollout.placement=separate",
        "rollout.cpus_per_proc=1",
        recipe="vlm_tiny",
    ).metrics
    assert len(colocated) == len(separate) == 3
    for c, s in zip(colocated, separate, strict=True):
        c, s = deterministic(c), deterministic(s)
        assert c.keys() == s.keys()
        # Bit-identical but for the rollout/trainer gap, which is noise (~2e-7) either way.
        for key in c:
            assert math.isclose(c[key], s[key], rel_tol=1e-5, abs_tol=1e-7), (key, c, s)
        assert s["rollout/logprob_diff"] < CLEAN
    assert colocated[0]["actor/grad_norm"] > 0


def test_multi_turn_episodes_with_observation_images_sync_clean(tmp_path: Path) -> None:
    """colour_quiz: turn 1 names the prompt image's colour, the observation shows a second
    image, turn 2 names its colour. The engine serves each row with both images (its
    expanded prompt ids equal the driver's) and the trainer's log-probs of every sampled
    token, the second turn's after both images, equal the engine's."""
    result = run_recipe(
        tmp_path / "run",
        "rollout.agent=multi_turn",
        "agent.env=colour_quiz",
        "agent.max_turns=2",
        "agent.max_tokens_per_turn=1",
        "agent.close_cut_turns=true",
        "agent.max_obs_tokens=32",
        "agent.rule_reward_weight=0",
        "rollout.max_tokens=2",
        "data.batch_size=4",
        "rollout.n=4",
        "actor.mini_batch_size=16",
        "actor.micro_batch_size=16",
        "algorithm.entropy_coef=0.01",
        "trainer.total_steps=2",
        recipe="vlm_tiny",
    )
    assert result.exit_code == 0, result.stderr[-3000:]
    metrics = result.metrics
    print(read_diffs(metrics), [m["agent/obs_images/mean"] for m in metrics])
    assert len(metrics) == 2 and max(read_diffs(metrics).values()) < CLEAN
    # Most episodes saw the observation's image (a sampled image pad ends one early).
    assert all(m["agent/obs_images/mean"] > 0.5 for m in metrics)
    assert all(m["agent/turns/mean"] > 1.5 for m in metrics)


@pytest.mark.matrix
def test_resume_with_image_rows_in_flight_matches_straight_run(tmp_path: Path) -> None:
    """Asynchronous (staleness 1, one token a call) in a separate rollout pool: the step-2
    checkpoint holds image rows part-way (the call that ran during the update) and the
    processor; a copy resumed from it logs the straight run's step 3. Two runs of two pools,
    51 to 82 s on 2 shared cores: ``matrix`` (the state's images are the default tier's in
    tests/unit/test_producer_state.py)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = [
        *SHORT,
        "trainer.total_steps=3",
        "trainer.save_every=2",
        "rollout.max_staleness=1",
        "rollout.partial_chunk_tokens=1",
        "rollout.placement=separate",
        "trainer.cpus_per_proc=1",
        "rollout.cpus_per_proc=1",
        "ray.num_cpus=2",
    ]
    run_recipe(straight, *common, recipe="vlm_tiny")
    saved = resume_from_copy(straight, resumed, 2)
    assert any((saved / "hf_config" / name).is_file() for name in PROCESSOR_FILES)
    experience = json.loads((saved / "driver_state.json").read_text())["experience"]
    groups = decode_state(experience)["groups"]
    partial = [r for g in groups for r in g.get("rows", []) if 0 < len(r["response_ids"]) < 3]
    assert partial and all(len(r["images"]) == 1 for r in partial)
    out = run_recipe(resumed, *common, recipe="vlm_tiny").stdout
    assert "at step 2" in out
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [m["step"] for m in a] == [m["step"] for m in b] == [1, 2, 3]
    for x, y in zip(a, b):
        assert deterministic(x) == deterministic(y), x["step"]
    assert max(m["off_policy/staleness_max"] for m in a) == 1
