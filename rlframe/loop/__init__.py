"""The training loop (``Trainer.step``) and what it does around each step: metrics, the sync
check, validation."""
