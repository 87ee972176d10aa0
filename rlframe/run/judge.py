"""The reward stage's judge, wired on the driver: the served ``judge`` behind a
:class:`~rlframe.judges.client.JudgeClient` with the judge's own tokenizer and stop ids."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlframe.config import Config
from rlframe.config.served import ServedPlacement
from rlframe.rollout.served import ServedModel

if TYPE_CHECKING:
    from rlframe.core.tokenizer import Tokenizer
    from rlframe.judges.stage import JudgeStage


def build_judge_stage(cfg: Config, served: dict[str, ServedModel], path: str) -> JudgeStage | None:
    """The reward stage's judge (``reward.judge``) over the served ``judge``, with the
    judge's own tokenizer (from ``path``, its folder) and its stop ids; None without one."""
    from rlframe.judges.client import JudgeClient
    from rlframe.judges.stage import JudgeStage

    judge = served.get("judge")
    if judge is None:
        return None
    tokenizer = load_judge_tokenizer(path, cfg.model.trust_remote_code)
    client = JudgeClient(judge.client, tokenizer, cfg.reward.judge, read_stop_ids(path, tokenizer))
    retry = cfg.reward.retry_on_error
    if judge.spec.serving.placement is ServedPlacement.colocated:
        return JudgeStage(client, judge.sleep, judge.client.open, retry)
    return JudgeStage(client, retry=retry)  # its own pool: awake throughout


def load_judge_tokenizer(path: str, trust_remote_code: bool) -> Tokenizer:
    from transformers import AutoTokenizer

    from rlframe.core.tokenizer import as_tokenizer

    return as_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def read_stop_ids(path: str, tokenizer: Tokenizer) -> tuple[int, ...]:
    """What ends the judge's verdict: its tokenizer's EOS and its generation config's EOS ids
    (an instruct model's end-of-turn token: Qwen's ``<|im_end|>``)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))
