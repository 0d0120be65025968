"""Tree verification: several drafts per depth from one P-EAGLE drafting pass, checked by one verifier pass.

Algorithm: token-tree verification (SpecInfer, Miao et al. 2024, arXiv:2305.09781; EAGLE-2's dynamic
tree, Li et al. 2024, arXiv:2406.16858), greedy only, on P-EAGLE's parallel drafts (arXiv:2602.01469).

Legend: k tree depth (≤ K drafted depths), N tree nodes (the root excluded), P tokens in the verifier's
KV cache before the step, V verifier vocab, D draft vocab.

One step (docs/design.md §9, "Tree verification"): the verifier has read ``x_0..x_t`` (P = t + 1 tokens
cached) and emitted ``x_{t+1}``.
1. One drafter pass gives a distribution per depth ``d < k`` (``[k, D]``, as the chain's drafts).
   A P-EAGLE drafter drafts depth d without seeing the tokens drafted at depths < d, so depth d's
   candidates are the same under every parent. The tree (:func:`build_tree`): node 0 is the root
   ``x_{t+1}``; **fixed** (``topk = (k_0, .., k_{k-1})``): every node at depth d has the ``k_d`` most
   probable depth-d tokens as children (``Σ_d Π_{j≤d} k_j`` nodes); **dynamic** (``nodes = N``): the N
   nodes of highest path probability ``Π_d p_d(token_d)`` (the product of the depth marginals), found
   best-first, so every kept node's parent is kept.
2. One verifier pass over the root and the N nodes on top of the KV cache, with a tree attention mask
   (a node sees the cache and its ancestors and itself; sliding-window and chunked layers their window
   or chunk of those, by position) and per-node positions ``P + depth`` (:func:`tree_attention_mask`).
   Each node's output is then exactly the verifier's output for the chain root → node.
3. Greedy walk (:func:`walk_greedy`): from the root, follow the child whose token is the verifier's argmax;
   the step emits the path's tokens and the argmax after its last node (the bonus token). The KV cache
   keeps the root and the path, in order (:func:`compact_cache`), and their aux features feed the drafter.

Every emitted token is the verifier's argmax after the tokens before it, so the output equals greedy
decoding token for token. A tree of one candidate per depth is the chain of
:func:`~peagle_train.generate.speculative.speculative_generate`, with the same tokens and counts.

Verifiers with recurrent layers (hybrids) are refused (:data:`TREE_RECURRENT_REFUSED`): a recurrent layer
reads the tree's nodes as one sequence. Sampling (T > 0) is refused: this walk is the greedy one. A rule that
keeps the verifier's distribution over these fixed top-k candidates exists and is not implemented (at each node
sample the next token from the verifier's p and follow the child that carries it, else emit the sample and end the
step: SpecInfer's multi-step speculative sampling, arXiv:2305.09781, with every draft probability one); the chain
samples exactly.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from peagle_train.generate.speculative import (DecodeContext, GenerationResult, check_compatible,
                                               checked_num_draft_tokens, run_decoder)
from peagle_train.generate.verifier import config_recurrent_layers, verifier_body_pass
from peagle_train.model.dflash import DFlashDrafter
from stores.errors import InputError

__all__ = ["TreeSpec", "DraftTree", "TreeGenerationResult", "build_tree", "tree_attention_mask",
           "compact_cache", "walk_greedy", "check_tree_supported", "tree_depth", "DFLASH_TREE_REFUSED", "tree_generate",
           "check_tree_config", "check_tree_sampling", "TREE_ATTENTION", "TREE_SAMPLING_REFUSED",
           "TREE_RECURRENT_REFUSED"]

TREE_ATTENTION = ("eager", "sdpa")
"""Verifier attention implementations that take the tree's additive 4D mask as it is."""

TREE_SAMPLING_REFUSED = (
    "tree verification is greedy only: peagle's tree walk keeps the argmax path; the lossless rule for T > 0 "
    "(sample from the verifier at each node, follow the child that carries the sample) is not implemented; "
    "use the chain (no tree) at temperature > 0")


