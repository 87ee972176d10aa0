"""Images in prompt rows: where they go, what a row may name, and the mrope positions of
rows with images (against transformers' own Qwen2-VL ``get_rope_index``)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from rlframe.core.mrope import ImageTokens, compute_mrope_positions
from rlframe.core.sequence_layout import RowImages, build_layout
from rlframe.core.train_batch import TrainBatch
from rlframe.models.images import load_processor, place_images, read_image_bytes
from tests.harness import REPO, check_cli, clean_env
from tests.unit.cli_errors import assert_config_error

IMAGE = 54
TOKENS = ImageTokens(IMAGE, 2)


def test_markers_place_images_in_order_and_unmarked_rows_get_them_first() -> None:
    turns = [{"role": "system", "content": "s"}, {"role": "user", "content": "a<image>b<image>"}]
    placed = place_images(turns, 2, "row 0")
    assert placed[0]["content"] == [{"type": "text", "text": "s"}]
    assert placed[1]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image"},
        {"type": "text", "text": "b"},
        {"type": "image"},
    ]
    front = place_images([{"role": "user", "content": "colour?"}], 1, "row 1")
    assert front[0]["content"] == [{"type": "image"}, {"type": "text", "text": "colour?"}]
    with pytest.raises(ValueError, match="row 2: 1 '<image>' markers for 2 images"):
        place_images([{"role": "user", "content": "<image>"}], 2, "row 2")


def test_an_image_is_a_path_bytes_or_a_parquet_dict(tmp_path: Path) -> None:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(out, format="PNG")
    data = out.getvalue()
    (tmp_path / "a.png").write_bytes(data)
    for item in (
        data,
        str(tmp_path / "a.png"),
        {"bytes": data, "path": None},
        {"path": str(tmp_path / "a.png")},
    ):
        assert read_image_bytes(item, "row 0") == data
    with pytest.raises(ValueError, match="row 3: image 'nope.png': no such file"):
        read_image_bytes("nope.png", "row 3")


def test_mrope_positions_equal_transformers_get_rope_index() -> None:
    from transformers import Qwen2VLConfig, Qwen2VLModel

    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 60,
            "hidden_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
        },
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 1},
        image_token_id=IMAGE,
    )
    model = Qwen2VLModel(config)
    grids = torch.tensor([[1, 4, 6], [1, 8, 4]])
    ids = torch.tensor([5, 6, 52, *[IMAGE] * 6, 53, 7, 8, 52, *[IMAGE] * 8, 53, 9, 10, 11])
    expected, _ = model.get_rope_index(ids[None], (ids == IMAGE).int()[None], grids)
    torch.testing.assert_close(compute_mrope_positions(ids, grids, TOKENS), expected[:, 0])
    with pytest.raises(ValueError, match="holds 14 image tokens, its 1 images need 6"):
        compute_mrope_positions(ids, grids[:1], TOKENS)


def rows_with_images() -> tuple[TrainBatch, RowImages]:
    """Two rows, left-padded prompts: the first with a 1x4x4 image (4 tokens), the second
    with none; right-padded responses."""
    prompt = torch.tensor(
        [[0, 0, 52, IMAGE, IMAGE, IMAGE, IMAGE, 53, 9], [0, 0, 0, 0, 0, 0, 0, 8, 9]]
    )
    response_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    batch = TrainBatch(
        prompt_ids=prompt,
        prompt_mask=(prompt != 0).long(),
        response_ids=torch.tensor([[10, 11, 0], [12, 13, 14]]),
        response_mask=response_mask,
        loss_mask=response_mask,
    )
    images = RowImages(torch.zeros(16, 8), torch.tensor([[1, 4, 4]]), [1, 0], TOKENS)
    return batch, images


def test_packed_and_padded_layouts_give_every_token_the_same_mrope_position() -> None:
    batch, images = rows_with_images()
    padded = build_layout(batch, packed=False, images=images)
    packed = build_layout(batch, packed=True, images=images)
    assert padded.position_ids.shape == (3, 2, 12) and packed.position_ids.shape == (4, 1, 14)
    real = padded.attention_mask.bool()
    torch.testing.assert_close(packed.position_ids[1:, 0], padded.position_ids[:, real])
    # Text positions restart per packed row: they delimit the sequences.
    assert packed.position_ids[0, 0].tolist() == [*range(9), *range(5)]
    # Row 0: the 2x2 merged grid at 1..2, then text from 1 + 2 on; its response continues.
    assert padded.position_ids[1, 0, real[0]].tolist() == [0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert torch.equal(packed.image_grid_thw, images.grid_thw)


def test_geometry3k_prepare_writes_image_rows_the_tiny_vlm_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image
    from transformers import AutoTokenizer

    from rlframe.data.prepare import prepare
    from rlframe.data.prompts import read_prompt_rows, tokenize_prompts
    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    out = io.BytesIO()
    Image.new("RGB", (56, 84), (9, 9, 9)).save(out, format="PNG")
    source = tmp_path / "hub"
    source.mkdir()
    for split in ("train", "test"):
        rows = {
            "images": [[{"bytes": out.getvalue(), "path": "a.png"}]],
            "problem": ["<image>Find x."],
            "answer": ["3"],
        }
        pq.write_table(pa.table(rows), source / f"{split}.parquet")
    prepare("geometry3k", tmp_path / "geo", source)
    file = str(tmp_path / "geo" / "train.parquet")
    rows = read_prompt_rows([file], "arithmetic", 0)
    row = rows[0][0]
    assert row["images"][0]["bytes"] == out.getvalue() and row["ground_truth"] == "3"
    # The tiny VLM reads the file: its one image (56 x 84 pixels: 4 x 6 patches) becomes 6
    # image tokens after the marker's vision start.
    path = resolve_tiny_vl_path("tiny-vl:0", cache_dir=tmp_path / "models")
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [({**row, "prompt": "<image>x?"}, where) for row, where in rows]
    (record,) = tokenize_prompts(rows, tokenizer, 64).records
    assert record.prompt_ids[:8] == [52, *[IMAGE] * 6, 53] and record.images == [out.getvalue()]
    assert "images" not in record.extra


@pytest.mark.parametrize(
    "recipe,override,key,text",
    [
        ("grpo_tiny", "model.freeze_vision=true", "model.freeze_vision", "has no vision tower"),
        # Under LoRA the vision tower keeps its weights: its layers take no adapters.
        (
            "vlm_tiny",
            "model.lora.rank=8 model.lora.target_modules=[q_proj,qkv]",
            "model.lora.target_modules",
            "['qkv'] are layers of the vision tower",
        ),
        # The openai agent's server would send the image pads without their images.
        ("vlm_tiny", "rollout.agent=openai", "rollout.agent", "not supported"),
        # Level 2 drops every weight; the sync after waking skips a tower that does not train.
        (
            "vlm_tiny",
            "rollout.sleep_level=2 model.freeze_vision=true",
            "rollout.sleep_level",
            "discards the vision tower's weights",
        ),
    ],
)
def test_vision_settings_fail_before_ray(recipe: str, override: str, key: str, text: str) -> None:
    outcome = check_cli(f"+recipe={recipe}", *override.split())
    assert_config_error(outcome, key, text, alone=False)


def test_image_rows_on_a_text_model_name_the_missing_vision_tower(tmp_path: Path) -> None:
    """A text-only model given rows with images: the cause is named (the model has no vision
    tower), for a visual task and for a file (issue 46: "the tokenizer [has] no chat
    template", a symptom)."""
    from PIL import Image

    line = assert_config_error(
        check_cli("+recipe=grpo_tiny", "data.task=colour"), "data.task", "has no vision tower"
    )
    assert "chat template" not in line
    image = io.BytesIO()
    Image.new("RGB", (56, 56), "red").save(image, format="PNG")
    (tmp_path / "red.png").write_bytes(image.getvalue())
    rows = tmp_path / "rows.jsonl"
    row = {"prompt": "colour?", "ground_truth": "r", "images": [str(tmp_path / "red.png")]}
    rows.write_text("\n".join(json.dumps(row) for _ in range(20)))
    line = assert_config_error(
        check_cli(
            "+recipe=grpo_tiny",
            f"data.train_files=[{rows}]",
            "data.batch_size=4",
            "actor.mini_batch_size=64",
            "actor.micro_batch_size=64",
        ),
        "data.train_files",
        f"{rows} row 0: the row has images, but the model",
        "has no vision tower",
    )


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


@pytest.mark.parametrize("damage", ["random-bytes", "truncated", "corrupted"])
def test_an_undecodable_image_is_one_line_naming_its_row(tmp_path: Path, damage: str) -> None:
    """Row 3 of twenty holds an image PIL cannot read: one config-error line naming the file,
    the row and the image (issue 46: a 47-line PIL.UnidentifiedImageError naming no row)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buffer, format="PNG")
    good = buffer.getvalue()
    bad = {
        "random-bytes": bytes(range(256)) * 4,
        "truncated": good[: len(good) // 2],
        # The header reads, a pixel-data byte is flipped: PIL's integrity check sees it.
        "corrupted": flip(good, good.index(b"IDAT") + 8),
    }[damage]
    (tmp_path / "good.png").write_bytes(good)
    (tmp_path / "bad.png").write_bytes(bad)
    rows = tmp_path / "rows.jsonl"
    lines = []
    for i in range(20):
        image = tmp_path / ("bad.png" if i == 3 else "good.png")
        row = {"prompt": "colour?", "ground_truth": "r", "images": [str(image)]}
        lines.append(json.dumps(row))
    rows.write_text("\n".join(lines))
    result = check_cli(
        "+recipe=vlm_tiny",
        f"data.train_files=[{rows}]",
        "data.batch_size=4",
        "actor.mini_batch_size=32",
        "actor.micro_batch_size=32",
    )
    line = assert_config_error(
        result, "data.train_files", f"{rows} row 3: image 0 cannot be decoded", alone=False
    )
    print(line)
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_resume_with_another_processor_fails_before_ray(tmp_path: Path) -> None:
    """A checkpoint's ``hf_config`` processor against the model's: the same settings pass;
    another ``max_pixels`` (other image token counts) stops the resume before Ray, naming the
    setting with both values."""
    import json

    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
    from rlframe.models.images import find_processor_change

    model = resolve_tiny_vl_path("tiny-vl:0")
    same, checkpoint = tmp_path / "same", tmp_path / "run" / "checkpoints" / "step_00000002"
    for folder in (same, checkpoint / "hf_config"):
        load_processor(model).save_pretrained(folder)
    assert find_processor_change(same, model) is None
    assert find_processor_change(tmp_path / "text_model_checkpoint", model) is None
    saved = checkpoint / "hf_config" / "processor_config.json"
    config = json.loads(saved.read_text())
    config["image_processor"]["size"]["longest_edge"] *= 4
    saved.write_text(json.dumps(config))
    (checkpoint / "driver_state.json").write_text(json.dumps({"step": 2, "seed": 0}))
    outcome = check_cli("+recipe=vlm_tiny", f"trainer.resume={checkpoint}")
    assert_config_error(
        outcome, "model.path", "image_processor.size.longest_edge: 50176 in the checkpoint, 12544"
    )


def test_a_hub_models_processor_is_saved_with_the_checkpoint(tmp_path: Path) -> None:
    """A model named by its hub id (``Qwen/Qwen2.5-VL-7B-Instruct``: no local folder) has its
    processor written beside the checkpoint's config too; served here from an offline hub
    cache holding the tiny VLM (a fresh process: the hub cache is read at import)."""
    import shutil
    import subprocess
    import sys

    from rlframe.data.tiny_vl_model import resolve_tiny_vl_path

    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny-vl" / "snapshots" / ("0" * 40)
    shutil.copytree(resolve_tiny_vl_path("tiny-vl:0"), snapshot)
    (snapshot / "model.safetensors").unlink()  # the processor and config are what is read
    (cache / "models--acme--tiny-vl" / "refs").mkdir()
    (cache / "models--acme--tiny-vl" / "refs" / "main").write_text("0" * 40)
    dest = tmp_path / "hf_config"
    code = "from rlframe.models.images import save_processor\n"
    code += f"save_processor('acme/tiny-vl', {str(dest)!r})"
    env = clean_env({"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (dest / "processor_config.json").is_file()
