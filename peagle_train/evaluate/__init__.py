"""Drafter evaluation (docs/design.md §9): offline acceptance on stored features, online speculative decoding.

Legend: T tokens in a block, n tokens in a segment, L aux layers, H hidden size, V verifier vocab,
D draft vocab, K drafted tokens per step (``num_depths``), E drafter elements, A anchors.

Offline (:func:`.offline.evaluate_offline`, :func:`.offline.run_offline_eval`): on held-out blocks, every chain
``(a, 0..K-1)`` without sampling (alignment of §4). Element ``(a, d)`` is *correct* when the
drafter's argmax, mapped to a verifier id, equals the verifier's argmax over its full vocab
(``argmax lm_head(f_{a+d+1})``): exactly the test online greedy verification applies, so a token
outside the draft vocab is never drafted correctly. (Training's per-depth accuracy compares argmaxes
within the draft vocab and is therefore higher when the draft vocab is reduced.)
- per-depth accuracy: weighted agreement at depth d, weight ``m_{a+d+2}``. Within one segment the
  depth-d elements predict the tokens ``x_{d+2}..x_{n-1}``, so the depth-d weight is
  ``sum(m[d+2:])``: equal at every depth whenever the first K+1 tokens of each segment carry no
  loss (a system or user turn first: the usual case). Equal *correct* counts at depths >= 1 then
  mean the drafter drafts the same tokens at every depth > 0 (e.g. one frequent token);
- a chain is accepted up to the first depth that is wrong, does not exist (segment end), has
  weight 0 (a token the verifier does not generate as the assistant) or whose target is an EOS
  token (generation ends there whatever is drafted, so, as online, that depth is not scored);
  anchors count when their depth-0 element has weight 1 and a target that is not an EOS
  (``positions_scored``);
- per-position conditional acceptance: P(depth i accepted | depths < i accepted, (a, i) exists);
- simulated acceptance length: ``1 + mean accepted`` (bonus token counted).

Online (:func:`.online.evaluate_prompts`, :func:`.online.run_online_eval`, generating through
:class:`peagle_train.generate.inference.PEAGLEInference`): per prompt turn, plain greedy decoding and greedy
speculative decoding (:mod:`peagle_train.generate.speculative`, or with a tree :mod:`peagle_train.generate.tree`) with
the same verifier, compared token
for token; with ``temperature > 0`` plain sampling and speculative sampling (rejection sampling, seeded
per prompt turn), which are not compared token for token. Acceptance length, rate and per-position acceptance are counted as vLLM reports them:
``AL = 1 + accepted / steps`` over verifier steps that checked at least one draft.

Modules: :mod:`.config` (``EvalConfig``), :mod:`.prompts` (reading evaluation prompts), :mod:`.checks` (before
weights load), :mod:`.online`, :mod:`.offline`, :mod:`.replay`, :mod:`.cost_model`, :mod:`.report`, :mod:`.run`
(one ``peagle-eval`` run: ``plan_eval`` into an ``EvalPlan``, what it resolved before any weights, then
``evaluate_plan``), :mod:`.vllm_eval` (``--engine vllm``). Decoding and the Python API are :mod:`peagle_train.generate`'s, which
imports nothing of this package. Callers import from these modules; this package re-exports nothing.
"""
