"""LoRA runs on the tiny model: a LoRA checkpoint holds the adapters (not the base), resumes
exactly, and exports as a peft adapter folder and as a merged model that transformers and vLLM
load with the trainer's log-probs; adapters serve multi-turn agents, validation and the KL
reference. Each sync mode in each placement (separate, rollout tensor parallelism) is the
``matrix`` tier: the syncs themselves are proven per mode by ``tests/workers/test_lora_sync.py``
and ``tests/workers/test_lora_adapter_sync.py``, the transports by
``tests/ray/test_weight_transport.py`` and ``tests/ray/test_rollout_tp.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import assert_identical, load_shards, resume_from_copy
from tests.harness import REPO, clean_env, deterministic, read_metrics, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

LORA_SMALL = [
    "trainer.total_steps=6",
    "data.batch_size=8",
    "rollout.n=8",
    "actor.mini_batch_size=32",
    "actor.micro_batch_size=32",
    "algorithm.entropy_coef=0.01",
    "trainer.save_every=3",
]


def run_lora(out: Path, *overrides: str, recipe: str = "grpo_tiny_lora") -> str:
    return run_recipe(out, *LORA_SMALL, *overrides, recipe=recipe).stdout


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Path:
    out = tmp_path_factory.mktemp("lora_straight") / "run"
    run_lora(out)
    return out


def test_lora_checkpoint_holds_adapters_and_resumes_exactly(tmp_path: Path, straight: Path) -> None:
    """Resume from a copy of the straight run's step-3 checkpoint redoes steps 4-6 exactly."""
    out = tmp_path / "run"
    resume_from_copy(straight, out, 3)
    ckpts = out / "checkpoints"
    console = run_lora(out)
    assert f"resumed from {ckpts / 'step_00000003'} at step 3" in console
    resumed, reference = read_metrics(out), read_metrics(straight)
    assert [m["step"] for m in resumed] == [m["step"] for m in reference] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, reference):
        assert deterministic(a) == deterministic(b), a["step"]
    mine = load_shards(ckpts / "step_00000006", tmp_path)
    theirs = load_shards(straight / "checkpoints" / "step_00000006", tmp_path)
    assert_identical(mine, theirs, "actor")
    # The adapters and their optimizer state, never the frozen base.
    assert mine["model"] and all("lora_" in k for k in mine["model"])
    assert mine["optim"]["state"] and all("lora_" in k for k in mine["optim"]["state"])


ON_POLICY = [*LORA_SMALL, "actor.mini_batch_size=64", "actor.micro_batch_size=64"]
"""One mini-batch of the step's 64 rows: an exactly on-policy update, which would take its own
log-probs as the old ones and skip the old-log-prob pass."""


def test_lora_dropout_keeps_the_sync_check_clean(tmp_path: Path) -> None:
    """``model.lora.dropout=0.1`` with an exactly on-policy update: the old log-probs come from
    the eval-mode pass, not from the update's own (dropout on), so the sync check reads the
    true rollout/trainer gap and the run goes on past step 2 (issue 46: exit 76 there, with
    lp_diff 4.8e-3)."""
    out = tmp_path / "run"
    run_recipe(
        out,
        *ON_POLICY,
        "trainer.total_steps=3",
        "trainer.save_every=0",
        "model.lora.dropout=0.1",
        recipe="grpo_tiny_lora",
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    print("LoRA dropout 0.1: lp_diff per step", [m["rollout/logprob_diff"] for m in metrics])
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics), metrics
    assert all("timing_s/old_logprob" in m for m in metrics)  # the pass ran


def test_resume_that_turns_lora_dropout_on(tmp_path: Path) -> None:
    """docs/long-runs.md: ``dropout`` may change on resume. Two steps without dropout, then the
    same command with ``model.lora.dropout=0.1`` resumes and runs steps 3 and 4 with a clean
    sync check."""
    out = tmp_path / "run"
    run_recipe(
        out, *ON_POLICY, "trainer.save_every=2", "trainer.total_steps=2", recipe="grpo_tiny_lora"
    )
    result = run_recipe(
        out,
        *ON_POLICY,
        "trainer.save_every=2",
        "trainer.total_steps=4",
        "model.lora.dropout=0.1",
        recipe="grpo_tiny_lora",
    )
    assert "changed keys: model.lora.dropout 0.0 -> 0.1" in result.stderr
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics[2:]), metrics[2:]


