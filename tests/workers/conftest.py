"""Fixtures of the in-process engine tests: the tiny model, the tiny VLM, and a one-rank gloo
group that the packing and micro-batch tests share (``one_rank_group``)."""

from __future__ import annotations

import pytest

from rlframe.data.tiny_model import resolve_model_path
from rlframe.data.tiny_vl_model import resolve_tiny_vl_path
from tests.workers.layout_cases import join_one_rank_group


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path("tiny:0", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny vision-language model (Qwen2-VL) with its processor."""
    return resolve_tiny_vl_path("tiny-vl:0", cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def one_rank_group() -> None:
    """This process as rank 0 of a one-rank gloo group, as a lone worker would be."""
    join_one_rank_group()
