"""Decoding (docs/design.md §9): peagle's speculative decoders and the Python inference API.

K drafted tokens per step (``num_depths``), V verifier vocab, D draft vocab.

Modules: :mod:`.speculative` (the chain: drafting, rejection sampling, greedy and plain decoding), :mod:`.tree`
(tree verification), :mod:`.verifier` (the verifier's side of decoding: its passes, cache and aux states),
:mod:`.identity` (greedy token identity as the dtype allows), :mod:`.render` (chat messages to token ids and back),
:mod:`.checks` (a drafter against its verifier before weights load), :mod:`.inference` (the Python API:
``PEAGLEInference``), :mod:`.vllm_engine` (vLLM as the engine; imports vLLM only when run). This package imports
nothing of :mod:`peagle_train.evaluate` (which evaluates through it). Callers import from these modules; this
package re-exports nothing.
"""
