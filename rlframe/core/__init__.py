"""rlframe/core: TODO docstring."""
