"""A rule reward that sometimes hangs or raises, for the reward-pool e2e test."""

import time


def char_match_or_fail(response: str, ground_truth: str, sample: dict) -> float:
    """char_match, except: a response starting with '7' hangs, one starting with '8' raises."""
    if response.startswith("7"):
        time.sleep(3600)
    if response.startswith("8"):
        raise RuntimeError("flaky reward")
    answer = response.split("\n", 1)[0].strip()
    longest = max(len(answer), len(ground_truth))
    return 1.0 if longest == 0 else sum(a == b for a, b in zip(answer, ground_truth)) / longest
