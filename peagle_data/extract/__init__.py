"""Hidden-state extraction: the options, the verifier engines (``hf``, ``vllm``), the store side and the run."""
