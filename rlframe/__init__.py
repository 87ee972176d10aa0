"""rlframe: a Ray single-controller framework for RL post-training of language models.

The driver side lives here and imports without vLLM or a GPU; the worker side is the
``workers`` package.
"""

from rlframe.core.moved import install_moved_finder

__version__ = "0.1.0"

install_moved_finder()
