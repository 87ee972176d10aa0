"""The process side of rlframe: worker classes that run inside Ray actors.

``rlframe`` names these classes only by dotted path in the config, so the driver never
imports vLLM or initialises a GPU.
"""

from rlframe.core.moved import install_moved_finder

install_moved_finder()
