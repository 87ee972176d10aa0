"""Rollout engines behind one protocol (token ids in; tokens and log-probs out): vLLM and
HF."""
