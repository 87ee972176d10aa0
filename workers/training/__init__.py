"""The FSDP2 training engine: model build, forward over a layout, log-probs, sequence
parallelism, LoRA, checkpoints."""
