"""Where a run resumes from when its folder is not what a clean run leaves, what a resumed
launch writes, and the loop's schedule: the last step is always saved and validated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlframe.config import Config, ConfigError, ModelConfig, TrainerConfig
from rlframe.loop.sync_check import SyncCheck
from rlframe.state.checkpoint import (
    Checkpointer,
    find_latest_checkpoint,
    list_checkpoints,
    resolve_resume,
)


def make_config(out: Path, **trainer: Any) -> Config:
    return Config(
        model=ModelConfig(path="tiny:0"), trainer=TrainerConfig(output_dir=str(out), **trainer)
    )


def save(out: Path, *steps: int, keep_last: int = 10) -> Path:
    saver = Checkpointer(out, keep_last, {}, lambda dest: dest.mkdir(), export_hf=False)
    for step in steps:
        saver.save(step, {"seed": 0})
    return out / "checkpoints"


def test_marker_naming_an_incomplete_folder_is_not_trusted(tmp_path: Path) -> None:
    root = save(tmp_path, 2, 4)
    # A folder named like a checkpoint but without its driver state (a copy cut short).
    (root / "step_00000006" / "actor").mkdir(parents=True)
    (root / "latest").write_text("step_00000006\n")
    assert find_latest_checkpoint(tmp_path) == root / "step_00000004"
    assert resolve_resume(make_config(tmp_path)) == root / "step_00000004"
    # Nor a marker naming a folder that is gone.
    (root / "latest").write_text("step_00000009")
    assert find_latest_checkpoint(tmp_path) == root / "step_00000004"


def test_marker_naming_an_older_complete_checkpoint_is_followed(tmp_path: Path) -> None:
    """A run resumed from further back marks a lower step latest: the marker wins over the
    highest step number."""
    root = save(tmp_path, 2, 4)
    (root / "latest").write_text("step_00000002")
    assert find_latest_checkpoint(tmp_path) == root / "step_00000002"


def test_latest_marker_is_replaced_never_rewritten_in_place(tmp_path: Path) -> None:
    """A reader of the marker sees the old name or the new one, never a half-written file:
    the new marker is a new file renamed over the old, so an open handle keeps the old."""
    root = save(tmp_path, 1)
    with open(root / "latest") as old:
        save(tmp_path, 2)
        assert old.read().strip() == "step_00000001"
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002"]


class FolderGroup:
    """Stands for a worker group on the driver: saves and loads a file in the folder given."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.loaded: str | None = None

    def save_checkpoint(self, path: str) -> None:
        Path(path).mkdir()
        (Path(path) / "shard.txt").write_text(self.text)

    def load_checkpoint(self, path: str) -> None:
        self.loaded = (Path(path) / "shard.txt").read_text()


def test_every_role_and_the_model_config_land_in_the_checkpoint(tmp_path: Path) -> None:
    actor, critic = FolderGroup("actor weights"), FolderGroup("critic weights")
    saver = Checkpointer(
        tmp_path,
        3,
        {"actor": actor, "critic": critic},
        lambda dest: (dest.mkdir(), (dest / "config.json").write_text("{}")),
        export_hf=False,
    )
    final = saver.save(5, {"seed": 0})
    assert final == tmp_path / "checkpoints" / "step_00000005"
    assert (final / "actor" / "shard.txt").read_text() == "actor weights"
    assert (final / "critic" / "shard.txt").read_text() == "critic weights"
    assert (final / "hf_config" / "config.json").is_file()
    assert saver.load(final) == {"step": 5, "seed": 0}
    assert (actor.loaded, critic.loaded) == ("actor weights", "critic weights")
    # A checkpoint saved without a critic cannot resume a run with one.
    solo = tmp_path / "solo"
    Checkpointer(solo, 3, {"actor": actor}, lambda d: d.mkdir(), export_hf=False).save(1, {})
    with pytest.raises(FileNotFoundError, match="has no critic/ state"):
        saver.load(solo / "checkpoints" / "step_00000001")


def test_complete_checkpoints_are_listed_by_step(tmp_path: Path) -> None:
    root = save(tmp_path, 9, 10, 100)
    (root / "step_00000200").mkdir()  # incomplete: no driver state
    assert [p.name for p in list_checkpoints(root)] == [
        "step_00000009",
        "step_00000010",
        "step_00000100",
    ]
    (root / "latest").unlink()
    assert find_latest_checkpoint(tmp_path) == root / "step_00000100"


