"""Prompt data: synthetic verifiable tasks, file loaders and the tiny offline model."""
