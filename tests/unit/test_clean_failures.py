"""Failures at the edges end with one clear line: a full disk (a checkpoint, metrics.jsonl,
driver.log), a wrong-typed value, a model folder without weights, an interruption; no colour
codes off a terminal."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from rlframe.run.interrupts import (
    RECEIVED,
    Interrupted,
    describe_interruption,
    find_interruption,
    raise_if_interrupted,
)
from rlframe.state.checkpoint import Checkpointer
from rlframe.state.checkpoint_layout import find_latest_checkpoint
from rlframe.state.save_failures import CheckpointError
from tests.harness import check_cli


@pytest.fixture()
def small_disk(tmp_path: Path):
    """A 2 MB tmpfs: a real file system that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def write_blob(size: int):
    def write(dest: Path) -> None:
        dest.mkdir()
        (dest / "blob").write_bytes(b"x" * size)

    return write


def test_a_full_disk_names_the_path_and_the_intact_checkpoint(small_disk: Path) -> None:
    out = small_disk / "run"
    Checkpointer(out, 2, {}, write_blob(200_000), export_hf=False).save(1, {"seed": 0})
    previous = out / "checkpoints" / "step_00000001"
    with pytest.raises(CheckpointError) as failed:
        Checkpointer(out, 2, {}, write_blob(3_000_000), export_hf=False).save(2, {"seed": 0})
    assert failed.value.disk_full  # the run exits with DISK_FULL_EXIT, not 1
    assert str(failed.value) == (
        f"could not save checkpoint step_00000002 in {out / 'checkpoints'}: no space left on "
        f"device ({out / 'checkpoints'}); the partial save was removed; the previous "
        f"checkpoint {previous} is intact and resumable"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", previous.name]
    assert find_latest_checkpoint(out) == previous
    assert (previous / "hf_config" / "blob").stat().st_size == 200_000


def test_a_failed_save_that_is_not_a_full_disk_says_what_failed(tmp_path: Path) -> None:
    def broken(dest: Path) -> None:
        dest.mkdir()
        raise RuntimeError("rank 0 died\nlast line of its traceback")

    with pytest.raises(CheckpointError, match=r"RuntimeError: last line of its traceback; .*") as e:
        Checkpointer(tmp_path, 2, {}, broken, export_hf=False).save(1, {})
    assert not e.value.disk_full
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))


def test_interruption_line_names_the_step_and_where_it_resumes(tmp_path: Path) -> None:
    assert "before step 1 finished" in describe_interruption(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2)))
    assert "at step 3; no checkpoint was saved" in describe_interruption(tmp_path)
    Checkpointer(tmp_path, 2, {}, write_blob(10), export_hf=False).save(2, {"seed": 0})
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4))
    )
    assert describe_interruption(tmp_path) == (
        "rlframe: interrupted at step 5; the same command resumes from step 2"
    )


def test_after_a_signal_every_failure_is_the_signals() -> None:
    """A signal whose exception a library swallowed (a bare ``except`` around an import) can
    leave that import half done: what fails next is reported as the interruption, and the
    launcher's next phase raises it."""
    import_failure = ImportError("cannot import name 'dispatch_model' (circular import)")
    assert find_interruption(import_failure) is None
    raise_if_interrupted()  # no signal: nothing to raise
    RECEIVED.append(signal.SIGINT)
    try:
        found = find_interruption(import_failure)
        assert found is not None and found.exit_code == 130
        with pytest.raises(Interrupted) as raised:
            raise_if_interrupted()
        assert raised.value.signum == signal.SIGINT
    finally:
        RECEIVED.clear()


def fill(disk: Path) -> None:
    """Take every free page of ``disk``."""
    with (disk / "filler").open("wb", buffering=0) as filler:
        try:
            while filler.write(b"\0" * 4096):
                pass
        except OSError as e:
            assert e.errno == errno.ENOSPC


def test_metrics_jsonl_on_a_full_disk_keeps_whole_lines_and_names_itself(small_disk: Path) -> None:
    from rlframe.observability.tracking import Tracker

    tracker = Tracker(small_disk, ["jsonl"], 9, None, "p", "e")
    tracker.log(1, {"reward/mean": 0.5})
    kept = (small_disk / "metrics.jsonl").read_bytes()
    fill(small_disk)
    # Three pages: the first fills what the file's last page has left, the rest cannot go.
    with pytest.raises(OSError) as failed:
        tracker.log(2, {f"key_{i}": float(i) for i in range(800)})
    assert failed.value.errno == errno.ENOSPC
    assert failed.value.filename == str(small_disk / "metrics.jsonl")
    assert (small_disk / "metrics.jsonl").read_bytes() == kept


