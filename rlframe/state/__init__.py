"""What a run keeps on disk and reads back: checkpoints, the run directory, save failures, the
export."""