TREE_RECURRENT_REFUSED = (
    "tree verification is for attention-only verifiers: the verifier's layers {layers} carry a recurrent state "
    "(linear attention or state space), which reads the tree's nodes in one pass as one sequence, so a node's state "
    "would include its siblings' tokens; an exact tree needs a state per branch (a verifier pass per path), which "
    "peagle does not run. Use the chain (no tree): it is exact with this verifier (its state is put back to a "
    "snapshot and the kept tokens fed again after a rejected draft)")


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the draft tree: fixed (``topk``) or dynamic (``nodes``), exactly one of them."""

    topk: tuple[int, ...] | None = None
    """Fixed tree: ``topk[d]`` children per node at depth d (the k_d most probable depth-d drafts); its
    length is the tree depth."""
    nodes: int | None = None
    """Dynamic tree: the N nodes of highest path probability (product of the depth marginals), depth ≤ K."""

    def __post_init__(self) -> None:
        if (self.topk is None) == (self.nodes is None):
            raise InputError("give a tree as top-k per depth or as a node count, exactly one", field="--tree-topk")
        if self.topk is not None:
            object.__setattr__(self, "topk", tuple(int(k) for k in self.topk))
            if not self.topk or min(self.topk) < 1:
                raise InputError(f"tree top-k per depth must be >= 1 each, got {list(self.topk)}",
                                 field="--tree-topk")
        if self.nodes is not None and int(self.nodes) < 1:
            raise InputError(f"the tree needs at least 1 node, got {self.nodes}", field="--tree-nodes")

    @property
    def max_nodes(self) -> int:
        """Nodes of the full tree (the root excluded; a dynamic tree may have fewer when the depth is short)."""
        if self.nodes is not None:
            return int(self.nodes)
        total, width = 0, 1
        for k in self.topk:
            width *= k
            total += width
        return total

    def describe(self) -> dict:
        """JSON: ``{"topk": [...]}`` or ``{"nodes": N}`` and ``max_nodes``."""
        shape = {"topk": list(self.topk)} if self.topk is not None else {"nodes": self.nodes}
        return {**shape, "max_nodes": self.max_nodes}


@dataclass(frozen=True)
class DraftTree:
    """A draft tree over the root (node 0, the token the verifier emitted last) and N candidate nodes 1..N,
    each node's parent before it (breadth-first by construction)."""

    tokens: torch.Tensor
    """``[N] int64`` verifier token ids of nodes 1..N."""
    parents: torch.Tensor
    """``[N] int64`` the parent of node i + 1, in 0..i (0 = the root)."""
    depths: torch.Tensor
    """``[N] int64`` depth of node i + 1 (1..k; the root has depth 0); node at depth d is drafter depth d - 1."""

    @property
    def size(self) -> int:
        """N, the nodes besides the root."""
        return int(self.tokens.numel())

    @property
    def depth(self) -> int:
        """k, the deepest node's depth (0 for a root alone)."""
        return int(self.depths.max()) if self.size else 0

    def ancestors(self) -> torch.Tensor:
        """``[N+1, N+1] bool``: entry (i, j) is True when node j is node i or one of its ancestors."""
        n = self.size + 1
        anc = torch.eye(n, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist(), start=1):
            anc[i] |= anc[parent]
        return anc

    def children(self) -> list[dict[int, int]]:
        """Per node 0..N: ``{token: child node}`` (the tokens of one node's children are distinct)."""
        out: list[dict[int, int]] = [{} for _ in range(self.size + 1)]
        for i, (tok, parent) in enumerate(zip(self.tokens.tolist(), self.parents.tolist()), start=1):
            out[parent][tok] = i
        return out


@dataclass
class TreeGenerationResult(GenerationResult):
    """A :class:`~peagle_train.generate.speculative.GenerationResult` of tree decoding: ``drafted_per_step``
    counts the tree's depths scored (as a chain of that depth would), ``accepted_per_step`` the path kept."""

    nodes_per_step: list[int] = field(default_factory=list)
    """Tree nodes (the root excluded) the verifier checked in each step."""


DFLASH_TREE_REFUSED = (
    "a DFlash drafter drafts one chain per step (the argmax of each block slot), not a tree: its slots are drafted "
    "together from the newest token, so a branch at depth d would not change the drafts after it, and vLLM serves "
    "it as a chain; decode it without --tree-topk / --tree-nodes")
"""Why trees are refused for a DFlash drafter."""


def tree_depth(spec: TreeSpec, num_draft_tokens: int | None, drafter) -> int:
    """The tree depth k: ``len(topk)`` for a fixed tree, K (``num_draft_tokens``, default ``num_depths``) for a
    dynamic one; at most the drafter's trained ``num_depths`` (docs/design.md §9).

    Raises:
        InputError: a depth past ``num_depths``, a fixed tree whose length differs from ``num_draft_tokens``, or a
            DFlash drafter (:data:`DFLASH_TREE_REFUSED`).
    """
    if isinstance(drafter, DFlashDrafter):
        raise InputError(DFLASH_TREE_REFUSED, field="--tree-topk" if spec.topk is not None else "--tree-nodes")
    if spec.topk is None:
        return checked_num_draft_tokens(num_draft_tokens, drafter)
    k = len(spec.topk)
    if num_draft_tokens is not None and int(num_draft_tokens) != k:
        raise InputError(f"the tree has {k} depths (--tree-topk {','.join(map(str, spec.topk))}) but "
                         f"--num-draft-tokens is {num_draft_tokens}: give one or make them agree",
                         field="--tree-topk")
    return checked_num_draft_tokens(k, drafter)


