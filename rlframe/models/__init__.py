"""rlframe/models: TODO docstring."""
