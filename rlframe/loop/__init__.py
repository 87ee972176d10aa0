"""rlframe/loop: TODO docstring."""