def score(mode: str, source: Path, samples: Path, out: Path) -> torch.Tensor:
    script = str(REPO / "tests" / "e2e" / "export_logprobs.py")
    env = clean_env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    args = [str(source), str(samples)] + ([] if mode == "vllm" else [str(out)])
    result = subprocess.run(
        [sys.executable, script, mode, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if mode == "vllm":
        return torch.tensor([row["logprobs"] for row in json.loads(samples.read_text())])
    return torch.tensor(json.loads(out.read_text()))


def test_lora_exports_load_in_peft_transformers_and_vllm(tmp_path: Path, straight: Path) -> None:
    checkpoint = straight / "checkpoints" / "step_00000006"
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    for dest, extra in ((adapter, []), (merged, ["--merge"])):
        subprocess.run(
            [sys.executable, "-m", "rlframe.export", str(straight), str(dest), *extra],
            check=True,
            capture_output=True,
            cwd=REPO,
            timeout=300,
        )
    assert (adapter / "adapter_model.safetensors").is_file()
    assert (adapter / "adapter_config.json").is_file()
    assert not (adapter / "model.safetensors").exists()
    from safetensors.torch import load_file

    names = list(load_file(merged / "model.safetensors"))
    assert names and not [n for n in names if "lora" in n or "base_layer" in n]

    samples = tmp_path / "samples.json"
    sampled = score("vllm", merged, samples, samples)  # vLLM loads the merged export
    by_hf = score("hf", merged, samples, tmp_path / "hf.json")
    by_peft = score("peft", adapter, samples, tmp_path / "peft.json")
    by_fsdp = score("fsdp", checkpoint, samples, tmp_path / "fsdp.json")
    gaps = {
        "vllm": (sampled - by_fsdp).abs().max().item(),
        "transformers": (by_hf - by_fsdp).abs().max().item(),
        "peft": (by_peft - by_fsdp).abs().max().item(),
    }
    print("LoRA export: max |log-prob gap| to the trainer's engine:", gaps)
    assert all(gap <= 1e-5 for gap in gaps.values()), gaps


@pytest.mark.matrix
@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_separate_placement_syncs_and_verifies(tmp_path: Path, sync: str) -> None:
    """One trainer rank and one rollout rank: the adapters (or merged weights) cross the
    broadcast, the rollout worker runs the receiver check on every push, and the rollout
    samples with the weights just sent."""
    out = tmp_path / "run"
    run_lora(
        out,
        "trainer.total_steps=3",
        "trainer.save_every=0",
        f"model.lora.sync={sync}",
        "rollout.placement=separate",
        "trainer.cpus_per_proc=1",
        "rollout.cpus_per_proc=1",
        "ray.num_cpus=2",
    )
    metrics = read_metrics(out)
    assert [m["rollout/weights_version"] for m in metrics] == [0, 1, 2]
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics)
    assert metrics[0]["actor/grad_norm"] > 0


def test_lora_adapters_serve_multi_turn_agents_validation_and_the_kl_reference(
    tmp_path: Path,
) -> None:
    """agent_tiny (multi-turn episodes) with adapter sync, a KL term (the reference is the
    policy with its adapters off) and validation: every turn and every validation prompt
    samples from the adapter just synced."""
    out = tmp_path / "run"
    run_recipe(
        out,
        "model.path=tiny-lora:0",
        "model.lora.rank=16",
        "model.lora.sync=adapter",
        "trainer.total_steps=3",
        "data.batch_size=8",
        "rollout.n=8",
        "actor.mini_batch_size=64",
        "actor.micro_batch_size=64",
        "algorithm.kl_coef=0.05",
        "trainer.val_every=3",
        "data.val_size=16",
        "val.n=2",
        recipe="agent_tiny",
    )
    metrics = read_metrics(out)
    assert [m["rollout/weights_version"] for m in metrics] == [0, 1, 2]
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics)
    assert metrics[-1]["actor/kl"] > 0  # the adapters moved away from the reference
    assert "val/reward/mean" in metrics[-1]


@pytest.mark.matrix
@pytest.mark.parametrize("sync", ["merged", "adapter"])
def test_lora_with_rollout_tensor_parallelism(tmp_path: Path, sync: str) -> None:
    """Two hybrid ranks holding one vLLM engine sharded in two: each rank streams the same
    tensors (merged) or registers the same adapter (adapter), and keeps its shard."""
    out = tmp_path / "run"
    run_lora(
        out,
        "trainer.total_steps=2",
        "trainer.save_every=0",
        "actor.micro_batch_size=16",
        f"model.lora.sync={sync}",
        "trainer.procs_per_node=2",
        "trainer.cpus_per_proc=1",
        "rollout.tensor_parallel_size=2",
    )
    metrics = read_metrics(out)
    assert [m["rollout/weights_version"] for m in metrics] == [0, 1]
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in metrics)
