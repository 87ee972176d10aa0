"""Images in prompt rows: where they go, what a row may name, and the mrope positions of
rows with images (against transformers' own Qwen2-VL ``get_rope_index``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from rlframe.data.images import place_images, read_image_bytes
from rlframe.mrope import ImageTokens, compute_mrope_positions
from rlframe.protocol import Batch
from rlframe.sequence_layout import RowImages, build_layout
from tests.harness import check_cli
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


def rows_with_images() -> tuple[Batch, RowImages]:
    """Two rows, left-padded prompts: the first with a 1x4x4 image (4 tokens), the second
    with none; right-padded responses."""
    prompt = torch.tensor(
        [[0, 0, 52, IMAGE, IMAGE, IMAGE, IMAGE, 53, 9], [0, 0, 0, 0, 0, 0, 0, 8, 9]]
    )
    batch = Batch(
        {
            "prompt_ids": prompt,
            "prompt_mask": (prompt != 0).long(),
            "response_ids": torch.tensor([[10, 11, 0], [12, 13, 14]]),
            "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        }
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
        ("vlm_tiny", "model.lora.rank=8", "model.lora.rank", "not supported"),
        # The openai agent's server would send the image pads without their images.
        ("vlm_tiny", "rollout.agent=openai", "rollout.agent", "not supported"),
    ],
)
def test_vision_settings_fail_before_ray(recipe: str, override: str, key: str, text: str) -> None:
    outcome = check_cli(f"+recipe={recipe}", *override.split())
    assert_config_error(outcome, key, text, alone=False)
