"""Greedy speculative decoding reproduces plain greedy decoding, and its bookkeeping adds up."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peagle_train.generate.speculative import (DFlashSession, check_compatible, draft_tokens, greedy_generate,
                                               speculative_generate)
from peagle_train.model.config import DrafterConfig
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.drafter import PEagleDrafter
from stores.errors import InputError



PROMPTS = [
    [1, 504, 3458, 282, 260, 1115, 30],
    [1, 9519, 17, 2],
    [1, 23, 45, 678, 910, 1112, 1314, 1516, 1718, 1920, 2122, 2324],
]


def tiny_drafter(verifier, draft_vocab_size: int | None = None, num_depths: int = 4, seed: int = 0,
                 layer_type: str = "llama", num_layers: int = 1) -> PEagleDrafter:
    """A random drafter (``num_layers`` layers of ``layer_type``) for ``verifier`` (hidden 64) reading layers 1,
    2, 3; a qwen3 layer's q_norm/k_norm weights random in [0.5, 1.5] (not ones, so they matter)."""
    vcfg = verifier.config
    cfg = DrafterConfig(
        hidden_size=vcfg.hidden_size, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=vcfg.vocab_size, draft_vocab_size=draft_vocab_size or vcfg.vocab_size,
        aux_layer_ids=[1, 2, 3], num_depths=num_depths, verifier_name_or_path="tiny", layer_type=layer_type,
        num_hidden_layers=num_layers,
    )
    torch.manual_seed(seed)
    drafter = PEagleDrafter(cfg).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.uniform_(0.5, 1.5)
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


@pytest.mark.parametrize("K", [1, 3, 4])
def test_speculative_equals_greedy(tiny_verifier, K):
    drafter = tiny_drafter(tiny_verifier)
    for prompt in PROMPTS:
        base = greedy_generate(tiny_verifier, prompt, max_new_tokens=12)
        spec = speculative_generate(tiny_verifier, drafter, prompt, max_new_tokens=12, num_draft_tokens=K)
        assert spec.tokens == base.tokens
        assert len(spec.tokens) == 12
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
    msg = ("--num-draft-tokens 6 exceeds the drafter's trained num_depths 4: depths 4..5 were never trained; "
           "use at most 4 (or train with --num-depths 6)")
    with pytest.raises(InputError) as err:
        speculative_generate(tiny_verifier, tiny_drafter(tiny_verifier), PROMPTS[0], 5, num_draft_tokens=6)
    assert str(err.value) == "field '--num-draft-tokens': " + msg


def test_inference_mask_is_the_p_eagle_rule():
    """Depth-0 elements (0..t, 0) then the chain (t, 1..K-1): the §8 rule is exactly a causal mask."""
    from peagle_train.model.element_mask import attention_mask_reference
    from peagle_train.data.cod import CodElements

    t, K = 6, 4
    anchor = torch.cat([torch.arange(t + 1), torch.full((K - 1,), t)])
    depth = torch.cat([torch.zeros(t + 1, dtype=torch.long), torch.arange(1, K)])
    elements = CodElements(anchor, depth, torch.zeros_like(anchor), torch.ones(anchor.numel()))
    E = t + K
    assert torch.equal(attention_mask_reference(elements), torch.ones(E, E, dtype=torch.bool).tril())


# ------------------------------------------------------------------ drafter KV cache
def full_pass_logits(drafter, tokens: torch.Tensor, aux: torch.Tensor, K: int) -> torch.Tensor:
    """The uncached reference: every depth-0 element and the chain in one pass, ``[K, D]``."""
    n_ctx = aux.shape[0]
    E = n_ctx + K - 1
    ids = torch.zeros(E, dtype=torch.long)
    ids[:n_ctx] = tokens[1:n_ctx + 1]
    g = torch.zeros(E, aux.shape[1])
    g[:n_ctx] = aux
    hidden = drafter(ids, g, torch.arange(E) >= n_ctx, torch.arange(1, E + 1), torch.ones(E, E, dtype=torch.bool).tril())
    return drafter.logits(hidden[n_ctx - 1:])


