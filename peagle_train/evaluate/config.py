"""``EvalConfig``: what ``peagle-eval`` measures and on how much (docs/design.md §9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from peagle_train.generate.speculative import DRAFT_SAMPLE_METHODS
from runtime.chat.answer_parsing import check_reasoning_parser
from runtime.chat.chat_template import check_kwargs_names
from runtime.chat.setting_mixtures import mode_options, template_variables
from runtime.vllm_runtime import VllmMemory

ENGINES = ("peagle", "vllm")
"""Online engines of ``peagle-eval --engine``: peagle's own speculative decoder (transformers), or vLLM."""


VLLM_LOADINGS = ("speculative_config", "speculators")
"""How ``--engine vllm`` gives vLLM the drafter: ``speculative_config`` (``LLM(model=VERIFIER,
speculative_config={"model": DRAFTER, "method": "eagle3", "parallel_drafting": True, ...})``) or
``speculators`` (``LLM(model=DRAFTER)``: vLLM reads ``speculators_config`` and loads the verifier it
names, as ``vllm serve DRAFTER`` does)."""


DEFAULT_MAX_NEW_TOKENS = 128
"""Most tokens per prompt turn online, and offline on a store that records no limit of its own."""


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What ``peagle-eval`` measures and on how much."""

    max_new_tokens: int | None = None
    """Most tokens generated per prompt turn (--max-new-tokens); None: 128 online, and offline the STORE's recorded
    limit (a judge store records the one its turns were generated with; another one given is refused), else 128."""
    num_prompts: int | None = None
    """Prompts read from the file, from the top; None = all (--num-prompts)."""
    num_draft_tokens: int | None = None
    """K drafts per verifier step; None = the drafter's num_depths (--num-draft-tokens)."""
    max_blocks: int | None = None
    """Offline: most validation blocks scored; None = all."""
    allow_partial: bool = False
    """Offline: score an incomplete STORE's extracted blocks alone (default: an incomplete store is refused)
    (--allow-partial)."""
    chunk_anchors: int = 256
    """Offline: anchors whose chains run through the drafter at once (bounds memory)."""
    all_anchor: bool = False
    """Offline (--store): also score every chain of every supervised position against the verifier's argmax, the
    all-anchor diagnostic (``simulated_acceptance_length``, ``per_depth_accuracy``...; reads the verifier's output
    head, 1 GB in bf16 for an 8B verifier): the figure for a store whose turns are not the verifier's own answers,
    such as a training store's held-out blocks. Without it the offline run replays the stored turns alone
    (``replay``) and reads no verifier weights (--all-anchor)."""
    warmup: bool = True
    """Online: one short untimed generation first, so one-time costs do not count in tokens/s."""
    temperature: float = 0.0
    """Online: 0 = greedy (checked token for token); T > 0 = sampling at T, with rejection sampling (--temperature)."""
    seed: int = 0
    """Online, T > 0: prompt turn i samples with generators seeded ``(seed, i)``; with a mode mixture
    (--reasoning-effort, --enable-thinking, --template-mixture) also each prompt's draw (--seed). Fixed by
    default (0) and recorded in the report, so a run repeats; another seed, another draw."""
    top_k: int | None = None
    """Online, T > 0: keep the verifier's k most likely tokens before sampling, as vLLM's ``top_k`` (0: off);
    None: the verifier's ``generation_config.json`` value, as a vLLM server applies it by default (--top-k)."""
    top_p: float | None = None
    """Online, T > 0: keep the most likely tokens up to this probability mass, as vLLM's ``top_p`` (1: off); None:
    the verifier's ``generation_config.json`` value, as a vLLM server applies it by default (--top-p)."""
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
    vllm_kv_cache_gib: float | None = None
    """--engine vllm: vLLM's KV cache in GiB; default on CPU 2 (or $VLLM_CPU_KVCACHE_SPACE), on a GPU vLLM's
    share of --vllm-gpu-memory-utilization. vLLM's CPU build without it reserves 0.92 of the machine's memory."""
    vllm_gpu_memory_utilization: float | None = None
    """--engine vllm on a GPU: the fraction of its memory vLLM may use (default vLLM's 0.92); not with
    --vllm-kv-cache-gib."""

    tree_topk: list[int] | None = None
    """Online, peagle's engine: verify a fixed draft tree, ``k_d`` candidates per node at depth d (--tree-topk 2,2,1,1:
    its length is the drafted depth); greedy only. None: the chain."""
    tree_nodes: int | None = None
    """Online, peagle's engine: verify a dynamic draft tree of the N most probable paths (product of the per-depth
    draft probabilities) up to depth K; greedy only. None: the chain."""

    reasoning_parser: str | None = None
    """Online, multi-turn prompts: how the verifier's answer becomes the next turn's history, as a client of
    ``vllm serve --reasoning-parser NAME`` sends it back: the parser's content, its reasoning as
    ``reasoning_content`` (rendered where the template renders it): deepseek_r1, deepseek_v3, qwen3 (think
    blocks), openai_gptoss (Harmony channels). None: the whole decoded answer (vLLM without a reasoning parser);
    an answer holding Harmony channels is then refused (--reasoning-parser)."""

    measure_costs: bool | None = None
    """Time a greedy step and, for every K <= num_depths, a drafter pass and a verifier pass over K+1 tokens on
    this machine, and report the expected speedup per K and the best K from the measured acceptance
    (``cost_model``; seconds on an idle machine, minutes on a loaded one, with a line saying so and its own
    progress line; --measure-costs/--no-measure-costs). Unset: only where the run decodes online with peagle's
    engine (--prompts); offline judging (--store alone) and --engine vllm time no decoding unless asked."""
    cost_rounds: int = 15
    """Timed rounds of the cost measurement (medians), after 2 untimed ones."""
    chat_template_kwargs: dict[str, Any] | None = None
    """The chat template's variables the prompts are rendered with, as vLLM's ``chat_template_kwargs``
    (--chat-template-kwargs, a JSON object such as {"enable_thinking": false}): the mode the verifier is
    served in. None: the mode the drafter was trained in (recorded in its checkpoint). A mode other than the
    drafter's, or a STORE made in another, is refused unless --allow-template-mode-mismatch."""
    reasoning_effort: str | dict[str, float] | None = None
    """Online: the chat template's ``reasoning_effort`` (gpt-oss: low, medium, high), or a mixture ``{"low": 0.2,
    "high": 0.8}`` drawn per prompt, as ``regenerate`` draws it per row (from --seed and the prompt id); the
    report gives each prompt's mode and the acceptance per mode; None: not drawn (--reasoning-effort)."""
    enable_thinking: bool | str | dict[str, float] | None = None
    """Online: the chat template's ``enable_thinking`` (true/false), or a mixture ``{"true": 0.8, "false": 0.2}``
    drawn per prompt (as --reasoning-effort); None: not drawn (--enable-thinking)."""
    template_mixture: dict[str, Any] | str | None = None
    """Online: other chat-template variables, each a value or a mixture drawn per prompt: a JSON object
    ``{"thinking": {"true": 0.7, "false": 0.3}}`` (--template-mixture)."""
    allow_template_mode_mismatch: bool = False
    """Evaluate even when --chat-template-kwargs, the drafter's training data and the STORE were rendered
    with different chat template variables; the report's template_mode names each
    (--allow-template-mode-mismatch)."""

    def online_max_new_tokens(self) -> int:
        """``max_new_tokens`` online: the given one, else :data:`DEFAULT_MAX_NEW_TOKENS`."""
        return DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None else self.max_new_tokens

    def costs_measured(self, online_peagle: bool) -> bool:
        """Whether the cost model is timed: ``measure_costs`` when given, else ``online_peagle`` (the run decodes
        online with peagle's own engine, so timing its steps is part of judging it)."""
        return online_peagle if self.measure_costs is None else self.measure_costs

    def __post_init__(self) -> None:
        if self.chat_template_kwargs is not None:
            object.__setattr__(self, "chat_template_kwargs", check_kwargs_names(self.chat_template_kwargs))
        for name, value in zip(("reasoning_effort", "enable_thinking", "template_mixture"),
                               mode_options(self.reasoning_effort, self.enable_thinking, self.template_mixture)):
            object.__setattr__(self, name, value)
        self.mode_variables()  # ValueError: a variable given twice
        if self.cost_rounds < 1:
            raise ValueError(f"cost_rounds must be >= 1, got {self.cost_rounds}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
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
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (0: off), got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.vllm_loading not in VLLM_LOADINGS:
            raise ValueError(f"--vllm-loading must be one of {', '.join(VLLM_LOADINGS)}, got {self.vllm_loading!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        self.vllm_memory  # noqa: B018  the memory options' own checks (ValueError)
        if self.engine != "vllm" and (self.vllm_kv_cache_gib is not None or self.vllm_gpu_memory_utilization is not None):
            raise ValueError("--vllm-kv-cache-gib and --vllm-gpu-memory-utilization are options of --engine vllm")
        tree = self.tree_topk is not None or self.tree_nodes is not None
        if self.tree_topk is not None and self.tree_nodes is not None:
            raise ValueError("give --tree-topk (a fixed tree) or --tree-nodes (a dynamic one), not both")
        if self.tree_topk is not None and (not self.tree_topk or min(self.tree_topk) < 1):
            raise ValueError(f"--tree-topk needs one count >= 1 per depth, got {list(self.tree_topk)}")
        if self.tree_nodes is not None and self.tree_nodes < 1:
            raise ValueError(f"--tree-nodes must be >= 1, got {self.tree_nodes}")
        if tree and self.temperature != 0:
            raise ValueError("tree verification is greedy only (peagle walks a tree by the verifier's argmax; "
                             "sampling over a tree is not implemented): give --temperature 0 or drop the tree")
        if tree and self.engine == "vllm":
            raise ValueError("--engine vllm verifies P-EAGLE drafts as a chain (vLLM removed its tree attention, "
                             "PR #42121): drop --tree-topk/--tree-nodes or use --engine peagle")
        if tree and self.tree_topk is not None and self.num_draft_tokens is not None \
                and len(self.tree_topk) != self.num_draft_tokens:
            raise ValueError(f"--tree-topk has {len(self.tree_topk)} depths but --num-draft-tokens is "
                             f"{self.num_draft_tokens}: give one or make them agree")
        check_reasoning_parser(self.reasoning_parser)
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"--draft-sample-method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, got "
                             f"{self.draft_sample_method!r}")

    def mode_variables(self) -> dict[str, Any]:
        """The template variables drawn per prompt, ``{name: value or Mixture}``
        (:func:`runtime.chat.setting_mixtures.template_variables`); ``{}``: every prompt in the fixed mode.

        Raises:
            ValueError: a variable given twice (by --template-mixture and its own option, or also by
                --chat-template-kwargs).
        """
        return template_variables(self.reasoning_effort, self.enable_thinking, self.template_mixture,
                                  self.chat_template_kwargs)

    @property
    def vllm_memory(self) -> VllmMemory:
        """The vLLM engines' memory (:class:`runtime.vllm_runtime.VllmMemory`)."""
        return VllmMemory(kv_cache_gib=self.vllm_kv_cache_gib, gpu_memory_utilization=self.vllm_gpu_memory_utilization)
