"""``peagle-data regenerate``: the run and its config, and the back ends that answer (local verifier or
OpenAI-compatible servers)."""
