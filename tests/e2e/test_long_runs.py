"""Long runs through the CLI on the tiny model: resume is exact, a save killed by SIGKILL
leaves the previous checkpoint to resume from, the export loads in transformers and vLLM,
validation is logged, and a run directory in use is never overwritten.

Four CLI runs of 6 small steps (batch 8 x 8 responses, an entropy bonus so every step moves
the weights) share one run per scenario; about two and a half minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.checkpoints import assert_identical, load_shards
from tests.harness import REPO, check_cli, clean_env, cli_command, deterministic, read_metrics
from tests.harness import run_recipe as run_in_process

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

SMALL = [
    "trainer.total_steps=6",
    "data.batch_size=8",
    "rollout.n=8",
    "actor.mini_batch_size=32",
    "actor.micro_batch_size=32",
    "algorithm.entropy_coef=0.01",
    "trainer.save_every=3",
    "trainer.val_every=3",
    "val.n=4",
    "val.temperature=1.0",
    "data.val_size=16",
]


def run(out: Path, *overrides: str) -> str:
    """A small grpo_tiny run in the test process; its console."""
    return run_in_process(out, *SMALL, *overrides).stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Path:
    """Six steps in one go, with an HF export in each checkpoint."""
    out = tmp_path_factory.mktemp("straight") / "run"
    run(out, "trainer.export_hf=true")
    return out


def test_resume_after_kill_during_save_matches_straight_run(tmp_path: Path, straight: Path) -> None:
    out = tmp_path / "run"
    # 1. Three steps, saved at step 3, then stop.
    run(out, "trainer.total_steps=3")
    # 2. Continue to step 6, and SIGKILL the driver as soon as the step-6 save has begun:
    #    its folder exists while the workers write their shards and the HF export (asked
    #    for here so that the save lasts seconds) is converted, before the rename.
    ckpts, log = out / "checkpoints", tmp_path / "killed.log"
    # The process is the subject here: it is killed, so it runs in a child of its own.
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cli_command("+recipe=grpo_tiny", *SMALL, f"trainer.output_dir={out}")
            + ["trainer.export_hf=true"],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=clean_env(),
            start_new_session=True,
        )
        while not (ckpts / ".tmp_step_00000006").exists():
            if proc.poll() is not None:
                pytest.fail("the run never reached the step-6 save:\n" + log.read_text()[-5000:])
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    # The driver's Ray (head and workers) share its session: end them as a node failure would.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    time.sleep(2)
    assert "resumed from" in log.read_text() and "at step 3" in log.read_text()
    assert (ckpts / "latest").read_text() == "step_00000003"
    assert not (ckpts / "step_00000006").exists() and (ckpts / ".tmp_step_00000006").is_dir()
    assert [m["step"] for m in read_metrics(out)] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]  # the killed run had logged 4-6

    # 3. The same command resumes from step 3 (the previous checkpoint) and redoes 4-6.
    console = run(out)
    assert f"resumed from {ckpts / 'step_00000003'} at step 3" in console
    assert "dropped 3 lines" in console
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert not (ckpts / ".tmp_step_00000006").exists()
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003", "step_00000006"]

    # Resume is exact: every logged metric (rewards, losses, grad norms, validation) and the
    # final model, optimizer and LR schedule equal those of the straight run, bit for bit.
    # (vLLM samples each response with its own seed, derived from (seed, group, copy), and
    # resumed ranks rebuild the same engine from the same weights.)
    resumed, reference = read_metrics(out), read_metrics(straight)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, reference):
        assert deterministic(a) == deterministic(b), a["step"]
    assert all("val/pass@4" in m for m in resumed if m["step"] in (3, 6))
    assert (
        reference[-1]["actor/grad_norm"] > 0
        and reference[0]["actor/entropy"] != reference[-1]["actor/entropy"]
    )
    mine = load_shards(ckpts / "step_00000006", tmp_path)
    theirs = load_shards(straight / "checkpoints" / "step_00000006", tmp_path)
    assert mine["extra"]["weights_version"] == 6 and mine["scheduler"]["last_epoch"] == 12
    assert_identical(mine, theirs, "actor")


def test_export_loads_in_transformers_and_vllm_with_the_trainers_logprobs(
    tmp_path: Path, straight: Path
) -> None:
    checkpoint = straight / "checkpoints" / "step_00000006"
    export = tmp_path / "hf"
    cmd = [
        sys.executable,
        "-m",
        "rlframe.export",
        str(straight),
        str(export),
    ]  # a run dir: its latest
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, timeout=300)
    # The trainer's own export (trainer.export_hf=true) holds the same weights.
    from safetensors.torch import load_file

    mine, theirs = (
        load_file(export / "model.safetensors"),
        load_file(checkpoint / "hf" / "model.safetensors"),
    )
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)

    script = str(REPO / "tests" / "e2e" / "export_logprobs.py")
    samples, hf, fsdp, initial = (tmp_path / f"{n}.json" for n in ("vllm", "hf", "fsdp", "initial"))
    env = clean_env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    for args in (
        ["vllm", str(export), str(samples)],
        ["hf", str(export), str(samples), str(hf)],
        ["fsdp", str(checkpoint), str(samples), str(fsdp)],
        ["hf", str(checkpoint / "hf_config"), str(samples), str(initial)],
    ):
        if args[1].endswith("hf_config"):
            from rlframe.data.tiny_model import resolve_model_path

            args[1] = resolve_model_path("tiny:0")  # the untrained model, for contrast
        result = subprocess.run(
            [sys.executable, script, *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            env=env,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]

    sampled = torch.tensor([row["logprobs"] for row in json.loads(samples.read_text())])
    by_hf, by_fsdp, by_initial = (
        torch.tensor(json.loads(p.read_text())) for p in (hf, fsdp, initial)
    )
    hf_gap, vllm_gap = (by_hf - by_fsdp).abs().max().item(), (sampled - by_fsdp).abs().max().item()
    print(
        f"export: max |log-prob gap| to the trainer's FSDP engine: transformers {hf_gap:.2e}, "
        f"vLLM {vllm_gap:.2e}"
    )
    assert hf_gap <= 1e-5 and vllm_gap <= 1e-5
    # Not vacuous: the trained weights score the responses differently from the initial ones.
    assert (by_initial - by_fsdp).abs().max().item() > 1e-3


def test_run_directory_in_use_is_refused_before_ray(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for resume in ("auto", "never"):
        result = check_cli(
            "+recipe=grpo_tiny", *SMALL, f"trainer.output_dir={out}", f"trainer.resume={resume}"
        )
        assert result.returncode == 2
        assert f"trainer.output_dir: {out} already holds a run (metrics.jsonl)" in result.stderr
        assert "rlframe: ray" not in result.stdout and not (out / "logs").exists()
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