@pytest.mark.parametrize("num_layers, layer_type", [(1, "llama"), (2, "llama"), (1, "qwen3"), (2, "qwen3")])
def test_drafter_session_cache_equals_full_pass(tiny_verifier, num_layers, layer_type):
    """Steps that add 4, 1, 3, 2 depth-0 elements: each cached pass equals a full recompute."""
    drafter = tiny_drafter(tiny_verifier, seed=0 if num_layers == 1 else 3, layer_type=layer_type,
                           num_layers=num_layers)
    from peagle_train.generate.speculative import DrafterSession

    torch.manual_seed(0)
    tokens = torch.randint(0, 49152, (12,))
    aux = torch.randn(11, 3 * 64)
    session = DrafterSession(drafter)
    seen = 0
    for n_new, k in ((4, 3), (1, 4), (3, 1), (2, 2)):
        cached = session.draft(tokens[seen + 1:seen + 1 + n_new], aux[seen:seen + n_new], k)
        seen += n_new
        full = full_pass_logits(drafter, tokens[:seen + 1], aux[:seen], k)
        torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
    assert session.cache.layers[0].keys.shape[1] == session.cache.length == seen  # only depth-0 elements stay cached


# ------------------------------------------------------------------ rejection sampling
def test_accept_drafts_one_position_keeps_p():
    """One draft from q, verified against p: the first emitted token is distributed as p."""
    from peagle_train.generate.speculative import accept_drafts

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.7]])
    logits = torch.log(torch.stack([p, torch.full((4,), 0.25)]))  # [2, V]; row 1 = bonus, uniform
    g = torch.Generator().manual_seed(0)
    N = 1500
    first = torch.zeros(4)
    kept = 0
    for _ in range(N):
        draft = torch.multinomial(q[0], 1, generator=g)
        n, emitted = accept_drafts(draft, logits, 1.0, q, g)
        first[int(emitted[0])] += 1
        kept += n
    assert float((first / N - p).abs().sum()) / 2 < 0.04  # total variation; about 0.013 expected at N = 1500
    assert kept / N == pytest.approx(float(torch.minimum(p, q[0]).sum()), abs=0.04)  # sum min(p, q) = 0.3 kept


def test_greedy_drafting_keeps_a_draft_with_probability_p_and_resamples_p_without_it():
    """vLLM's default ``draft_sample_method="greedy"``: the draft is taken as certain (q one-hot, no
    ``draft_probs``): kept with probability p(x) (not min(1, p/q) for a sampled q), and a rejection samples p
    with x removed, so the first emitted token is still distributed as p."""
    from peagle_train.generate.speculative import accept_drafts

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = torch.log(torch.stack([p, torch.full((4,), 0.25)]))  # [2, V]
    g = torch.Generator().manual_seed(0)
    N = 2000
    first, kept = torch.zeros(4), 0
    for _ in range(N):
        n, emitted = accept_drafts(torch.tensor([1]), logits, 1.0, None, g)  # the argmax draft 1, p(1) = 0.3
        first[int(emitted[0])] += 1
        kept += n
        assert n == 1 or int(emitted[0]) != 1  # a rejected draft is never the replacement
    assert kept / N == pytest.approx(0.3, abs=0.035)  # binomial SE 0.010
    assert float((first / N - p).abs().sum()) / 2 < 0.04


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_propose_drafts_at_temperature_as_vllms_draft_sample_method(method):
    """At T > 0 ``greedy`` drafts the argmax with no q (one-hot); ``probabilistic`` samples q = softmax(z / T)."""
    from peagle_train.generate.speculative import propose_drafts

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]])  # [k=2, D=3]
    draft_ids = torch.tensor([4, 1, 7])
    g = torch.Generator().manual_seed(0)
    runs = [propose_drafts(logits, draft_ids, 9, 1.0, g, method) for _ in range(200)]
    if method == "greedy":
        assert all(d.tolist() == [1, 4] and q is None for d, q in runs)
    else:
        q = runs[0][1]
        torch.testing.assert_close(q[:, [4, 1, 7]], torch.softmax(logits, -1))
        assert float(q[:, [0, 2, 3, 5, 6, 8]].abs().sum()) == 0.0
        assert {tuple(d.tolist()) for d, _ in runs} > {(1, 4)}  # samples, not only the argmax


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_both_draft_sample_methods_keep_the_joint_distribution(method):
    """One speculative step over a table-defined 3-token model with two parallel drafts: greedy drafts are the
    argmax of fixed q1, q2 (q one-hot), probabilistic ones samples of them; the joint of (x1, x2, x3) is the
    model's either way (chi-square, 0.999 quantile). Accepting a greedy draft with min(1, p/q) of its soft q,
    or resampling p without removing it, fails."""
    from peagle_train.generate.speculative import accept_drafts, propose_drafts

    V = 3
    g = torch.Generator().manual_seed(1)
    P = torch.softmax(torch.randn(V, V, V, V, generator=g), -1)
    p1 = torch.tensor([0.5, 0.3, 0.2])
    p2, p3 = P[:, 0, 0], P[:, :, 1]
    exact = p1[:, None, None] * p2[:, :, None] * p3
    draft_logits = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]).log()
    counts = torch.zeros(V, V, V)
    for _ in range(3000):
        x1 = int(torch.multinomial(p1, 1, generator=g))
        drafts, q = propose_drafts(draft_logits, torch.arange(V), V, 1.0, g, method)
        rows = torch.stack([p2[x1], p3[x1, drafts[0]], P[x1, drafts[0], drafts[1]]]).log()
        _, emitted = accept_drafts(drafts, rows, 1.0, q, g)
        seq = [x1] + emitted.tolist()
        if len(seq) < 3:
            seq.append(int(torch.multinomial(p3[seq[0], seq[1]], 1, generator=g)))
        counts[tuple(seq[:3])] += 1
    stat, crit = chi_square_ok(counts, exact)
    assert stat < crit, (stat, crit)