def build_tree(draft_logits: torch.Tensor, draft_ids: torch.Tensor, spec: TreeSpec, depth: int) -> DraftTree:
    """The draft tree of one step from the drafter's per-depth logits.

    Args:
        draft_logits: ``[k', D]`` draft-vocab logits of depths 0..k'-1 (k' ≥ ``depth``).
        draft_ids: ``[D] int64`` verifier id of each draft id.
        spec: fixed or dynamic shape.
        depth: k ≥ 1, the deepest node allowed (``max_new_tokens`` may cut a step short).

    Returns:
        The :class:`DraftTree`, breadth-first; ties between equal probabilities go to the lower draft id
        (``torch.topk`` order) and, in a dynamic tree, to the node found first.
    """
    logp = torch.log_softmax(draft_logits[:depth].float().cpu(), -1)  # [k, D]
    ids = draft_ids.cpu()
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    if spec.topk is not None:
        level = [0]  # nodes of the previous depth
        for d, k_d in enumerate(spec.topk[:depth]):
            cand = torch.topk(logp[d], min(k_d, logp.shape[1])).indices.tolist()
            nxt = []
            for parent in level:
                for c in cand:
                    tokens.append(int(ids[c]))
                    parents.append(parent)
                    depths.append(d + 1)
                    nxt.append(len(tokens))
            level = nxt
    else:
        n = int(spec.nodes)
        top = torch.topk(logp, min(n, logp.shape[1]), dim=-1)  # a kept node's token ranks < N at its depth
        vals, cands = top.values.tolist(), top.indices.tolist()
        heap: list[tuple[float, int, int, int, int]] = []  # (-path logp, order, parent, depth, rank)
        order = 0
        for r in range(len(cands[0])):
            heap.append((-vals[0][r], order, 0, 0, r))
            order += 1
        heapq.heapify(heap)
        while heap and len(tokens) < n:
            neg, _, parent, d, r = heapq.heappop(heap)
            tokens.append(int(ids[cands[d][r]]))
            parents.append(parent)
            depths.append(d + 1)
            node = len(tokens)
            if d + 1 < depth:
                for r2 in range(len(cands[d + 1])):
                    heapq.heappush(heap, (neg - vals[d + 1][r2], order, node, d + 1, r2))
                    order += 1
        # best-first order puts parents first; sort breadth-first (stable), renumbering parents
        perm = sorted(range(len(tokens)), key=lambda i: depths[i])
        new_index = {old + 1: new + 1 for new, old in enumerate(perm)}
        new_index[0] = 0
        tokens = [tokens[i] for i in perm]
        parents = [new_index[parents[i]] for i in perm]
        depths = [depths[i] for i in perm]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return DraftTree(as_long(tokens), as_long(parents), as_long(depths))


def _layer_kinds(text_config) -> list[tuple[str, int | None]]:
    """Per distinct layer type of the verifier, in ``layer_types`` order: ``(type, window or chunk or None)``;
    a config without ``layer_types`` has one type, ``sliding_attention`` when it sets a window (every
    layer slides, as Mistral and Phi-3 do), else ``full_attention``.

    Raises:
        InputError: a layer type whose mask this module does not build.
    """
    if getattr(text_config, "use_bidirectional_attention", False):
        raise InputError("the verifier's config sets use_bidirectional_attention: its tokens see later ones, so a "
                         "causal tree mask would not compute it", field="--verifier")
    types = getattr(text_config, "layer_types", None)
    if types is None:
        if getattr(text_config, "attention_chunk_size", None):
            raise InputError("the verifier's config sets attention_chunk_size without layer_types: which layers "
                             "are chunked is not known, so a tree mask cannot be built exactly", field="--verifier")
        window = getattr(text_config, "sliding_window", None)
        slides = window is not None and getattr(text_config, "use_sliding_window", True) is not False
        types = ["sliding_attention" if slides else "full_attention"]
    kinds: list[tuple[str, int | None]] = []
    for t in dict.fromkeys(types):
        if t == "full_attention":
            kinds.append((t, None))
        elif t == "sliding_attention":
            kinds.append((t, int(text_config.sliding_window)))
        elif t == "chunked_attention":
            kinds.append((t, int(text_config.attention_chunk_size)))
        else:
            raise InputError(f"the verifier has {t!r} layers: tree verification builds masks for full, sliding-"
                             "window and chunked attention only; use the chain (no tree)", field="--verifier")
    return kinds


