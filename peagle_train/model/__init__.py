"""The drafter: its config, RoPE, attention backends, mask token and checkpoint format (speculators / vLLM)."""
