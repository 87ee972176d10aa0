"""Run directories are owned: one live run per folder, resumes that say what changed."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from rlframe.config import (
    AlgorithmConfig,
    Config,
    ConfigError,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlframe.state.checkpoint import Checkpointer, resolve_resume
from tests.harness import check_cli

REPO = Path(__file__).resolve().parents[2]
HOLD_LOCK = (
    "import sys, time\nfrom rlframe.state.run_dir import lock_run_dir\n"
    "lock_run_dir(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


def make_config(out: Path, model: str = "tiny:0", n: int = 16, **more: object) -> Config:
    algorithm = more.pop("algorithm", AlgorithmConfig())
    return Config(
        model=ModelConfig(path=model),
        rollout=RolloutConfig(n=n),
        algorithm=algorithm,  # type: ignore[arg-type]
        trainer=TrainerConfig(output_dir=str(out), **more),  # type: ignore[arg-type]
    )


def make_run(out: Path, cfg: Config) -> Path:
    """What a run that saved step 2 leaves: its config, two metric lines, a checkpoint."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    Checkpointer(out, 2, {}, lambda dest: dest.mkdir(), export_hf=False).save(2, {"seed": 0})
    return out / "checkpoints" / "step_00000002"


def hash_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_second_run_into_a_live_runs_folder_stops_naming_its_pid(tmp_path: Path) -> None:
    out = tmp_path / "run"
    make_run(out, make_config(out))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        before = hash_tree(out)
        start = time.monotonic()
        # The second run is this process (in-process command line): the lock is held by
        # another live process, which is what the folder's ownership is about.
        second = check_cli("+recipe=grpo_tiny", f"trainer.output_dir={out}")
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"rlframe: config error: trainer.output_dir: {out} is in use by a live run "
            f"(PID {holder.pid}); wait for it to end, stop it, or choose another "
            "trainer.output_dir"
        ]
        assert "rlframe: ray" not in second.stdout and time.monotonic() - start < 60
        assert hash_tree(out) == before  # not a byte changed, no resume config written
        # The lock dies with its holder, however it dies: then the run resumes.
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        from rlframe.state.run_dir import lock_run_dir

        lock_run_dir(out)
        assert (out / ".lock").read_text().strip() == str(os.getpid())
    finally:
        holder.kill()
        holder.wait()


def test_resume_prints_changed_keys_and_refuses_another_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    checkpoint = make_run(out, make_config(out))
    assert resolve_resume(make_config(out, n=8, total_steps=200)) == checkpoint
    printed = capsys.readouterr().err
    assert printed.strip() == (
        f"rlframe: resuming {checkpoint} with changed keys: rollout.n 16 -> 8"
    )
    with pytest.raises(
        ConfigError,
        match=r"model.path: .* was saved with model.path='tiny:0', not 'tiny:1'.*"
        "trainer.resume_changes=allow",
    ):
        resolve_resume(make_config(out, model="tiny:1"))
    with pytest.raises(ConfigError, match=r"critic.enable: .* saved with critic.enable=False"):
        resolve_resume(make_config(out, algorithm=AlgorithmConfig(advantage="gae")))
    allowed = make_config(out, model="tiny:1", resume_changes="allow")
    assert resolve_resume(allowed) == checkpoint
    assert "model.path 'tiny:0' -> 'tiny:1'" in capsys.readouterr().err
    # A launch that resumed reads the changes against its own config.resume_<step>.json.
    (out / "config.resume_2.json").write_text(
        json.dumps(asdict(make_config(out, n=8)), default=str)
    )
    Checkpointer(out, 2, {}, lambda dest: dest.mkdir(), export_hf=False).save(4, {"seed": 0})
    capsys.readouterr()
    resolve_resume(make_config(out, n=8))
    assert "changed keys" not in capsys.readouterr().err


def lora_config(out: Path, **lora: object) -> Config:
    from rlframe.config.lora import LoraConfig

    adapters = {"rank": 16, "alpha": 32.0} | lora
    return Config(
        model=ModelConfig(path="tiny-lora:0", lora=LoraConfig(**adapters)),  # type: ignore[arg-type]
        trainer=TrainerConfig(output_dir=str(out)),
    )


@pytest.mark.parametrize(
    "change,key",
    [
        ({"rank": 8}, "model.lora.rank=16, not 8"),
        ({"rank": 0}, "model.lora.rank=16, not 0"),
        ({"alpha": 16.0}, "model.lora.alpha=32.0, not 16.0"),
        ({"target_modules": ["q_proj"]}, "model.lora.target_modules=[], not ['q_proj']"),
    ],
)
def test_resume_refuses_other_adapters_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, key: str
) -> None:
    out = tmp_path / "run"
    checkpoint = make_run(out, lora_config(out))
    with pytest.raises(ConfigError) as refused:
        resolve_resume(lora_config(out, **change))
    assert str(refused.value) == (
        f"{key.split('=')[0]}: {checkpoint} was saved with {key!s}: its weights and state do "
        "not fit; resume with the old value, choose a new trainer.output_dir, or pass "
        "trainer.resume_changes=allow"
    )
    assert capsys.readouterr().err == ""  # the refusal is the only line


def test_resume_accepts_adapter_settings_that_leave_the_weights_as_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlframe.config.lora import LoraSync

    out = tmp_path / "run"
    checkpoint = make_run(out, lora_config(out))
    assert resolve_resume(lora_config(out, dropout=0.1, sync=LoraSync.adapter)) == checkpoint
    assert "model.lora.dropout 0.0 -> 0.1" in capsys.readouterr().err
    # Without adapters before or after, their alpha and layers are unused.
    plain = tmp_path / "plain"
    make_run(plain, lora_config(plain, rank=0))
    assert resolve_resume(lora_config(plain, rank=0, alpha=8.0)) is not None


def test_a_lora_resume_with_another_rank_stops_before_ray_in_one_line(tmp_path: Path) -> None:
    """From the command line: exit 2 and the refusal alone, where the launcher (Ray) is never
    reached (it used to pass the check and fail after Ray started, 67 lines)."""
    import yaml

    from rlframe.config import build_config
    from tests.harness import check_cli

    out = tmp_path / "run"
    recipe = ("+recipe=grpo_tiny_lora", f"trainer.output_dir={out}")
    composed = check_cli(*recipe, "--cfg", "job")
    checkpoint = make_run(out, build_config(yaml.safe_load(composed.stdout)))
    result = check_cli(*recipe, "model.lora.rank=8")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"rlframe: config error: model.lora.rank: {checkpoint} was saved with "
        "model.lora.rank=16, not 8: its weights and state do not fit; resume with the old "
        "value, choose a new trainer.output_dir, or pass trainer.resume_changes=allow"
    ]