def check_tree_config(config) -> None:
    """The checks of :func:`check_tree_supported` that need only the verifier's config (a model config, no
    weights): layers with a recurrent state (:data:`TREE_RECURRENT_REFUSED`; which ones, transformers' cache for
    the config says: :func:`~peagle_train.generate.verifier.config_recurrent_layers`), layer types without a mask
    here.

    Raises:
        InputError: with the reason.
    """
    recurrent = config_recurrent_layers(config)
    if recurrent:
        raise InputError(TREE_RECURRENT_REFUSED.format(layers=recurrent), field="--verifier")
    _layer_kinds(config.get_text_config())


def check_tree_sampling(temperature: float) -> None:
    """Refuse a tree at T > 0: tree verification is greedy only.

    Raises:
        InputError: :data:`TREE_SAMPLING_REFUSED` (field ``--temperature``).
    """
    if temperature != 0:
        raise InputError(TREE_SAMPLING_REFUSED, field="--temperature")


def check_tree_supported(verifier, temperature: float) -> None:
    """Refuse a tree where it would not be exact: T > 0 (:data:`TREE_SAMPLING_REFUSED`), an attention
    implementation that does not take an additive 4D mask (flash, flex), :func:`check_tree_config`.

    Raises:
        InputError: with the reason.
    """
    check_tree_sampling(temperature)
    text = verifier.config.get_text_config()
    check_tree_config(verifier.config)
    impl = getattr(text, "_attn_implementation", None) or getattr(verifier.config, "_attn_implementation", None)
    if impl not in TREE_ATTENTION:
        raise InputError(f"the verifier runs {impl!r} attention, which does not take the tree's 4D attention mask "
                         f"as it is; tree verification needs one of {', '.join(TREE_ATTENTION)}", field="--verifier")


