"""Damaged checkpoints are refused before Ray, naming the file; ``resume=auto`` falls back to
the previous intact step (issue 46: a truncated shard or ``.metadata`` or a half
``driver_state.json`` gave a 34-75-line traceback after Ray and the workers had started;
random bytes in a shard or a missing processor file were accepted silently).

The checkpoints are real saves of :class:`~rlframe.state.checkpoint.Checkpointer`: its
actor's shards written by ``torch.distributed.checkpoint`` (in one process), an
``hf_config/`` with a vision-language model's processor file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlframe.config import ConfigError
from rlframe.state.checkpoint import Checkpointer, resolve_resume
from rlframe.state.checksums import MANIFEST, find_damage
from tests.unit.cli_errors import check_config_error
from tests.unit.test_checkpoint_fallbacks import make_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
PROCESSOR_FILE = "preprocessor_config.json"


class DcpGroup:
    """The actor's side of a save on one process: DCP shards and ``.metadata`` of a small
    model state."""

    def save_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(64)}
        dcp.save(state, checkpoint_id=path, no_dist=True)


def write_hf_config(dest: Path) -> None:
    dest.mkdir()
    (dest / "config.json").write_text('{"model_type": "qwen2_vl"}')
    (dest / PROCESSOR_FILE).write_text('{"image_processor_type": "Qwen2VLImageProcessor"}')


def save(out: Path, *steps: int) -> Path:
    saver = Checkpointer(out, 10, {"actor": DcpGroup()}, write_hf_config, export_hf=False)
    for step in steps:
        saver.save(step, {"seed": 0})
    return out / "checkpoints"


def shard(checkpoint: Path) -> Path:
    return next((checkpoint / "actor").glob("*.distcp"))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def scramble(path: Path) -> None:
    """Random bytes over the middle of the file, its size unchanged."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = os.urandom(64)
    path.write_bytes(bytes(data))


DAMAGE: dict[str, tuple[Callable[[Path], Path], Callable[[Path], None], str]] = {
    "truncated shard": (shard, truncate, "bytes"),
    "truncated metadata": (lambda c: c / "actor" / ".metadata", truncate, "bytes"),
    "half driver state": (lambda c: c / "driver_state.json", truncate, "bytes"),
    "random bytes in a shard": (shard, scramble, "does not match its checksum"),
    "missing processor file": (lambda c: c / "hf_config" / PROCESSOR_FILE, Path.unlink, "missing"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_auto_falls_back(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = save(tmp_path, 2, 4)
    latest, previous = root / "step_00000004", root / "step_00000002"
    assert resolve_resume(make_config(tmp_path)) == latest  # whole: resumed as saved
    pick, damage, says = DAMAGE[kind]
    damaged = pick(latest)
    damage(damaged)
    # A path given explicitly is refused in one line naming the file.
    with pytest.raises(ConfigError) as caught:
        resolve_resume(make_config(tmp_path, resume=str(latest)))
    message = str(caught.value)
    assert message.startswith("trainer.resume: ") and "\n" not in message
    assert str(damaged) in message and says in message
    # resume=auto takes the previous intact step, saying so in one warning line.
    capsys.readouterr()
    assert resolve_resume(make_config(tmp_path)) == previous
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith("rlframe: warning: "), warning
    assert str(damaged) in warning[0] and str(previous) in warning[0]


def test_without_an_intact_earlier_checkpoint_the_damage_is_refused(tmp_path: Path) -> None:
    root = save(tmp_path, 2, 4)
    truncate(shard(root / "step_00000002"))
    scramble(shard(root / "step_00000004"))
    with pytest.raises(ConfigError) as caught:
        resolve_resume(make_config(tmp_path))
    message = str(caught.value)
    assert str(shard(root / "step_00000004")) in message and "no earlier checkpoint" in message


def test_the_list_names_every_file_of_the_save(tmp_path: Path) -> None:
    checkpoint = save(tmp_path, 1) / "step_00000001"
    listed = set(json.loads((checkpoint / MANIFEST).read_text())["files"])
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()}
    assert listed == on_disk - {MANIFEST}
    assert {"driver_state.json", "actor/.metadata", f"hf_config/{PROCESSOR_FILE}"} <= listed
    assert find_damage(checkpoint) is None
    # The list itself cut short is damage too.
    truncate(checkpoint / MANIFEST)
    assert f"{checkpoint / MANIFEST} is not the list" in (find_damage(checkpoint) or "")


def test_a_checkpoint_saved_before_checksums_resumes_unless_its_driver_state_is_cut(
    tmp_path: Path,
) -> None:
    root = save(tmp_path, 2)
    checkpoint = root / "step_00000002"
    (checkpoint / MANIFEST).unlink()
    assert resolve_resume(make_config(tmp_path)) == checkpoint
    truncate(checkpoint / "driver_state.json")
    with pytest.raises(ConfigError, match="driver_state.json does not parse"):
        resolve_resume(make_config(tmp_path))


def test_the_command_stops_before_ray_naming_the_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    root = save(out, 3)
    scramble(shard(root / "step_00000003"))
    line = check_config_error(
        "+recipe=grpo_tiny",
        f"trainer.output_dir={out}",
        key="trainer.resume",
        text=str(shard(root / "step_00000003")),
        before_ray=True,
    )
    assert "does not match its checksum" in line


def test_the_export_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    from rlframe.state.export import resolve_checkpoint

    checkpoint = save(tmp_path, 1) / "step_00000001"
    assert resolve_checkpoint(tmp_path) == checkpoint
    truncate(checkpoint / "actor" / ".metadata")
    with pytest.raises(ValueError, match=r"\.metadata has \d+ bytes"):
        resolve_checkpoint(tmp_path)
