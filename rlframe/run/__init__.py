"""rlframe/run: TODO docstring."""
