"""workers/inference: TODO docstring."""