def tree_attention_mask(verifier, tree: DraftTree, past: int, dtype: torch.dtype, device) -> tuple:
    """The verifier's attention mask and positions for the root and the tree's nodes after ``past`` cached tokens.

    Query i (node i) is at position ``past + depth_i`` and sees key j when j is a cached token (j < past) or
    node j - past is node i or its ancestor, and, on a sliding-window layer of window W, ``pos_j > pos_i - W``,
    on a chunked layer of chunk C, ``pos_j // C == pos_i // C`` (transformers' masks, by position; the cache
    holds every token at its position, :func:`~peagle_train.generate.verifier.rollback_cache`).

    Returns:
        ``(attention_mask, position_ids [1, N+1] int64)``; the mask is ``[1, 1, N+1, past+N+1]`` additive (0 seen,
        ``finfo(dtype).min`` not), or a dict of them per layer type when the verifier has several.
    """
    anc = tree.ancestors()  # [N+1, N+1]
    q_pos = past + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])  # [N+1]
    kv_pos = torch.cat([torch.arange(past), q_pos])  # [past+N+1]
    seen = torch.cat([torch.ones(anc.shape[0], past, dtype=torch.bool), anc], dim=1)  # [N+1, past+N+1]
    masks = {}
    for kind, size in _layer_kinds(verifier.config.get_text_config()):
        allowed = seen
        if kind == "sliding_attention":
            allowed = seen & (kv_pos[None, :] > q_pos[:, None] - size)
        elif kind == "chunked_attention":
            allowed = seen & (kv_pos[None, :] // size == q_pos[:, None] // size)
        additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        masks[kind] = additive[None, None].to(device)
    mask = next(iter(masks.values())) if len(masks) == 1 else masks
    return mask, q_pos[None].to(device)


def compact_cache(cache, past: int, path: Sequence[int]) -> None:
    """Keep the ``past`` cached tokens, the root and the tree ``path`` (node numbers 1..N, root to leaf) in
    ``cache``, in that order, dropping the other nodes: the cache then equals a chain pass over root + path.

    Works on every layer holding ``keys``/``values`` ``[B, heads, past+N+1, hd]`` (full layers; the sliding
    ones were made full by :func:`~peagle_train.generate.verifier.rollback_cache`); O(len(path)) copies.
    """
    keep = past + 1 + len(path)
    moved = [past + p for p in path]
    contiguous = moved == list(range(past + 1, keep))
    for layer in getattr(cache, "layers", []):
        keys = getattr(layer, "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() < 2 or keys.shape[-2] < keep:
            continue
        if not contiguous:
            idx = torch.tensor(moved, device=keys.device)
            layer.keys[..., past + 1:keep, :] = keys.index_select(-2, idx)
            layer.values[..., past + 1:keep, :] = layer.values.index_select(-2, idx)
        layer.keys = layer.keys[..., :keep, :]
        layer.values = layer.values[..., :keep, :]
    assert cache.get_seq_length() == keep, (cache.get_seq_length(), keep)


def walk_greedy(tree: DraftTree, logits) -> tuple[list[int], list[int]]:
    """The longest root-to-node path whose every token is the verifier's argmax after its parent.

    Args:
        tree: the step's tree.
        logits: ``[N+1, V]`` (or anything whose ``[i]`` gives node i's row): the verifier's logits after each node.

    Returns:
        ``(path, emitted)``: the kept node numbers (root excluded) and the tokens the step emits, the path's
        tokens then the verifier's argmax after its last node (``len(emitted) == len(path) + 1``).
    """
    children = tree.children()
    node, path, emitted = 0, [], []
    while True:
        best = int(logits[node].argmax())
        child = children[node].get(best)
        emitted.append(best)
        if child is None:
            return path, emitted
        path.append(child)
        node = child


def _tree_pass(verifier, tree: DraftTree, root: int, cache, past: int):
    """One verifier pass over ``[root, nodes]`` with the tree mask: ``(logits [N+1, V] float32, hidden_states)``."""
    device = next(verifier.parameters()).device
    dtype = next(verifier.parameters()).dtype
    mask, positions = tree_attention_mask(verifier, tree, past, dtype, device)
    ids = torch.cat([torch.tensor([root]), tree.tokens])  # [N+1]
    return verifier_body_pass(verifier, ids, cache, extra={"attention_mask": mask, "position_ids": positions})


@torch.no_grad()
def tree_generate(verifier, drafter, prompt_ids, max_new_tokens: int, spec: TreeSpec,
                  num_draft_tokens: int | None = None, eos_token_id: int | Iterable[int] | None = None,
                  temperature: float = 0.0,
                  on_tokens: Callable[[list[int]], None] | None = None) -> TreeGenerationResult:
    """Greedy speculative decoding with tree verification (module docstring).

    Near the end the tree is cut to depth ``min(k, max_new_tokens - generated - 1)``; tokens after an EOS are
    dropped; counts follow :func:`~peagle_train.generate.speculative.record_step` with ``drafted`` = the tree's
    depth.

    Args:
        verifier: a transformers causal LM (batch 1), eager or sdpa attention.
        drafter: a ``PEagleDrafter`` built for ``verifier``.
        prompt_ids: ``[P]`` int token ids.
        max_new_tokens: most tokens generated.
        spec: the tree shape.
        num_draft_tokens: K, the dynamic tree's depth (default ``num_depths``); a fixed tree's is ``len(topk)``.
        eos_token_id: one id, several, or None.
        temperature: must be 0 (:data:`TREE_SAMPLING_REFUSED`).
        on_tokens: called with each step's new tokens (after the prefill: the first token), for streaming.

    Returns:
        :class:`TreeGenerationResult`; ``tokens`` equal greedy decoding's.

    Raises:
        InputError: T > 0, an unsupported verifier (:func:`check_tree_supported`), a depth past ``num_depths``,
            an empty prompt, a drafter that does not match the verifier.
    """
    check_tree_supported(verifier, temperature)
    K = tree_depth(spec, num_draft_tokens, drafter)
    check_compatible(verifier, drafter)
    result = TreeGenerationResult(tokens=[])

    def step(ctx: DecodeContext, root: int, k: int) -> tuple[list[int], int]:
        if k > 0:
            draft_logits = ctx.session.draft(ctx.new_tokens, ctx.new_aux, k)  # [k, D]
            tree = build_tree(draft_logits, drafter.draft_ids, spec, k)
        else:
            tree = DraftTree(*(torch.zeros(0, dtype=torch.long) for _ in range(3)))
        logits, hs = _tree_pass(verifier, tree, root, ctx.cache, ctx.past)  # [N+1, V]
        path, emitted = walk_greedy(tree, logits)
        compact_cache(ctx.cache, ctx.past, path)
        ctx.past += 1 + len(path)
        if k > 0:
            ctx.new_tokens = torch.tensor(emitted)
            ctx.new_aux = ctx.features(hs)[[0] + path]  # anchors: root, then the path
        result.nodes_per_step.append(tree.size)
        return emitted, tree.depth

    return run_decoder(verifier, drafter, prompt_ids, max_new_tokens, K, eos_token_id, result,
                       lambda logits: int(logits.argmax()), step, on_tokens)
