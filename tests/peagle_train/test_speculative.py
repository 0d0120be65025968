"""Greedy speculative decoding reproduces plain greedy decoding, and its bookkeeping adds up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peagle_train.model import DrafterConfig, PEagleDrafter
from peagle_train.speculative import (
    check_compatible,
    draft_tokens,
    greedy_generate,
    speculative_generate,
)
from stores.errors import InputError


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads, and multi-threaded small GEMMs stall on a busy 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

PROMPTS = [
    [1, 504, 3458, 282, 260, 1115, 30],
    [1, 9519, 17, 2],
    [1, 23, 45, 678, 910, 1112, 1314, 1516, 1718, 1920, 2122, 2324],
]


def tiny_drafter(verifier, draft_vocab_size: int | None = None, num_depths: int = 4, seed: int = 0) -> PEagleDrafter:
    """A random 1-layer drafter for ``verifier`` (hidden 64) reading layers 1, 2, 3."""
    vcfg = verifier.config
    cfg = DrafterConfig(
        hidden_size=vcfg.hidden_size, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vcfg.vocab_size, draft_vocab_size=draft_vocab_size or vcfg.vocab_size,
        aux_layer_ids=[1, 2, 3], num_depths=num_depths, verifier_name_or_path="tiny",
    )
    torch.manual_seed(seed)
    drafter = PEagleDrafter(cfg).eval()
    if draft_vocab_size is not None:  # draft vocab = every 7th verifier id
        d2t = torch.arange(draft_vocab_size) * 7 - torch.arange(draft_vocab_size)
        drafter.init_from_verifier(verifier.model.embed_tokens.weight, verifier.lm_head.weight, d2t=d2t)
    return drafter


class OracleDrafter(nn.Module):
    """Drafts the known greedy continuation ``full`` (prompt + greedy tokens), wrong from depth ``wrong_from``.

    It reads only the rope positions: element at position p drafts ``full[p + 1]``.
    """

    def __init__(self, verifier, full: list[int], num_depths: int, wrong_from: int | None = None):
        super().__init__()
        vcfg = verifier.config
        self.config = DrafterConfig(
            hidden_size=vcfg.hidden_size, intermediate_size=1, num_attention_heads=1, num_key_value_heads=1,
            head_dim=2, vocab_size=vcfg.vocab_size, draft_vocab_size=vcfg.vocab_size,
            aux_layer_ids=[1, 2, 3], num_depths=num_depths,
        )
        self.register_buffer("d2t", torch.zeros(vcfg.vocab_size, dtype=torch.long))
        self.dummy = nn.Parameter(torch.zeros(1))
        self.full = full
        self.wrong_from = wrong_from

    @property
    def draft_ids(self):
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn_mask):
        assert attn_mask.shape == (input_ids.numel(),) * 2
        last_ctx = int((~is_mask).nonzero().max())
        depth = position_ids - position_ids[last_ctx]
        return torch.stack([position_ids, depth], dim=-1)  # [E, 2]

    def logits(self, hidden):
        V = self.config.draft_vocab_size
        out = torch.zeros(hidden.shape[0], V)
        for i, (pos, depth) in enumerate(hidden.tolist()):
            tok = self.full[pos + 1] if pos + 1 < len(self.full) else 0
            if self.wrong_from is not None and depth >= self.wrong_from:
                tok = (tok + 1) % V
            out[i, tok] = 1.0
        return out


@pytest.mark.parametrize("K", [1, 3, 5])
def test_speculative_equals_greedy(tiny_verifier, K):
    drafter = tiny_drafter(tiny_verifier)
    for prompt in PROMPTS:
        base = greedy_generate(tiny_verifier, prompt, max_new_tokens=20)
        spec = speculative_generate(tiny_verifier, drafter, prompt, max_new_tokens=20, num_draft_tokens=K)
        assert spec.tokens == base.tokens
        assert len(spec.tokens) == 20
        assert all(k <= K for k in spec.drafted_per_step)
        assert all(0 <= a <= d for a, d in zip(spec.accepted_per_step, spec.drafted_per_step))


def test_speculative_equals_greedy_with_reduced_draft_vocab(tiny_verifier):
    drafter = tiny_drafter(tiny_verifier, draft_vocab_size=512)
    assert drafter.draft_ids[3] == 21
    drafts = draft_tokens(drafter, torch.tensor(PROMPTS[0]), torch.randn(len(PROMPTS[0]) - 1, 3 * 64), 4)
    assert drafts.shape == (4,) and bool((drafts % 7 == 0).all())
    base = greedy_generate(tiny_verifier, PROMPTS[0], max_new_tokens=15)
    spec = speculative_generate(tiny_verifier, drafter, PROMPTS[0], max_new_tokens=15, num_draft_tokens=3)
    assert spec.tokens == base.tokens


@pytest.mark.parametrize("K,max_new", [(4, 17), (5, 3), (3, 1)])
def test_oracle_accepts_everything(tiny_verifier, K, max_new):
    prompt = PROMPTS[0]
    base = greedy_generate(tiny_verifier, prompt, max_new_tokens=max_new)
    oracle = OracleDrafter(tiny_verifier, prompt + base.tokens, num_depths=K)
    spec = speculative_generate(tiny_verifier, oracle, prompt, max_new_tokens=max_new)
    assert spec.tokens == base.tokens
    assert spec.accepted_per_step == spec.drafted_per_step  # every draft accepted
    # 1 token from the prefill, then accepted + 1 per step; never more than max_new_tokens.
    assert len(spec.tokens) == 1 + sum(a + 1 for a in spec.accepted_per_step) == max_new
    if max_new == 17:
        assert spec.drafted_per_step == [4, 4, 4, 0]  # 1 + 3 * 5 tokens; the last step has no room to draft


def test_oracle_wrong_from_depth_two(tiny_verifier):
    prompt, K = PROMPTS[2], 5
    base = greedy_generate(tiny_verifier, prompt, max_new_tokens=25)
    oracle = OracleDrafter(tiny_verifier, prompt + base.tokens, num_depths=K, wrong_from=2)
    spec = speculative_generate(tiny_verifier, oracle, prompt, max_new_tokens=25)
    assert spec.tokens == base.tokens
    assert all(a == min(2, d) for a, d in zip(spec.accepted_per_step, spec.drafted_per_step))
    assert len(spec.tokens) == 1 + sum(a + 1 for a in spec.accepted_per_step)
    al = 1 + spec.accepted / spec.verifier_steps
    assert 1 <= al <= K + 1 and al == pytest.approx(3.0)


def test_eos_stops_both(tiny_verifier):
    prompt = PROMPTS[1]
    free = greedy_generate(tiny_verifier, prompt, max_new_tokens=12).tokens
    eos = free[5]  # pretend the sixth generated token is EOS
    first = free.index(eos)
    base = greedy_generate(tiny_verifier, prompt, max_new_tokens=12, eos_token_id=[eos, 99999])
    assert base.tokens == free[:first + 1]
    oracle = OracleDrafter(tiny_verifier, prompt + free, num_depths=4)
    spec = speculative_generate(tiny_verifier, oracle, prompt, max_new_tokens=12, eos_token_id=eos)
    assert spec.tokens == base.tokens
    drafter = tiny_drafter(tiny_verifier)
    spec = speculative_generate(tiny_verifier, drafter, prompt, max_new_tokens=12, num_draft_tokens=3,
                                eos_token_id=eos)
    assert spec.tokens == base.tokens


def test_drafter_mismatch_is_a_clear_error(tiny_verifier):
    drafter = tiny_drafter(tiny_verifier)
    drafter.config.aux_layer_ids = [1, 2, 30]
    with pytest.raises(InputError, match="aux layers"):
        check_compatible(tiny_verifier, drafter)
    with pytest.raises(InputError, match="at least 1"):
        speculative_generate(tiny_verifier, tiny_drafter(tiny_verifier), PROMPTS[0], 5, num_draft_tokens=0)


def test_inference_mask_is_the_p_eagle_rule():
    """Depth-0 elements (0..t, 0) then the chain (t, 1..K-1): the §8 rule is exactly a causal mask."""
    from peagle_train.attention import attention_mask_reference
    from peagle_train.cod import CodElements

    t, K = 6, 4
    anchor = torch.cat([torch.arange(t + 1), torch.full((K - 1,), t)])
    depth = torch.cat([torch.zeros(t + 1, dtype=torch.long), torch.arange(1, K)])
    elements = CodElements(anchor, depth, torch.zeros_like(anchor), torch.ones(anchor.numel()))
    E = t + K
    assert torch.equal(attention_mask_reference(elements), torch.ones(E, E, dtype=torch.bool).tril())
