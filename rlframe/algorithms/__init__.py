"""Algorithms as pure tensor functions: advantage estimators and losses, in registries."""
