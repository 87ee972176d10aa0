"""workers/sync: TODO docstring."""