@pytest.mark.parametrize("leftover", ["config.json", "rollouts.jsonl", "checkpoints"])
def test_a_run_folder_that_never_finished_a_step_is_reused(
    tmp_path: Path, leftover: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    if leftover == "checkpoints":
        (out / leftover).mkdir()
    else:
        (out / leftover).write_text("{}\n")
    for resume in ("auto", "never"):
        assert resolve_resume(make_config(out, resume=resume)) is None
        assert "never finished a step" in capsys.readouterr().out


@pytest.mark.parametrize("leftover", ["config.json", "rollouts.jsonl", "checkpoints"])
def test_a_run_folder_with_a_logged_step_and_no_checkpoint_is_refused(
    tmp_path: Path, leftover: str
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    if leftover == "checkpoints":
        (out / leftover).mkdir()
    else:
        (out / leftover).write_text("{}\n")
    for resume in ("auto", "never"):
        with pytest.raises(ConfigError) as caught:
            resolve_resume(make_config(out, resume=resume))
        message = str(caught.value)
        assert message.startswith("trainer.output_dir:") and leftover in message


def test_only_incomplete_checkpoints_count_as_none(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "step_00000003" / "actor").mkdir(parents=True)
    (root / "latest").write_text("step_00000003")
    assert find_latest_checkpoint(tmp_path) is None
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints\)"):
        resolve_resume(make_config(tmp_path))


def test_never_ignores_a_complete_checkpoint(tmp_path: Path) -> None:
    save(tmp_path, 2)
    with pytest.raises(ConfigError, match="trainer.resume=never"):
        resolve_resume(make_config(tmp_path, resume="never"))


def prepare_output_dir(cfg: Config, resume_step: int | None) -> Path:
    from rlframe.run.launch import prepare_output_dir as prepare

    return prepare(cfg, resume_step)


def test_a_resumed_launch_writes_its_own_config_and_keeps_the_first(tmp_path: Path) -> None:
    out = tmp_path / "run"
    prepare_output_dir(make_config(out, total_steps=5), None)
    first = (out / "config.json").read_text()
    assert json.loads(first)["trainer"]["total_steps"] == 5
    (out / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 6)))
    prepare_output_dir(make_config(out, total_steps=9), 3)
    assert (out / "config.json").read_text() == first
    resumed = json.loads((out / "config.resume_3.json").read_text())
    assert resumed["trainer"]["total_steps"] == 9
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


# --- the loop's schedule -----------------------------------------------------------------


class RecordingTracker:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logged.append((step, dict(metrics)))


class CountingValidator:
    def __init__(self) -> None:
        self.runs = 0

    def run(self) -> dict[str, float]:
        self.runs += 1
        return {"val/score/mean": float(self.runs)}


def run_loop(tmp_path: Path, **trainer: Any) -> tuple[list[int], list[int], Path]:
    """Trainer.fit with steps that do nothing: (steps validated, steps saved, checkpoints)."""
    from rlframe.loop.trainer import Trainer

    class IdleTrainer(Trainer):
        def step(self) -> dict[str, float]:
            return {"reward/mean": 0.0}

        def state_dict(self) -> dict[str, Any]:
            return {"seed": 0}

    loop = IdleTrainer.__new__(IdleTrainer)
    loop.cfg = make_config(tmp_path, **trainer)
    loop.step_count = 0
    loop.tracker = RecordingTracker()
    loop.sync_check, loop.probes, loop.scored_with = SyncCheck(None), [], 0
    loop.distillation = None
    loop.validator = CountingValidator()
    loop.checkpointer = Checkpointer(tmp_path, 100, {}, lambda d: d.mkdir(), export_hf=False)
    loop.fit()
    validated = [s for s, m in loop.tracker.logged if "val/score/mean" in m]
    saved = [int(p.name.split("_")[1]) for p in list_checkpoints(tmp_path / "checkpoints")]
    return validated, saved, tmp_path / "checkpoints"


def test_last_step_is_saved_and_validated_off_the_period(tmp_path: Path) -> None:
    validated, saved, root = run_loop(tmp_path, total_steps=7, save_every=3, val_every=2)
    assert saved == [3, 6, 7]
    assert validated == [2, 4, 6, 7]
    assert (root / "latest").read_text().strip() == "step_00000007"


def test_validation_before_training_and_periods_that_divide(tmp_path: Path) -> None:
    validated, saved, _ = run_loop(
        tmp_path, total_steps=6, save_every=3, val_every=3, val_before_train=True
    )
    assert validated == [0, 3, 6] and saved == [3, 6]


def test_zero_period_never_saves_or_validates(tmp_path: Path) -> None:
    validated, saved, _ = run_loop(tmp_path, total_steps=3, save_every=0, val_every=0)
    assert validated == [] and saved == []
