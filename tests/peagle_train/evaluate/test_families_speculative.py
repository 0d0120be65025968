"""The family matrix on online decoding: speculative output equals greedy past the sliding window.

Each step drafts K = 3 tokens and the verifier keeps 2 of them (an oracle drafter wrong from depth 2),
so the verifier's KV cache is cut back after every step, long after the 4-token windows have slid.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from peagle_train.evaluate.speculative import greedy_generate, speculative_generate
from peagle_train.evaluate.verifier import crop_cache, new_cache, rollback_cache, verifier_pass
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import FAMILIES, WINDOW, build_family  # noqa: E402

PROMPT = [1, 17, 230, 45, 99, 310, 7, 58, 402, 11]  # longer than the window


class Oracle(nn.Module):
    """Drafts the known greedy continuation ``full``, wrong from depth ``wrong_from`` on (reads positions only)."""

    def __init__(self, text_config, full: list[int], num_depths: int, wrong_from: int):
        super().__init__()
        V = text_config.vocab_size
        self.config = DrafterConfig(hidden_size=text_config.hidden_size, intermediate_size=1, num_attention_heads=1,
                                    num_key_value_heads=1, head_dim=2, vocab_size=V, draft_vocab_size=V,
                                    aux_layer_ids=[1, 2], num_depths=num_depths)
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.long))
        self.dummy = nn.Parameter(torch.zeros(1))
        self.full, self.wrong_from = full, wrong_from

    @property
    def draft_ids(self):
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn_mask):
        last_ctx = int((~is_mask).nonzero().max())
        return torch.stack([position_ids, position_ids - position_ids[last_ctx]], dim=-1)

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], self.config.draft_vocab_size)
        for i, (pos, depth) in enumerate(hidden.tolist()):
            tok = self.full[pos + 1] if pos + 1 < len(self.full) else 0
            out[i, (tok + 1) % out.shape[1] if depth >= self.wrong_from else tok] = 1.0
        return out




@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_greedy_past_the_window(family):
    verifier = build_family(family)
    text = verifier.config.get_text_config()
    greedy = greedy_generate(verifier, PROMPT, 14)
    oracle = Oracle(text, PROMPT + greedy.tokens, num_depths=3, wrong_from=2)
    spec = speculative_generate(verifier, oracle, PROMPT, 14)
    assert spec.tokens == greedy.tokens
    assert len(PROMPT) + len(spec.tokens) > 3 * WINDOW
    assert set(spec.accepted_per_step[:-1]) == {2}  # every step but the last one rejects a draft
    torch.manual_seed(0)
    drafter = PEagleDrafter(DrafterConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=text.vocab_size,
                                          draft_vocab_size=text.vocab_size, aux_layer_ids=[1, 2],
                                          num_depths=3)).eval()
    assert speculative_generate(verifier, drafter, PROMPT, 14).tokens == greedy.tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_cut_back_cache_gives_the_models_own_logits(family):
    """After a cut back past the window the verifier's logits are those of a fresh forward (so sampling
    at T > 0, which reads the whole distribution, is exact too)."""
    verifier = build_family(family)
    cache = rollback_cache(verifier)
    ids = torch.tensor(PROMPT)
    verifier_pass(verifier, ids, cache, want_hidden=False)
    verifier_pass(verifier, torch.tensor([5, 6, 7, 8]), cache, want_hidden=False)  # 4 drafts
    crop_cache(cache, len(PROMPT) + 1)  # keep one
    got, _ = verifier_pass(verifier, torch.tensor([9, 10, 11]), cache, want_hidden=False)
    want, _ = verifier_pass(verifier, torch.tensor(PROMPT + [5, 9, 10, 11]), new_cache(verifier), want_hidden=False)
    torch.testing.assert_close(got, want[-3:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("config_name", ["Qwen3NextConfig", "JambaConfig", "FalconH1Config"])
def test_recurrent_cache_layers_are_refused(config_name):
    """Linear-attention / state-space cache layers cannot be cut back to an earlier token: refused."""
    from types import SimpleNamespace

    import transformers

    from stores.errors import InputError

    verifier = SimpleNamespace(config=getattr(transformers, config_name)(num_hidden_layers=4))
    with pytest.raises(InputError, match="LinearAttention.*cannot be cut back"):
        rollback_cache(verifier)