def tiny_vocab_models(V: int = 3):
    """A 2-layer Llama verifier and a random drafter over a 3-token vocabulary (distinct, non-uniform p and q)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    verifier = LlamaForCausalLM(cfg).eval()
    dcfg = DrafterConfig(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2], num_depths=2)
    drafter = PEagleDrafter(dcfg).eval()
    with torch.no_grad():
        verifier.lm_head.weight.normal_(0, 0.08)
        drafter.lm_head.weight.normal_(0, 0.3)
    return verifier, drafter


def exact_first_tokens(verifier, prompt: list[int], T: float, V: int = 3) -> torch.Tensor:
    """P(x1, x2, x3) of plain sampling at temperature T, enumerated: ``[V, V, V]``."""
    seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # [V*V, P+2]
    with torch.no_grad():
        p = torch.softmax(verifier(input_ids=seqs).logits[:, -3:].float() / T, -1)  # [V*V, 3, V]
    p1 = p[0, 0]  # [V]
    p2 = p[::V, 1]  # [V, V]: row a = P(x2 | x1 = a)
    p3 = p[:, 2].view(V, V, V)  # P(x3 | x1, x2)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, z: float = 3.09) -> tuple[float, float]:
    """Pearson chi-square of ``counts`` against ``probs`` (cells with expectation < 5 merged) and
    its 0.999 quantile (Wilson-Hilferty)."""
    N = counts.sum()
    exp = probs.flatten() * N
    obs = counts.flatten().float()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    obs = torch.cat([obs[~small], obs[small].sum()[None]])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = exp.numel() - 1
    crit = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    return stat, crit


def test_rejection_sampling_two_depths_keeps_the_joint_distribution():
    """One speculative step over a table-defined 3-token language model: x1 ~ p, two parallel drafts
    from fixed q1, q2 (as P-EAGLE drafts: not conditioned on each other), verified by
    :func:`accept_drafts`, the rest of x1..x3 sampled plainly. The joint of (x1, x2, x3) is the
    model's. A sampler that kept every draft, or resampled p instead of max(0, p - q), fails."""
    from peagle_train.generate.speculative import accept_drafts

    V = 3
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(V, V, V, V, generator=g), -1)  # P[a, b, c] = p(next | x1=a, x2=b, x3=c)
    p1 = torch.tensor([0.5, 0.3, 0.2])
    p2 = P[:, 0, 0]  # p(x2 | x1): rows a
    p3 = P[:, :, 1]  # p(x3 | x1, x2)
    exact = p1[:, None, None] * p2[:, :, None] * p3  # [V, V, V]
    q = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1]])  # [2, V] the two depths' proposals
    counts = torch.zeros(V, V, V)
    N = 3000
    for _ in range(N):
        x1 = int(torch.multinomial(p1, 1, generator=g))
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]  # [2]
        rows = torch.stack([p2[x1], p3[x1, drafts[0]], P[x1, drafts[0], drafts[1]]]).log()  # [3, V]
        _, emitted = accept_drafts(drafts, rows, 1.0, q, g)
        seq = [x1] + emitted.tolist()
        if len(seq) < 3:
            seq.append(int(torch.multinomial(p3[seq[0], seq[1]], 1, generator=g)))
        counts[tuple(seq[:3])] += 1
    stat, crit = chi_square_ok(counts, exact)
    assert stat < crit, (stat, crit)


