"""Models and engines: the model cache, configs read without weights, the verifier match, the vLLM runtime."""
