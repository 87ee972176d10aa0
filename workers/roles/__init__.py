"""workers/roles: TODO docstring."""