def sample_first_tokens(verifier, drafter, prompt, T, seeds, plain: bool = False, method: str = "probabilistic"):
    """Counts ``[3, 3, 3]`` of the first three tokens over ``seeds``, and (accepted, drafted)."""
    from peagle_train.generate.speculative import plain_generate

    counts, acc, dra = torch.zeros(3, 3, 3), 0, 0
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        out = plain_generate(verifier, prompt, 3, temperature=T, generator=g) if plain else \
            speculative_generate(verifier, drafter, prompt, 4, 2, temperature=T, generator=g,
                                 draft_sample_method=method)
        counts[tuple(out.tokens[:3])] += 1
        acc, dra = acc + out.accepted, dra + out.drafted
    return counts, acc, dra


def test_speculative_sampling_end_to_end_is_seeded_and_mixes():
    """On a tiny Llama at T = 0.8, K = 2: seeded runs repeat, drafts are both kept and rejected."""
    verifier, drafter = tiny_vocab_models()
    prompt = [1, 2, 0, 1, 2]
    _, acc, dra = sample_first_tokens(verifier, drafter, prompt, 0.8, range(15))
    assert 0 < acc < dra
    runs = [speculative_generate(verifier, drafter, prompt, 6, 2, temperature=0.8,
                                 generator=torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_speculative_sampling_keeps_the_verifier_distribution(method):
    """End to end on a tiny Llama: the first three tokens of speculative sampling (K = 2, so x2 and
    x3 come from drafts, rejections and bonus tokens) follow plain sampling's exact joint
    distribution at T = 0.8 (chi-square, 0.999 quantile), with either draft sample method; so do plain
    samples."""
    verifier, drafter = tiny_vocab_models()
    prompt, T = [1, 2, 0, 1, 2], 0.8
    exact = exact_first_tokens(verifier, prompt, T)  # [3, 3, 3]
    spec, acc, dra = sample_first_tokens(verifier, drafter, prompt, T, range(600), method=method)
    stat, crit = chi_square_ok(spec, exact)
    assert stat < crit, (stat, crit)
    assert 0.1 < acc / dra < 0.9  # rejections and acceptances both exercised
    plain, _, _ = sample_first_tokens(verifier, drafter, prompt, T, range(10_000, 10_300), plain=True)
    stat, crit = chi_square_ok(plain, exact)
    assert stat < crit, (stat, crit)


def test_negative_temperature_is_a_clear_error(tiny_verifier):
    with pytest.raises(InputError, match="temperature"):
        speculative_generate(tiny_verifier, tiny_drafter(tiny_verifier), PROMPTS[0], 3, temperature=-1.0)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", 32, "hidden size 32 != verifier's 64"),
    ("vocab_size", 1000, "vocab size 1000 != verifier's 49152"),
    ("aux_layer_ids", [1, 2, 5], r"aux layers \[5\] outside the verifier's hidden states 0..4"),
])
def test_each_mismatch_is_named(tiny_verifier, field, value, match):
    drafter = tiny_drafter(tiny_verifier)
    setattr(drafter.config, field, value)
    with pytest.raises(InputError, match=match) as err:
        check_compatible(tiny_verifier, drafter)
    assert "--verifier" in str(err.value)



@pytest.fixture(scope="module")
def counter_verifier():
    """A 4-layer Llama over 64 ids whose greedy next token is the last one + 1 (mod 64): outputs of
    distinct tokens, so an EOS id can be put at any position. Embeddings are one-hot, the layers add
    nothing (zero output projections) and the lm_head is the shift plus noise 0.1, so sampling at
    temperature 2 is far from deterministic."""
    from transformers import LlamaConfig, LlamaForCausalLM

    V = 64
    cfg = LlamaConfig(vocab_size=V, hidden_size=V, intermediate_size=16, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(V))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.eye(V).roll(1, 0) + 0.1 * torch.randn(V, V))
    assert greedy_generate(model, [1, 5, 9], 30).tokens == list(range(10, 40))
    return model


