"""Tree verification: one verifier pass over a token tree gives each path the chain's outputs, the greedy walk
keeps the longest verified path, and the output equals greedy decoding on the family matrix."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from peagle_train.generate.speculative import greedy_generate, speculative_generate
from peagle_train.generate.tree import (DraftTree, TreeSpec, build_tree, check_tree_supported, compact_cache,
                                        tree_attention_mask, tree_generate, walk_greedy)
from peagle_train.generate.verifier import rollback_cache, verifier_body_pass, verifier_pass
from peagle_train.model.config import DrafterConfig
from stores.errors import InputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import FAMILIES, WINDOW, build_family  # noqa: E402

PROMPT = [1, 17, 230, 45, 99, 310, 7, 58, 402, 11]  # longer than the window


class RankOracle(nn.Module):
    """Knows the greedy continuation ``full``: at depths in ``second`` the right token is its second choice (a
    wrong one, ``tok + 1``, is first), elsewhere its first. Reads rope positions only (the recompute path of
    DrafterSession: element at position p, depth d, drafts ``full[p + 1]``)."""

    def __init__(self, text_config, full: list[int], num_depths: int, second: set[int]):
        super().__init__()
        V = text_config.vocab_size
        self.config = DrafterConfig(hidden_size=text_config.hidden_size, intermediate_size=1, num_attention_heads=1,
                                    num_key_value_heads=1, head_dim=2, vocab_size=V, draft_vocab_size=V,
                                    aux_layer_ids=[1, 2], num_depths=num_depths)
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.long))
        self.dummy = nn.Parameter(torch.zeros(1))
        self.full, self.second = full, second

    @property
    def draft_ids(self):
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn_mask):
        last_ctx = int((~is_mask).nonzero().max())
        return torch.stack([position_ids, position_ids - position_ids[last_ctx]], dim=-1)

    def logits(self, hidden):
        V = self.config.draft_vocab_size
        out = torch.zeros(hidden.shape[0], V)
        for i, (pos, depth) in enumerate(hidden.tolist()):
            tok = self.full[pos + 1] if pos + 1 < len(self.full) else 0
            out[i, tok] = 20.0  # p = 0.73 first, 0.27 second: the others ~0
            if depth in self.second:
                out[i, (tok + 1) % V] = 21.0
        return out


def test_fixed_tree_shape_and_order():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 0.0, 4.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    tree = build_tree(logits, torch.tensor([10, 11, 12, 13]), TreeSpec(topk=(2, 2, 1)), depth=3)
    assert tree.tokens.tolist() == [11, 12, 10, 12, 10, 12, 13, 13, 13, 13]
    assert tree.parents.tolist() == [0, 0, 1, 1, 2, 2, 3, 4, 5, 6]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    assert TreeSpec(topk=(2, 2, 1)).max_nodes == 10
    # cut to depth 1 near max_new_tokens
    assert build_tree(logits, torch.arange(4), TreeSpec(topk=(2, 2, 1)), depth=1).tokens.tolist() == [1, 2]


def test_dynamic_tree_keeps_the_most_probable_paths():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    tree = build_tree(p.log(), torch.arange(3), TreeSpec(nodes=4), depth=3)
    # path probabilities: a=.6, b=.3, aa=.3, ab=.24, aaa=.27, ba=.15 ... -> a, b/aa (tie: b found first), aaa
    got = sorted(zip(tree.depths.tolist(), tree.parents.tolist(), tree.tokens.tolist()))
    assert tree.size == 4
    anc = tree.ancestors()
    for i, parent in enumerate(tree.parents.tolist(), start=1):
        assert parent < i and anc[i, parent]  # every kept node's parent is kept, before it
    scores = []
    for i in range(1, 5):
        node, s = i, 0.0
        while node:
            s += math.log(float(p[tree.depths[node - 1] - 1, tree.tokens[node - 1]]))
            node = int(tree.parents[node - 1])
        scores.append(s)
    assert min(scores) >= math.log(0.27) - 1e-6, (got, scores)  # the 4 best: .6, .3, .3, .27
    assert len(got) == 4


def test_walk_greedy_follows_the_argmax_child():
    tree = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 2, 2]), torch.tensor([1, 1, 2, 2]))
    logits = torch.zeros(5, 10)
    logits[0, 6] = 1  # root -> node 2 (token 6)
    logits[2, 8] = 1  # node 2 -> node 4 (token 8)
    logits[4, 3] = 1  # bonus after node 4
    assert walk_greedy(tree, logits) == ([2, 4], [6, 8, 3])
    logits[0] = 0
    logits[0, 9] = 1  # no child matches: the bonus only
    assert walk_greedy(tree, logits) == ([], [9])


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_pass_gives_each_path_the_chain_outputs(family):
    """Node outputs of one tree pass equal a chain pass over root -> node, past the sliding window, and after
    compacting the cache to a path not stored contiguously the next pass equals a fresh forward."""
    verifier = build_family(family)
    cache = rollback_cache(verifier)
    verifier_pass(verifier, torch.tensor(PROMPT), cache, want_hidden=False)
    past = len(PROMPT)
    #        1    2    3    4    5    6
    tree = DraftTree(torch.tensor([20, 21, 30, 31, 40, 41]), torch.tensor([0, 0, 1, 2, 4, 4]),
                     torch.tensor([1, 1, 2, 2, 3, 3]))
    mask, pos = tree_attention_mask(verifier, tree, past, torch.float32, "cpu")
    logits, _ = verifier_body_pass(verifier, torch.tensor([5, 20, 21, 30, 31, 40, 41]), cache,
                                   extra={"attention_mask": mask, "position_ids": pos})
    chain_path = [5, 21, 31, 41]  # root, nodes 2, 4, 6
    fresh, _ = verifier_pass(verifier, torch.tensor(PROMPT + chain_path), rollback_cache(verifier), want_hidden=False)
    torch.testing.assert_close(logits[[0, 2, 4, 6]], fresh[past:], atol=1e-4, rtol=1e-4)
    other, _ = verifier_pass(verifier, torch.tensor(PROMPT + [5, 20, 30]), rollback_cache(verifier), want_hidden=False)
    torch.testing.assert_close(logits[[1, 3]], other[past + 1:], atol=1e-4, rtol=1e-4)
    compact_cache(cache, past, [2, 4, 6])
    got, _ = verifier_pass(verifier, torch.tensor([9, 10]), cache, want_hidden=False)
    want, _ = verifier_pass(verifier, torch.tensor(PROMPT + chain_path + [9, 10]), rollback_cache(verifier),
                            want_hidden=False)
    torch.testing.assert_close(got, want[-2:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_output_equals_greedy_on_the_family_matrix(family):
    """The right token is the drafter's second choice at depth 1: the chain rejects it, a tree of 2 per depth
    keeps it (a path through a second child: the cache is compacted, not cut), and both equal greedy."""
    verifier = build_family(family)
    text = verifier.config.get_text_config()
    greedy = greedy_generate(verifier, PROMPT, 14)
    oracle = RankOracle(text, PROMPT + greedy.tokens, num_depths=3, second={1})
    chain = speculative_generate(verifier, oracle, PROMPT, 14)
    fixed = tree_generate(verifier, oracle, PROMPT, 14, TreeSpec(topk=(2, 2, 2)))
    dynamic = tree_generate(verifier, oracle, PROMPT, 14, TreeSpec(nodes=10))  # path probs .73 .27 .73
    assert chain.tokens == fixed.tokens == dynamic.tokens == greedy.tokens
    assert len(PROMPT) + len(greedy.tokens) > 3 * WINDOW
    assert set(chain.accepted_per_step[:-1]) == {1}
    assert set(fixed.accepted_per_step[:-1]) == {3} and fixed.nodes_per_step[0] == 14
    assert set(dynamic.accepted_per_step[:-1]) == {3}


def test_top1_tree_is_the_chain(tiny_verifier):
    """A tree of one candidate per depth gives the chain's tokens and counts exactly (a random drafter and an
    oracle wrong from depth 2)."""
    from tests.peagle_train.generate.test_speculative import PROMPTS, tiny_drafter

    drafter = tiny_drafter(tiny_verifier, num_depths=4)
    for prompt in PROMPTS:
        chain = speculative_generate(tiny_verifier, drafter, prompt, 12, eos_token_id=2)
        tree = tree_generate(tiny_verifier, drafter, prompt, 12, TreeSpec(topk=(1, 1, 1, 1)), eos_token_id=2)
        assert tree.tokens == chain.tokens
        assert tree.accepted_per_step == chain.accepted_per_step
        assert tree.drafted_per_step == chain.drafted_per_step
    greedy = greedy_generate(tiny_verifier, PROMPTS[0], 12)
    oracle = RankOracle(tiny_verifier.config, PROMPTS[0] + greedy.tokens, num_depths=4, second={2})
    chain = speculative_generate(tiny_verifier, oracle, PROMPTS[0], 12)
    tree = tree_generate(tiny_verifier, oracle, PROMPTS[0], 12, TreeSpec(topk=(1, 1, 1, 1)))
    assert tree.tokens == chain.tokens == greedy.tokens
    assert tree.accepted_per_step == chain.accepted_per_step and max(chain.accepted_per_step) == 2


def test_tree_refuses_sampling_and_masks_it_cannot_pass(tiny_verifier):
    with pytest.raises(InputError, match="greedy only.*follow the child that carries the sample"):
        check_tree_supported(tiny_verifier, 0.7)
    tiny_verifier.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(InputError, match="'flash_attention_2' attention"):
            check_tree_supported(tiny_verifier, 0.0)
    finally:
        tiny_verifier.config._attn_implementation = "sdpa"
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig, Qwen3NextConfig

    for config, match in ((Gemma3TextConfig(use_bidirectional_attention=True), "use_bidirectional_attention"),
                          (Qwen3NextConfig(num_hidden_layers=4), r"layers \[0, 1, 2\] carry a recurrent state")):
        fake = SimpleNamespace(config=config)
        config._attn_implementation = "sdpa"
        with pytest.raises(InputError, match=match):
            check_tree_supported(fake, 0.0)
    with pytest.raises(InputError, match="exactly one"):
        TreeSpec()
    with pytest.raises(InputError, match=">= 1"):
        TreeSpec(topk=(2, 0))
