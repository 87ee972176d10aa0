"""The roles a worker process holds: training (the policy under FSDP2) and rollout (an
engine)."""