def _steps_until(n_tokens: int, K: int) -> list[int]:
    """Accepted drafts per step of an all-accepting run that emits ``n_tokens`` after the prefill token."""
    out = []
    while n_tokens > 0:
        e = min(K + 1, n_tokens)
        out.append(e - 1)
        n_tokens -= e
    return out


def _check_identity(spec, K: int) -> None:
    assert len(spec.tokens) == 1 + sum(a + 1 for a in spec.accepted_per_step)
    assert all(0 <= a <= d <= K for a, d in zip(spec.accepted_per_step, spec.drafted_per_step))


@pytest.mark.parametrize("K", [3, 4])
def test_eos_at_every_position_counts_only_emitted_drafts(counter_verifier, K):
    """An oracle drafts the right tokens; the EOS is put at every position of the first three blocks
    (each draft position and the bonus). Tokens after the EOS are dropped and not counted: a step
    ending at an EOS at draft position i counts i accepted and i drafted, and emits i + 1 tokens."""
    prompt = [1, 5, 9]
    free = list(range(10, 40))
    oracle = OracleDrafter(counter_verifier, prompt + free, num_depths=K)
    for j in range(3 * (K + 1) + 1):
        for eos in ([free[j]], [63, free[j], 62]):  # one id, or several
            spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=30, eos_token_id=eos)
            assert spec.tokens == free[:j + 1]
            _check_identity(spec, K)
            assert spec.accepted_per_step == _steps_until(j, K)
            assert spec.drafted_per_step == spec.accepted_per_step  # all kept; none scored after the EOS
    # Without an EOS the same run drafts K per step and keeps them all.
    spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=1 + 3 * (K + 1))
    assert spec.accepted_per_step == spec.drafted_per_step == [K] * 3


def test_eos_wrong_draft_then_verifier_eos(counter_verifier):
    """A rejected draft followed by the verifier's EOS: the EOS position is not scored either."""
    prompt, K = [1, 5, 9], 4
    free = list(range(10, 40))
    oracle = OracleDrafter(counter_verifier, prompt + free, num_depths=K, wrong_from=2)
    spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=30, eos_token_id=12)
    # prefill 10; step 1 drafts 11, 12 (right), 14, 15 (wrong): emits 11, 12 = EOS (a kept draft).
    assert spec.tokens == [10, 11, 12]
    assert spec.accepted_per_step == [1] and spec.drafted_per_step == [1]
    # with EOS 13 the step keeps 11, 12, rejects 14 and the verifier emits 13 = EOS: the rejected
    # position holds the EOS, so it is not scored (as when the EOS is drafted right).
    spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=30, eos_token_id=13)
    assert spec.tokens == [10, 11, 12, 13]
    assert spec.accepted_per_step == [2] and spec.drafted_per_step == [2]
    spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=30, eos_token_id=14)
    assert spec.tokens == [10, 11, 12, 13, 14]  # step 1 ends at 13 (no EOS): 2 of 4 kept; step 2 drafts 14
    assert spec.accepted_per_step == [2, 0] and spec.drafted_per_step == [4, 0]


def test_max_new_tokens_cap_counts(counter_verifier):
    """Every cap: the output is cut at the cap and the counts add up to it, with or without an EOS after it."""
    prompt, K = [1, 5, 9], 4
    free = list(range(10, 40))
    oracle = OracleDrafter(counter_verifier, prompt + free, num_depths=K)
    for cap in range(1, 16):
        for eos in (None, [free[cap - 1]], [free[cap]]):
            spec = speculative_generate(counter_verifier, oracle, prompt, max_new_tokens=cap, eos_token_id=eos)
            assert spec.tokens == free[:cap]
            _check_identity(spec, K)
            assert spec.accepted_per_step == _steps_until(cap - 1, K)


