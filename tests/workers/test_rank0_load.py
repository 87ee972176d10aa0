"""Only rank 0 reads the checkpoint (desk check item 8): the other ranks build the model on
the meta device and get their shards and buffers from rank 0. Two real gloo ranks in two
processes; rank 1's model directory holds the config alone, so any read of the weights there
fails, and its model must still equal the checkpoint, forward pass included. The policy (plain
and with LoRA) and the reward model's worker."""

from __future__ import annotations

import multiprocessing as mp
import shutil
from pathlib import Path

import pytest
import torch

from rlframe.config import ModelConfig
from rlframe.config.lora import LoraConfig
from rlframe.data.tiny_model import resolve_model_path
from rlframe.data.tiny_reward_model import resolve_reward_model_path
from tests.workers.layout_cases import free_port, set_rank_env


def check_reward_model(rank: int, paths: list[str], full: str) -> list[str]:
    """The reward model's worker, loaded the same way: its scores equal rank 0's and a plain
    transformers forward's."""
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from rlframe.config import ActorConfig, Config, DataConfig, RewardConfig, RewardModelConfig
    from rlframe.config import TrainerConfig as Trainer
    from workers.reward_model import RewardModelWorker

    cfg = Config(
        model=ModelConfig(path="tiny:0"),
        data=DataConfig(batch_size=4),
        actor=ActorConfig(mini_batch_size=16),
        reward=RewardConfig(model=RewardModelConfig(path="tiny-rm:0")),
        trainer=Trainer(total_steps=1, device="cpu"),
    )
    worker = RewardModelWorker(cfg, paths[rank], "cpu")
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    scores = worker.score_rows(rows)
    gathered = [torch.empty_like(scores) for _ in range(2)]
    dist.all_gather(gathered, scores)
    plain = AutoModelForSequenceClassification.from_pretrained(full, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.tensor(
            [float(plain(input_ids=torch.tensor([r])).logits[0, 0]) for r in rows]
        )
    problems = []
    if not torch.equal(gathered[0], gathered[1]):
        problems.append(f"reward model: scores {gathered} differ between the ranks")
    if not torch.allclose(scores, expected, atol=1e-5):
        problems.append(f"reward model: scores {scores} differ from the checkpoint's {expected}")
    return problems


def check_rank(
    rank: int, port: int, paths: list[str], full: str, rm_paths: list[str], out: mp.Queue
) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from workers.training.dtensor_gather import full_tensor
    from workers.training.fsdp import FSDPEngine

    set_rank_env(rank, 2, port)
    dist.init_process_group("gloo")
    problems = []
    try:
        reference = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32)
        ids = torch.arange(1, 17).reshape(2, 8)
        for lora in (None, LoraConfig(rank=4)):
            torch.manual_seed(rank)  # rank 0's adapter init must reach rank 1, not its own
            engine = FSDPEngine(paths[rank], ModelConfig(path=paths[rank]), None, "cpu", lora=lora)
            tag = "lora" if lora else "plain"
            state = {k: full_tensor(v) for k, v in engine.model.state_dict().items()}
            for k, v in engine.model.named_buffers():
                gathered = [torch.empty_like(v) for _ in range(2)]
                dist.all_gather(gathered, v)
                if not torch.equal(gathered[0], gathered[1]):
                    problems.append(f"{tag}: buffer {k} differs from rank 0's")
            for k, v in state.items():
                gathered = [torch.empty_like(v) for _ in range(2)]
                dist.all_gather(gathered, v.contiguous())
                if not torch.equal(gathered[0], gathered[1]):
                    problems.append(f"{tag}: {k} differs from rank 0's")
            if lora is None:
                for k, v in reference.state_dict().items():
                    if not torch.equal(state[k], v):
                        problems.append(f"{tag}: {k} differs from the checkpoint")
            with torch.no_grad():
                logits = engine.model(input_ids=ids, use_cache=False).logits
                expected = reference(input_ids=ids, use_cache=False).logits
            gap = float((logits - expected).abs().max())
            if gap > 1e-5:
                problems.append(f"{tag}: logits differ from the checkpoint's by {gap}")
        problems += check_reward_model(rank, rm_paths, rm_paths[0])
    except Exception as e:  # noqa: BLE001 - reported to the test, which names the rank
        problems.append(f"{type(e).__name__}: {e}")
    out.put((rank, problems))


@pytest.mark.timeout(180)
def test_only_rank_zero_reads_the_weights(tmp_path: Path) -> None:
    full = resolve_model_path("tiny:0", cache_dir=tmp_path / "models")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(Path(full) / "config.json", config_only / "config.json")
    rm_full = resolve_reward_model_path("tiny-rm:0", cache_dir=tmp_path / "models")
    rm_config_only = tmp_path / "rm_config_only"
    shutil.copytree(rm_full, rm_config_only, ignore=shutil.ignore_patterns("*.safetensors"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    rm_paths = [rm_full, str(rm_config_only)]
    args = [(r, port, [full, str(config_only)], full, rm_paths, out) for r in range(2)]
    procs = [ctx.Process(target=check_rank, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        results = dict(out.get(timeout=150) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert results == {0: [], 1: []}, results
