"""Load an exported vision-language model as its users would and generate with an image:

    python tests/e2e/vision_export_check.py EXPORT_DIR OUT.json

transformers (``AutoProcessor`` + ``AutoModelForImageTextToText``) and vLLM (``LLM`` on the
folder, the image as multi-modal data) each answer the ``colour`` task's first prompt
greedily; OUT.json gets both token lists and the processor's prompt ids. Its own process:
vLLM and a test session's torch.distributed group do not mix.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

MAX_TOKENS = 6


def main(export: str, out: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vllm import LLM, SamplingParams

    from rlframe.data.visual_tasks import make_colour
    from rlframe.models.images import decode_image

    prompt, _, images = make_colour(random.Random(0))
    image = decode_image(images[0])
    processor = AutoProcessor.from_pretrained(export)
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(turns, tokenize=False)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    model = AutoModelForImageTextToText.from_pretrained(export, dtype=torch.float32)
    hf = model.generate(
        **inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    llm = LLM(model=export, dtype=torch.float32, enforce_eager=True, max_model_len=64, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (served,) = llm.generate(
        {"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False
    )
    result = {
        "prompt_ids": prompt_ids,
        "vllm_prompt_ids": list(served.prompt_token_ids),
        "hf": hf[0, len(prompt_ids) :].tolist(),
        "vllm": list(served.outputs[0].token_ids),
    }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
