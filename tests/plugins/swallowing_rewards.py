"""A reward file whose import swallows whatever interrupts it, as some libraries' imports do (a
bare ``except`` around an optional import), for the interrupt test. The first import (the
driver's check of ``reward.fn``) writes the marker ``RLFRAME_TEST_IMPORT_MARKER`` names, then
waits for the signal."""

import os
import time
from pathlib import Path

MARKER = os.environ.get("RLFRAME_TEST_IMPORT_MARKER")
if MARKER and not Path(MARKER).exists():
    Path(MARKER).write_text("importing")
    try:
        time.sleep(30)
    except BaseException:  # noqa: BLE001 - what this file stands for: a swallowed signal
        pass


def char_match(response: str, ground_truth: str, sample: dict) -> float:
    """1 for a first line equal to the ground truth, else 0."""
    return float(response.split("\n", 1)[0].strip() == ground_truth)
