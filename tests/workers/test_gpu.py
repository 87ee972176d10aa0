"""FSDP2 on CUDA in bf16 (needs a GPU; skipped without one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_bf16_fsdp_update_on_cuda() -> None:
    # A fresh process: this one may already hold a gloo group from the CPU tests.
    result = subprocess.run(
        [sys.executable, "-m", "tests.workers.gpu_update_check"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        cwd=REPO,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
