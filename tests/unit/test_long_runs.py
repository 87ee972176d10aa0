"""Driver-side pieces of long runs: checkpoint layout and pruning, resume resolution, run
directory safety, state round trips, and the validation metrics (hand-computed pass@k)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from rlframe.algorithms.losses import KLController
from rlframe.config import Config, ConfigError, DataConfig, ModelConfig, TrainerConfig, ValConfig
from rlframe.data.loader import PromptLoader
from rlframe.data.prompts import PromptRecord
from rlframe.loop.validation import compute_validation_metrics, estimate_pass_at_k, list_pass_ks
from rlframe.observability.tracking import Tracker
from rlframe.state.checkpoint import Checkpointer, resolve_resume, truncate_run_logs
from rlframe.state.checkpoint_layout import find_latest_checkpoint


def make_config(out: Path, **trainer: object) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"), trainer=TrainerConfig(output_dir=str(out), **trainer)
    )


def make_checkpointer(out: Path, keep_last: int) -> Checkpointer:
    # No worker groups: the driver's own state and the atomic file protocol are under test.
    return Checkpointer(out, keep_last, {}, lambda dest: dest.mkdir(), export_hf=False)


def test_save_marks_latest_and_prunes_to_keep_last(tmp_path: Path) -> None:
    saver = make_checkpointer(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        saver.save(step, {"groups_served": step, "seed": 0})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000020", "step_00000030"]
    assert find_latest_checkpoint(tmp_path) == root / "step_00000030"
    assert json.loads((root / "step_00000030" / "driver_state.json").read_text()) == {
        "step": 30,
        "groups_served": 30,
        "seed": 0,
    }


def test_killed_save_leaves_previous_checkpoint_and_is_cleaned_up(tmp_path: Path) -> None:
    saver = make_checkpointer(tmp_path, keep_last=3)
    saver.save(1, {})
    root = tmp_path / "checkpoints"
    # What a kill before the rename leaves: a temporary folder, ``latest`` unchanged.
    (root / ".tmp_step_00000002" / "actor").mkdir(parents=True)
    assert find_latest_checkpoint(tmp_path) == root / "step_00000001"
    # A lost marker falls back to the newest complete checkpoint.
    (root / "latest").unlink()
    assert find_latest_checkpoint(tmp_path) == root / "step_00000001"
    saver.save(2, {})
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


def test_resumed_from_further_back_the_latest_checkpoint_survives_pruning(tmp_path: Path) -> None:
    saver = make_checkpointer(tmp_path, keep_last=1)
    saver.save(5, {})
    saver.save(3, {})  # a run resumed from an older checkpoint path
    assert find_latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000003"
    assert not (tmp_path / "checkpoints" / "step_00000005").exists()


def test_resume_resolution_and_run_directory_safety(tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    assert resolve_resume(make_config(fresh)) is None
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("")
    (used / "config.json").write_text("{}")
    # A start that never finished a step does not claim the folder.
    assert resolve_resume(make_config(used)) is None
    (used / "config.json").unlink()
    (used / "metrics.jsonl").write_text('{"step": 1}\n')
    for resume in ("auto", "never"):
        with pytest.raises(
            ConfigError, match=rf"trainer.output_dir: {used} already holds a run \(metrics.jsonl\)"
        ):
            resolve_resume(make_config(used, resume=resume))
    make_checkpointer(used, 2).save(4, {"seed": 0})
    assert resolve_resume(make_config(used)) == used / "checkpoints" / "step_00000004"
    with pytest.raises(ConfigError, match="trainer.seed: .* trainer.seed=0; resume with that seed"):
        resolve_resume(make_config(used, seed=1))
    with pytest.raises(ConfigError, match="trainer.resume=never"):
        resolve_resume(make_config(used, resume="never"))
    assert (
        resolve_resume(make_config(fresh, resume=str(used / "checkpoints" / "step_00000004")))
        is not None
    )
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        resolve_resume(make_config(fresh, resume=str(used)))


def test_truncate_run_logs_keeps_steps_up_to_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(1, 6))
    )
    truncate_run_logs(tmp_path, 3)
    assert [
        json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2, 3]
    assert "dropped 2 lines" in capsys.readouterr().out


def test_prompt_loader_state_round_trip() -> None:
    records = [PromptRecord(str(i), [i], str(i), {}) for i in range(10)]
    a = PromptLoader(records, 3, seed=7)
    for _ in range(4):
        a.next_records()
    state = json.loads(json.dumps(a.state_dict()))  # it goes through JSON in a checkpoint
    b = PromptLoader(records, 3, seed=99)
    b.load_state_dict(state)
    assert [[r.prompt for r in a.next_records()] for _ in range(8)] == [
        [r.prompt for r in b.next_records()] for _ in range(8)
    ]
    with pytest.raises(ValueError, match="ran over 10 prompts, this run has 9"):
        PromptLoader(records[:9], 3, seed=7).load_state_dict(state)


def test_kl_controller_state() -> None:
    ctrl = KLController(0.1, "adaptive", 0.1, 100)
    ctrl.update(0.5, 10)
    other = KLController(0.1, "adaptive", 0.1, 100)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == ctrl.value != 0.1


def test_resumed_tracker_continues_the_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # real wandb, nothing leaves the machine
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = Tracker(tmp_path, ["wandb"], 3, {"lr": 1.0}, "p", "e")
    first.log(1, {"x": 1.0})
    state = first.state_dict()
    first.close()
    second = Tracker(tmp_path, ["wandb"], 3, {"lr": 1.0}, "p", "e")
    second.load_state_dict(state)
    second.log(2, {"x": 2.0})
    second.close()
    assert state["wandb_run_id"] and second.wandb_run.id == state["wandb_run_id"]


def test_pass_at_k_by_hand() -> None:
    assert (
        list_pass_ks(4) == [1, 2, 4] and list_pass_ks(6) == [1, 2, 4, 6] and list_pass_ks(1) == [1]
    )
    assert estimate_pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert estimate_pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert estimate_pass_at_k(4, 0, 4) == 0.0 and estimate_pass_at_k(4, 3, 2) == 1.0
    # Unbiased: the mean over random draws of k of the n samples.
    rng = random.Random(0)
    draws = [any(rng.sample([1, 0, 0, 0, 0], 2)) for _ in range(20000)]
    assert sum(draws) / len(draws) == pytest.approx(estimate_pass_at_k(5, 1, 2), abs=0.02)


def test_validation_metrics_overall_and_per_source() -> None:
    # Two prompts x 2 samples: prompt a has 1 of 2 correct, prompt b 2 of 2.
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = scores - 0.5
    lengths = torch.tensor([2, 4, 6, 8])
    m = compute_validation_metrics(
        scores, rewards, lengths, n=2, threshold=1.0, sources=["a", "a", "b", "b"]
    )
    assert m["val/pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["val/pass@2"] == pytest.approx(1.0)
    assert m["val/reward/mean"] == pytest.approx(0.25) and m[
        "val/response_length/mean"
    ] == pytest.approx(5)
    assert m["val/a/pass@1"] == pytest.approx(0.5) and m["val/b/reward/mean"] == pytest.approx(0.5)


def test_config_checks_for_long_runs() -> None:
    with pytest.raises(ConfigError, match="trainer.save_every"):
        TrainerConfig(save_every=-1)
    with pytest.raises(ConfigError, match="trainer.keep_last"):
        TrainerConfig(keep_last=0)
    with pytest.raises(ConfigError, match="val.n"):
        ValConfig(n=0)
    with pytest.raises(ConfigError, match="data.val_files"):
        Config(
            model=ModelConfig(path="x"),
            data=DataConfig(train_files=["a.jsonl"]),
            trainer=TrainerConfig(val_every=5),
        )
