"""rlframe/state: TODO docstring."""