def test_driver_log_drops_what_a_full_disk_cannot_take_without_a_traceback(
    small_disk: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging

    from rlframe.observability.logs import DriverLogFile

    handler = DriverLogFile(small_disk / "driver.log")
    fill(small_disk)
    for _ in range(4):
        handler.emit(logging.makeLogRecord({"msg": "x" * 20_000, "levelno": logging.INFO}))
    handler.close()
    assert capsys.readouterr().err == ""


def test_a_full_disk_ends_the_run_in_one_line_with_its_own_exit_status(
    small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point's handling: the training loop (here the real Tracker writing steps,
    without Ray) hits a full disk at its metrics.jsonl; the run ends in one line, no
    traceback, with DISK_FULL_EXIT."""
    import rlframe.run.launch
    from rlframe.config import Config
    from rlframe.observability.tracking import Tracker
    from rlframe.state.save_failures import DISK_FULL_EXIT
    from tests.harness import call_main, release_all_run_dirs

    out = small_disk / "run"

    def train_until_full(cfg: Config, resume_from: Path | None) -> list[dict[str, float]]:
        tracker = Tracker(out, ["jsonl"], cfg.trainer.total_steps, cfg, "p", "e")
        tracker.log(1, {"reward/mean": 0.5})
        fill(small_disk)
        for step in range(2, cfg.trainer.total_steps + 1):
            tracker.log(step, {f"key_{i}": float(i) for i in range(800)})
        return []

    monkeypatch.setattr(rlframe.run.launch, "run_training", train_until_full)
    try:
        code, _, stderr = call_main(["+recipe=grpo_tiny", f"trainer.output_dir={out}"])
    finally:
        release_all_run_dirs()
    assert code == DISK_FULL_EXIT == 74
    assert stderr.strip().splitlines() == [
        f"rlframe: no space left on device writing {out / 'metrics.jsonl'}; the run stopped at "
        "step 2; no checkpoint was saved (trainer.save_every=0), so rerun with a new "
        "trainer.output_dir once there is room"
    ]


def test_a_wrong_type_exits_2_with_one_line(tmp_path: Path) -> None:
    result = check_cli(
        "+recipe=grpo_tiny", "trainer.total_steps=abc", f"trainer.output_dir={tmp_path / 'run'}"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "rlframe: config error: trainer.total_steps: Value 'abc' of type 'str' could not be "
        "converted to Integer (from 'trainer.total_steps=abc')"
    ]
    assert not (tmp_path / "run").exists()


def test_error_lines_carry_no_colour_codes_off_a_terminal(capsys: pytest.CaptureFixture) -> None:
    from rlframe.main import say_error

    say_error("rlframe: \x1b[36mray::actor.update()\x1b[39m failed")
    assert capsys.readouterr().err == "rlframe: ray::actor.update() failed\n"


def test_ray_s_raylet_lines_carry_no_colour_codes_off_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The line Ray prints for a worker's death, as it prints it in the driver, once the
    run's logs are routed with stdout and stderr not terminals (pytest's capture)."""
    import io

    from ray._private.worker import print_worker_logs

    from rlframe.observability.logs import route_driver_logs

    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")  # so that the test leaves what it found
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    death = {"pid": "raylet", "ip": "127.0.0.1", "localhost": "127.0.0.1"}
    death["lines"] = ["A worker died or was killed while executing a task."]  # type: ignore[assignment]
    coloured = io.StringIO()
    print_worker_logs(death, coloured)
    assert "\x1b[" in coloured.getvalue()  # Ray's default
    route_driver_logs(tmp_path, "warning").close()
    plain = io.StringIO()
    print_worker_logs(death, plain)
    assert plain.getvalue() == "(raylet) A worker died or was killed while executing a task.\n"


def test_a_model_folder_without_loadable_weights_fails_in_preflight(tmp_path: Path) -> None:
    import shutil

    from rlframe.config import Config, ConfigError, ModelConfig
    from rlframe.data.tiny_model import resolve_model_path
    from rlframe.run.preflight import load_model_files

    folder = tmp_path / "model"
    shutil.copytree(resolve_model_path("tiny:0"), folder)
    cfg = Config(model=ModelConfig(path=str(folder)))
    assert load_model_files(cfg)[0] == str(folder)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model.path: .*model.safetensors is truncated"):
        load_model_files(cfg)
    weights.unlink()
    with pytest.raises(ConfigError, match=r"model.path: .* has a config.json but no weights"):
        load_model_files(cfg)


def reported_failures() -> list[Exception]:
    from rlframe.controller.placement import PlacementError
    from rlframe.controller.worker_group import WorkerError
    from rlframe.envs import EnvError
    from rlframe.rewards import RewardError

    return [
        WorkerError("actor", 1, "update", "the process died", died=True),
        RewardError("reward fn char_match raised on sample 3: ValueError: bad"),
        EnvError("env countdown: step raised on sample 2, turn 1: KeyError"),
        PlacementError("the actor pool needs 4 CPUs per bundle; the largest node has 2"),
    ]


@pytest.mark.parametrize("index", range(4), ids=["worker", "reward", "env", "placement"])
def test_a_failure_with_its_own_message_ends_the_run_in_that_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    """rlframe.main recognises the failures whose classes import torch only once one is caught
    (the launcher starts Ray before torch is imported): each still ends the run with exit 1
    and its own line, no traceback."""
    import rlframe.run.launch
    from tests.harness import call_main, release_all_run_dirs

    error = reported_failures()[index]

    def fail(cfg: object, resume_from: Path | None) -> list[dict[str, float]]:
        raise error

    monkeypatch.setattr(rlframe.run.launch, "run_training", fail)
    try:
        code, _, stderr = call_main(["+recipe=grpo_tiny", f"trainer.output_dir={tmp_path}/run"])
    finally:
        release_all_run_dirs()
    assert code == 1
    assert stderr.strip().splitlines() == [f"rlframe: {error}"]


def test_an_unexpected_failure_keeps_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug is not dressed as a reported failure: its traceback reaches the console."""
    import rlframe.run.launch
    from tests.harness import call_main, release_all_run_dirs

    def fail(cfg: object, resume_from: Path | None) -> list[dict[str, float]]:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(rlframe.run.launch, "run_training", fail)
    try:
        code, _, stderr = call_main(["+recipe=grpo_tiny", f"trainer.output_dir={tmp_path}/run"])
    finally:
        release_all_run_dirs()
    assert code != 0
    assert "Traceback" in stderr and "ZeroDivisionError: a bug" in stderr