@pytest.mark.parametrize("temperature", [0.0, 2.0])
def test_random_drafter_counts_add_up_with_eos(counter_verifier, temperature):
    """A random drafter (rejections at any depth), greedy and sampled; each output token in turn is an EOS."""
    drafter = tiny_drafter(counter_verifier, num_depths=3)
    prompt = [1, 5, 9]

    def run(eos):
        return speculative_generate(counter_verifier, drafter, prompt, max_new_tokens=20, eos_token_id=eos,
                                    temperature=temperature, generator=torch.Generator().manual_seed(1))

    free = run(None).tokens
    assert len(free) == 20
    for j in range(len(free)):
        spec = run([free[j], 63])
        stop = min(i for i, t in enumerate(free) if t in (free[j], 63))
        assert spec.tokens == free[:stop + 1]
        _check_identity(spec, 3)


def test_verify_pass_logits_equal_the_full_forward(tiny_verifier):
    """The body pass + one lm_head product over the K+1 rows gives the verifier's own logits."""
    from peagle_train.generate.verifier import rollback_cache, verifier_body_pass, verifier_pass

    prompt, step = torch.tensor(PROMPTS[0]), torch.tensor([11, 2222, 333, 44, 5555])
    caches = [rollback_cache(tiny_verifier), rollback_cache(tiny_verifier)]
    with torch.no_grad():
        for cache in caches:
            verifier_pass(tiny_verifier, prompt, cache, want_hidden=False, last_only=True)
        got, hs = verifier_body_pass(tiny_verifier, step, caches[0])
        want, want_hs = verifier_pass(tiny_verifier, step, caches[1], want_hidden=True)
    assert got.shape == want.shape == (5, tiny_verifier.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(hs[-1], want_hs[-1])


def test_lm_head_of_another_type_is_called_as_it_is():
    """A Linear subclass (e.g. a quantized head) is called, never read through its ``weight``."""
    from peagle_train.generate.verifier import lm_head_logits

    class Shifted(nn.Linear):
        def forward(self, x):
            return super().forward(x) + 1.0

    torch.manual_seed(0)
    plain, shifted = nn.Linear(8, 32, bias=True), Shifted(8, 32, bias=False)
    hidden = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(lm_head_logits(plain, hidden), plain(hidden), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lm_head_logits(shifted, hidden), shifted(hidden))


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_verify_pass_logits_keep_the_models_logit_scaling(family):
    """Granite divides its logits by ``logits_scaling``, Cohere multiplies them by ``logit_scale``: the
    verification pass must give those logits (rejection sampling at T > 0 reads their softmax)."""
    from transformers import CohereConfig, CohereForCausalLM, GraniteConfig, GraniteForCausalLM

    from peagle_train.generate.verifier import new_cache, verifier_body_pass, verifier_pass

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = (GraniteForCausalLM(GraniteConfig(logits_scaling=4.0, **shape)) if family == "granite"
             else CohereForCausalLM(CohereConfig(logit_scale=0.25, **shape))).eval()
    ids = torch.tensor([3, 5, 7, 9])
    with torch.no_grad():
        want, _ = verifier_pass(model, ids, new_cache(model), want_hidden=True)
        got, _ = verifier_body_pass(model, ids, new_cache(model))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_online_layer_l_is_what_extraction_stores(tiny_verifier):
    """Speculative decoding feeds aux layer L (the last decoder layer's output before the final norm,
    :func:`peagle_train.generate.verifier.aux_hidden_states`), the value extraction stores and vLLM feeds, not
    transformers' normed ``hidden_states[L]``."""
    from peagle_data.extract.hf_forward import verifier_features
    from peagle_train.generate.verifier import aux_hidden_states, new_cache, verifier_pass

    L = tiny_verifier.config.num_hidden_layers
    ids = torch.tensor([1, 504, 3458, 282, 260, 1115, 30, 77])
    stored, final = verifier_features(tiny_verifier.model, ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]),
                                      [L])
    with aux_hidden_states(tiny_verifier) as last:
        _, hs = verifier_pass(tiny_verifier, ids, new_cache(tiny_verifier), want_hidden=True)
    assert torch.equal(last["last"][0].to(torch.bfloat16), stored[:, 0])
    assert torch.equal(hs[L][0].to(torch.bfloat16), final)  # transformers' entry L is the normed one
    assert not torch.allclose(stored[:, 0].float(), final.float(), atol=0.1)


