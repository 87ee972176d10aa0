"""Engines behind narrow protocols: FSDP2 training (fsdp.py) and rollout (vllm, hf)."""
