"""The core data types every other folder builds on (Batch, layouts, positions, registries);
imports nothing else of rlframe."""
