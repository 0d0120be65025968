"""What runs beside the stages: the verifier's models (cache, configs read without weights, identity, the match of a
store or drafter with its verifier), the vLLM runtime, chat rendering and answer parsing as the serving stack does
them (``chat/``), and progress lines. Imports ``stores`` only; ``peagle_data`` and ``peagle_train`` both import it."""
