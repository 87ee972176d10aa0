"""workers/model_hooks: TODO docstring."""