# ------------------------------------------------------------------------ top-k / top-p, as vLLM's sampler
def test_truncate_logits_keeps_vllms_top_k_and_top_p():
    from peagle_train.generate.speculative import Truncation, target_probs, truncate_logits

    inf = float("-inf")
    z = torch.tensor([3.0, 1.0, 2.0, 0.0])
    assert truncate_logits(z, Truncation(top_k=2)).tolist() == [3.0, inf, 2.0, inf]
    assert truncate_logits(torch.tensor([1.0, 1.0, 0.0]), Truncation(top_k=1)).tolist() == [1.0, 1.0, inf]  # ties kept
    assert truncate_logits(z, Truncation(top_k=4)).tolist() == z.tolist()  # k >= V: off
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # the fewest most likely tokens whose mass reaches top_p: 0.5 + 0.3 = 0.8 >= 0.75; 0.8 < 0.85 needs a third
    assert torch.isinf(truncate_logits(p.log(), Truncation(top_p=0.75))).tolist() == [False, False, True, True]
    assert torch.isinf(truncate_logits(p.log(), Truncation(top_p=0.85))).tolist() == [False, False, False, True]
    assert torch.isinf(truncate_logits(p.log(), Truncation(top_p=0.01))).tolist() == [False, True, True, True]
    assert torch.allclose(target_probs(p.log(), 1.0, Truncation(top_p=0.85)), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    # top-k first, then top-p over what it kept (0.5 / 0.8 = 0.625 < 0.7: both stay)
    assert torch.allclose(target_probs(p.log(), 1.0, Truncation(top_k=2, top_p=0.7)), torch.tensor([0.625, 0.375, 0, 0]))
    with pytest.raises(ValueError, match="--top-p"):
        Truncation(top_p=0.0)
    with pytest.raises(ValueError, match="--top-k"):
        Truncation(top_k=-1)


def test_sampling_with_top_p_draws_the_truncated_distribution():
    """The bonus token of a step with no drafts and the token after a rejected draft (q one-hot, vLLM's greedy
    draft scheme) are samples of the truncated, renormalised distribution: 4000 seeded draws each, within 4 SE of
    the exact probabilities, and nothing outside the top-p set; a draft outside it is never kept."""
    from peagle_train.generate.speculative import Truncation, accept_drafts, target_probs

    trunc = Truncation(top_p=0.85)
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log() * 2.0  # at T = 2 the probabilities above
    exact = target_probs(logits, 2.0, trunc)
    assert torch.allclose(exact, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    n = 4000
    for drafts in (torch.zeros(0, dtype=torch.long), torch.tensor([3])):
        counts = torch.zeros(4)
        for seed in range(n):
            kept, emitted = accept_drafts(drafts, logits[None].repeat(2, 1), 2.0, None,
                                          torch.Generator().manual_seed(seed), trunc)
            assert kept == 0
            counts[int(emitted[-1])] += 1
        freq = counts / n
        se = (exact * (1 - exact) / n).sqrt()
        assert counts[3] == 0 and bool(((freq - exact).abs() <= 4 * se + 1e-9).all()), (freq, exact)


def test_top_k_1_at_t1_is_greedy(tiny_verifier):
    """top-k 1 keeps only the argmax: sampling at T = 1, plain and speculative, gives the greedy tokens."""
    from peagle_train.generate.speculative import Truncation, plain_generate

    greedy = greedy_generate(tiny_verifier, PROMPTS[0], 12).tokens
    one = Truncation(top_k=1)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        assert plain_generate(tiny_verifier, PROMPTS[0], 12, temperature=1.0, generator=gen, truncation=one).tokens \
            == greedy
        spec = speculative_generate(tiny_verifier, tiny_drafter(tiny_verifier, num_depths=3), PROMPTS[0], 12, 3,
                                    temperature=1.0, generator=gen, truncation=one)
        assert spec.tokens == greedy
    sampled = plain_generate(tiny_verifier, PROMPTS[0], 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.tokens != greedy  # without it T = 1 samples: the test can fail


def test_served_truncation_reads_the_generation_config_and_an_option_overrides(tmp_path):
    """vLLM's default (``--generation-config auto``): a request's top_k / top_p from generation_config.json, as
    Qwen3 ships them (20 / 0.95); an option takes their place; a file without them: off. Recorded with the source."""
    import json

    from peagle_train.generate.speculative import Truncation, served_truncation

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20, "top_p": 0.95, "temperature": 0.6}))
    truncation, record = served_truncation(str(tmp_path))
    assert truncation == Truncation(20, 0.95)
    assert record == {"top_k": 20, "top_k_from": "generation_config", "top_p": 0.95, "top_p_from": "generation_config"}
    truncation, record = served_truncation(str(tmp_path), top_k=0, top_p=None)
    assert truncation == Truncation(0, 0.95) and record["top_k_from"] == "option" and record["top_k"] == 0
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert served_truncation(str(tmp_path)) == (Truncation(), {"top_k": 0, "top_k_from": "off", "top_p": 1.0,
                                                               "top_p_from": "off"})


