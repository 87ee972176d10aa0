"""bench/gpu_check.py, the one-command check for a lent GPU machine, runs here on CPU with
tiny shapes so that it cannot rot between GPU loans. It runs the way it must run there: with
torch, transformers and peft only (vLLM, Ray, omegaconf and flash-attn made unimportable)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABSENT_ON_THE_GPU_MACHINE = ("vllm", "ray", "omegaconf", "hydra", "flash_attn")


def test_gpu_check_runs_on_cpu_without_vllm_or_ray(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    launch = (
        "import runpy, sys\n"
        f"for name in {ABSENT_ON_THE_GPU_MACHINE!r}:\n"
        "    sys.modules[name] = None  # any import of it raises ImportError\n"
        f"sys.argv = ['gpu_check.py', '--device', 'cpu', '--tiny', '--out', {str(out)!r}]\n"
        "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", launch],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    sections = ("matmul_peak", "update", "packing", "chunked_logprobs", "lora", "ipc_handoff")
    for name in sections:
        assert figures[name].get("passed", True), (name, figures[name])
    assert figures["update"]["tokens_per_s"] > 0 and 0 < figures["update"]["mfu"]
    assert figures["packing"]["row_isolation_max_change"] == 0.0
    assert figures["lora"]["base_unchanged"] and figures["lora"]["adapter_moved"] > 0
