"""``EvalConfig``: what ``peagle-eval`` measures and on how much (docs/design.md §9)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("peagle", "vllm")
"""Online engines of ``peagle-eval --engine``: peagle's own speculative decoder (transformers), or vLLM."""

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
"""How drafts are picked at temperature > 0: vLLM's ``SpeculativeConfig.draft_sample_method`` values
(vLLM 0.32's default ``greedy``: the drafter's argmax, taken as certain, q one-hot, in rejection sampling;
``probabilistic``: a sample of the drafter's ``softmax(logits / T)``, accepted with ``min(1, p/q)``)."""

VLLM_LOADINGS = ("speculative_config", "speculators")
"""How ``--engine vllm`` gives vLLM the drafter: ``speculative_config`` (``LLM(model=VERIFIER,
speculative_config={"model": DRAFTER, "method": "eagle3", "parallel_drafting": True, ...})``) or
``speculators`` (``LLM(model=DRAFTER)``: vLLM reads ``speculators_config`` and loads the verifier it
names, as ``vllm serve DRAFTER`` does)."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What ``peagle-eval`` measures and on how much."""

    max_new_tokens: int = 128
    """Most tokens generated per prompt turn (--max-new-tokens)."""
    num_prompts: int | None = None
    """Prompts read from the file, from the top; None = all (--num-prompts)."""
    num_draft_tokens: int | None = None
    """K drafts per verifier step; None = the drafter's num_depths (--num-draft-tokens)."""
    max_blocks: int | None = None
    """Offline: most validation blocks scored; None = all."""
    chunk_anchors: int = 256
    """Offline: anchors whose chains run through the drafter at once (bounds memory)."""
    warmup: bool = True
    """Online: one short untimed generation first, so one-time costs do not count in tokens/s."""
    temperature: float = 0.0
    """Online: 0 = greedy (checked token for token); T > 0 = sampling at T, with rejection sampling (--temperature)."""
    seed: int = 0
    """Online, T > 0: prompt turn i samples with generators seeded ``(seed, i)`` (--seed)."""
    draft_sample_method: str = "greedy"
    """Online, T > 0: how drafts are picked, as vLLM's speculative config field: greedy (vLLM's default:
    the drafter's argmax, kept with probability p(draft)) or probabilistic (sampled from the drafter's
    softmax(logits / T), kept with probability min(1, p/q)); both keep the verifier's distribution."""
    engine: str = "peagle"
    """Online engine (--engine): ``peagle`` (its own speculative decoder on transformers; checks T > 0 too)
    or ``vllm`` (vLLM with and without the drafter: its acceptance counters, token identity with its own
    greedy output at T = 0, and tokens/s at concurrency 1 and --concurrency; needs vLLM installed)."""
    concurrency: int = 8
    """--engine vllm: the higher concurrency tokens/s is also measured at (requests running together)."""
    vllm_loading: str = "speculative_config"
    """--engine vllm: how vLLM loads the drafter: ``speculative_config`` (the verifier with a speculative
    config naming the drafter) or ``speculators`` (the drafter directory as the model, as ``vllm serve
    DRAFTER`` does; vLLM loads the verifier its config names)."""

    measure_costs: bool = True
    """Time a greedy step and, for every K <= num_depths, a drafter pass and a verifier pass over K+1 tokens on
    this machine, and report the expected speedup per K and the best K from the measured acceptance
    (``cost_model``; a few seconds; --measure-costs/--no-measure-costs)."""
    cost_rounds: int = 15
    """Timed rounds of the cost measurement (medians), after 2 untimed ones."""

    def __post_init__(self) -> None:
        if self.cost_rounds < 1:
            raise ValueError(f"cost_rounds must be >= 1, got {self.cost_rounds}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.chunk_anchors < 1:
            raise ValueError(f"chunk_anchors must be >= 1, got {self.chunk_anchors}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.vllm_loading not in VLLM_LOADINGS:
            raise ValueError(f"--vllm-loading must be one of {', '.join(VLLM_LOADINGS)}, got {self.vllm_loading!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"--draft-sample-method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, got "
                             f"{self.draft_sample_method!r}")