# ------------------------------------------------------------------ DFlash drafters
def tiny_dflash(verifier, block_size: int = 4, draft_vocab_size: int | None = 512, seed: int = 0) -> DFlashDrafter:
    """A random DFlash drafter (2 layers, blocks of ``block_size``) for ``verifier`` (hidden 64) reading layers 1, 2,
    3; draft vocab every 7th verifier id (None: the verifier's), the verifier's embeddings and lm_head rows."""
    vcfg = verifier.config
    cfg = DFlashConfig(hidden_size=vcfg.hidden_size, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=vcfg.vocab_size,
                       draft_vocab_size=draft_vocab_size or vcfg.vocab_size, aux_layer_ids=[1, 2, 3],
                       num_hidden_layers=2, mask_token_id=5, block_size=block_size, rope_theta=10000.0,
                       verifier_name_or_path="tiny")
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).eval()
    d2t = None
    if draft_vocab_size is not None:
        d2t = torch.arange(draft_vocab_size) * 7 - torch.arange(draft_vocab_size)
    drafter.init_from_verifier(verifier.model.embed_tokens.weight.detach(), verifier.lm_head.weight.detach(), d2t=d2t)
    return drafter


@pytest.mark.parametrize("block_size", [2, 4])
def test_dflash_speculative_equals_greedy(tiny_verifier, block_size):
    drafter = tiny_dflash(tiny_verifier, block_size)
    for prompt in PROMPTS:
        ref = greedy_generate(tiny_verifier, prompt, 20)
        out = speculative_generate(tiny_verifier, drafter, prompt, 20)
        assert out.tokens == ref.tokens
        assert out.drafted_per_step[0] == max(out.drafted_per_step) == block_size - 1  # B - 1 drafts a step


def test_dflash_session_drafts_the_block_anchored_at_the_newest_token(tiny_verifier):
    """Each step's drafts are the block of the newest token against the features of every token before it: the
    drafter run on the whole context from scratch gives the same logits."""
    drafter = tiny_dflash(tiny_verifier, block_size=4)
    x = torch.tensor(PROMPTS[0] + [77, 78, 79])
    with torch.no_grad():
        hs = tiny_verifier.model(input_ids=x[None], output_hidden_states=True).hidden_states
    g = torch.cat([hs[layer][0] for layer in (1, 2, 3)], dim=-1)  # [n, L*H]
    session = DFlashSession(drafter, 3)
    first = session.draft(x[1:7], g[:6], 3)  # prompt rows 0..5 read, newest token x_6
    second = session.draft(x[7:10], g[6:9], 2)  # rows 6..8 read, newest token x_9
    assert torch.equal(first, drafter.draft(g[:6], int(x[6]), 3))
    assert torch.equal(second, drafter.draft(g[:9], int(x[9]), 2))
    assert not torch.equal(second, drafter.draft(g[:8], int(x[9]), 2))  # one context row less: other drafts


def test_dflash_tree_is_refused_with_the_reason(tiny_verifier):
    from peagle_train.generate.tree import DFLASH_TREE_REFUSED, TreeSpec, tree_generate

    with pytest.raises(InputError, match="drafts one chain per step") as e:
        tree_generate(tiny_verifier, tiny_dflash(tiny_verifier), PROMPTS[0], 8, TreeSpec(topk=[2, 1, 1]))
    assert DFLASH_TREE_REFUSED in str(e.value) and e.value.field == "--tree-topk"
    with pytest.raises(InputError, match="drafts one chain per step") as e:  # the option the user gave is named
        tree_generate(tiny_verifier, tiny_dflash(tiny_verifier), PROMPTS[0], 8, TreeSpec(nodes=4))
    assert e.value.field == "--tree-nodes"
