"""Per-model-family hooks of the workers: weight names and layouts, router logits and replay,
vision inputs."""
