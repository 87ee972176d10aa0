"""rlframe/observability: TODO docstring."""
