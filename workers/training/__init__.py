"""workers/training: TODO docstring."""
