"""Weight transports from the training role to a rollout engine, and the receiver's probe
check."""
