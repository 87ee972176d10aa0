"""A rule reward that cannot score a fixed tenth of the samples, for the masking run
(tests/e2e/test_masked_run.py): it raises for every (prompt, response) pair whose CRC-32 is
0 mod 10, as a judge or sandbox that is down would, and scores the others as the
quickstart's ``char_match`` does."""

from __future__ import annotations

import zlib
from typing import Any

from rlframe.rewards.rules import score_char_match


def is_unavailable(prompt: str, response: str) -> bool:
    """The same answer for a pair in every process (``hash`` is salted per process)."""
    return zlib.crc32(f"{prompt}\x00{response}".encode()) % 10 == 0


def char_match_or_unavailable(response: str, ground_truth: str, sample: dict[str, Any]) -> float:
    if is_unavailable(str(sample["prompt"]), response):
        raise ConnectionError("the scoring service is unavailable")
    return score_char_match(response, ground_truth, sample)
