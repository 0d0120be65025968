"""The family matrix on online decoding (P-EAGLE and DFlash drafters): speculative output equals greedy past the
sliding window, and with the hybrid verifiers (recurrent linear-attention / state-space layers) after every rejected draft.

Each step drafts K = 3 tokens and the verifier keeps 2 of them (an oracle drafter wrong from depth 2),
so the verifier's KV cache is cut back after every step, long after the 4-token windows have slid; a hybrid
verifier's recurrent state is put back to its snapshot and the kept tokens fed again at every step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from peagle_train.generate.speculative import greedy_generate, speculative_generate
from peagle_train.generate.tree import TreeSpec, check_tree_config, tree_generate
from peagle_train.generate.verifier import (TOKEN_STATES, crop_cache, keep_fed, new_cache, record_token_states,
                                            recurrent_layers, rollback_cache, snapshot_state, verifier_pass)
from peagle_train.model.config import DrafterConfig
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.drafter import PEagleDrafter

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import FAMILIES, HYBRID, WINDOW, build_family, family_config  # noqa: E402

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


def test_a_layer_mixing_state_and_attention_is_refused():
    """Falcon-H1 runs Mamba-2 and attention side by side in one layer (transformers'
    ``LinearAttentionAndFullAttentionLayer``): not a layer kind peagle cuts back, so refused with the reason."""
    from types import SimpleNamespace

    from transformers import FalconH1Config

    from stores.errors import InputError

    with pytest.raises(InputError, match="LinearAttentionAndFullAttentionLayer.*cannot be cut back"):
        rollback_cache(SimpleNamespace(config=FalconH1Config(num_hidden_layers=4)))


# ------------------------------------------------------------------------------------------ hybrid verifiers
def _full_forward_greedy(verifier, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding without a cache: each token the argmax of a full forward over everything before it."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(verifier(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def hybrids():
    """The hybrid verifiers, built once for this module."""
    return {name: build_family(name) for name in HYBRID}


@pytest.mark.parametrize("token_states", [True, False], ids=["token_states", "snapshot"])
@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_speculative_equals_greedy_after_every_rejection(family, token_states, hybrids, monkeypatch):
    """Every step rejects the third draft: the recurrent state is put back to the kept tokens (4 steps), from
    the per-token states transformers records (5.25) or from the snapshot, the kept tokens fed again (5.19,
    and 5.25 told not to record), and the output is the verifier's greedy output, a full forward's argmax."""
    import peagle_train.generate.speculative as speculative

    if not token_states:
        monkeypatch.setattr(speculative, "record_token_states", lambda cache, n: False)
    verifier = hybrids[family]
    assert recurrent_layers(rollback_cache(verifier))  # the rollback cache keeps the recurrent layers
    greedy = greedy_generate(verifier, PROMPT, 14)
    assert greedy.tokens == _full_forward_greedy(verifier, PROMPT, 14)
    oracle = Oracle(verifier.config.get_text_config(), PROMPT + greedy.tokens, num_depths=3, wrong_from=2)
    spec = speculative_generate(verifier, oracle, PROMPT, 14)
    assert spec.tokens == greedy.tokens
    assert spec.accepted_per_step == [2, 2, 2, 2, 0] and spec.drafted_per_step == [3, 3, 3, 3, 0]
    assert spec.restored_steps == 4  # the last step drafted nothing: nothing to put back
    assert spec.recomputed_steps == (0 if token_states and TOKEN_STATES else 4)
    full = Oracle(verifier.config.get_text_config(), PROMPT + greedy.tokens, num_depths=3, wrong_from=9)
    right = speculative_generate(verifier, full, PROMPT, 14)  # every draft kept: the state is already right
    assert right.tokens == greedy.tokens and right.restored_steps == 0 and right.accepted_per_step[0] == 3


class CoinOracle(Oracle):
    """Right or wrong by a fixed coin per (position, depth): steps keep 0, 1, 2 or all 3 drafts."""

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], self.config.draft_vocab_size)
        for i, (pos, depth) in enumerate(hidden.tolist()):
            tok = self.full[pos + 1] if pos + 1 < len(self.full) else 0
            wrong = (5 * pos + 2 * depth) % 9 < 3
            out[i, (tok + 1) % out.shape[1] if wrong else tok] = 1.0
        return out


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_mixed_acceptance_and_random_drafter_equal_greedy(family, hybrids):
    """Steps keeping 0..3 drafts (the state put back to each length), and an untrained P-EAGLE drafter (its
    cached session fed the hybrid's aux features, almost every draft rejected): both identical to greedy."""
    verifier = hybrids[family]
    text = verifier.config.get_text_config()
    greedy = greedy_generate(verifier, PROMPT, 16)
    coin = speculative_generate(verifier, CoinOracle(text, PROMPT + greedy.tokens, 3, 0), PROMPT, 16)
    assert coin.tokens == greedy.tokens
    assert {0, 1, 2, 3} <= set(coin.accepted_per_step), coin.accepted_per_step
    assert coin.restored_steps == sum(n < k for n, k in zip(coin.accepted_per_step, coin.drafted_per_step))
    torch.manual_seed(0)
    drafter = PEagleDrafter(DrafterConfig(hidden_size=64, intermediate_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=16, vocab_size=text.vocab_size,
                                          draft_vocab_size=text.vocab_size, aux_layer_ids=[1, 3],
                                          num_depths=3)).eval()
    spec = speculative_generate(verifier, drafter, PROMPT, 16)
    assert spec.tokens == greedy.tokens and spec.restored_steps >= 1


class SelfDrafter(Oracle):
    """Drafts the verifier's own greedy continuation of the context it is given (a full forward per draft), wrong
    by :class:`CoinOracle`'s coin: at T > 0 drafts are kept and rejected wherever the samples go."""

    def __init__(self, verifier, first_token: int, num_depths: int):
        super().__init__(verifier.config.get_text_config(), [], num_depths, 0)
        self.verifier = [verifier]  # not a submodule: the drafter's parameters stay its own
        self.first = first_token

    def forward(self, input_ids, aux_hidden, is_mask, position_ids, attn_mask):
        context = [self.first] + input_ids[~is_mask].tolist()
        self.continuation = []
        with torch.no_grad():
            for _ in range(int(is_mask.sum()) + 1):
                ids = torch.tensor([context + self.continuation])
                self.continuation.append(int(self.verifier[0](input_ids=ids).logits[0, -1].argmax()))
        return super().forward(input_ids, aux_hidden, is_mask, position_ids, attn_mask)

    def logits(self, hidden):
        out = torch.zeros(hidden.shape[0], self.config.draft_vocab_size)
        for i, (pos, depth) in enumerate(hidden.tolist()):
            tok = self.continuation[depth]
            out[i, (tok + 1) % out.shape[1] if (5 * pos + 2 * depth) % 9 < 3 else tok] = 1.0
        return out


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_sampling_reads_the_models_own_distributions(family, hybrids, monkeypatch):
    """At T > 0 the acceptance rule is the chain's; what keeps the verifier's distribution is that every row of
    logits it reads is the model's own after the tokens before it. Each step's rows, across rejections (the
    state put back and fed again), equal a full forward's over the prompt, the tokens emitted so far and the
    drafts."""
    import peagle_train.generate.speculative as speculative

    verifier = hybrids[family]
    steps = []
    accept = speculative.accept_drafts

    def recorded(drafts, logits, *args, **kwargs):
        n, emitted = accept(drafts, logits, *args, **kwargs)
        steps.append((drafts.clone(), logits[:n + 1].clone(), n))
        return n, emitted

    monkeypatch.setattr(speculative, "accept_drafts", recorded)
    spec = speculative_generate(verifier, SelfDrafter(verifier, PROMPT[0], 3), PROMPT, 16,
                                temperature=0.3, generator=torch.Generator().manual_seed(0))
    assert spec.accepted >= 1 and spec.restored_steps >= 1, spec.accepted_per_step  # kept and rejected drafts
    done = 1  # tokens emitted before the step (the prefill's)
    with torch.no_grad():
        for (drafts, rows, n), emitted in zip(steps, spec.accepted_per_step):
            ids = PROMPT + spec.tokens[:done] + drafts.tolist()
            full = verifier(input_ids=torch.tensor([ids])).logits[0].float()
            start = len(PROMPT) + done - 1  # the row after x_{t+1}
            torch.testing.assert_close(rows, full[start:start + n + 1], atol=1e-4, rtol=1e-4)
            done += emitted + 1


@pytest.mark.parametrize("token_states", [True, False], ids=["token_states", "snapshot"])
@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_cut_back_gives_the_models_own_logits(family, token_states, hybrids):
    """After 4 drafts of which 1 is kept, the logits of the next tokens are a fresh forward's (so sampling at
    T > 0, which reads the whole distribution, keeps it); without putting the state back they are not."""
    if token_states and not TOKEN_STATES:
        pytest.skip("this transformers records no per-token states (5.19): the snapshot is the only way")
    verifier = hybrids[family]
    want, _ = verifier_pass(verifier, torch.tensor(PROMPT + [5, 9, 10, 11]), new_cache(verifier), want_hidden=False)
    for restore in (True, False):
        cache = rollback_cache(verifier)
        verifier_pass(verifier, torch.tensor(PROMPT), cache, want_hidden=False)
        if token_states:
            assert record_token_states(cache, 4)
        snapshot = snapshot_state(cache, len(PROMPT))
        fed = torch.tensor([5, 6, 7, 8])
        verifier_pass(verifier, fed, cache, want_hidden=False)  # root and 3 drafts
        if restore:
            assert keep_fed(verifier, cache, fed, 1, snapshot) is not token_states  # fed again: snapshot only
        else:  # attention keys cut back, the recurrent state as the pass left it
            for i, layer in enumerate(cache.layers):
                if i not in recurrent_layers(cache) and isinstance(getattr(layer, "keys", None), torch.Tensor):
                    layer.crop(-3)
                elif hasattr(layer, "cumulative_length_linear"):
                    layer.cumulative_length_linear.sub_(3)
        got, _ = verifier_pass(verifier, torch.tensor([9, 10, 11]), cache, want_hidden=False)
        if restore:
            torch.testing.assert_close(got, want[-3:], atol=1e-4, rtol=1e-4)
        else:
            assert (got - want[-3:]).abs().max() > 1e-2


@pytest.mark.skipif(not TOKEN_STATES, reason="this transformers records no per-token states (5.19)")
def test_incomplete_per_token_states_fall_back_to_the_snapshot(hybrids):
    """A recording layer whose pass left fewer states than tokens (a model that does not record them) is not
    trusted: the state is put back to the snapshot and the kept tokens fed again, still exact."""
    verifier = hybrids["olmo_hybrid"]
    want, _ = verifier_pass(verifier, torch.tensor(PROMPT + [5, 6, 9]), new_cache(verifier), want_hidden=False)
    cache = rollback_cache(verifier)
    verifier_pass(verifier, torch.tensor(PROMPT), cache, want_hidden=False)
    assert record_token_states(cache, 4)
    snapshot = snapshot_state(cache, len(PROMPT))
    fed = torch.tensor([5, 6, 7, 8])
    verifier_pass(verifier, fed, cache, want_hidden=False)
    layer = cache.layers[recurrent_layers(cache)[0]]
    layer.recurrent_states_history[0] = layer.recurrent_states_history[0][:1]  # as a non-recording model leaves it
    assert keep_fed(verifier, cache, fed, 2, snapshot)  # fed again from the snapshot
    got, _ = verifier_pass(verifier, torch.tensor([9]), cache, want_hidden=False)
    torch.testing.assert_close(got, want[-1:], atol=1e-4, rtol=1e-4)
    assert layer.conv_states[0].shape[-1] == layer.conv_kernel_size[0] + 1  # the records of the new pass only


def test_hybrid_cache_is_cut_back_only_to_its_snapshot(hybrids):
    verifier = hybrids["qwen3_next"]
    cache = rollback_cache(verifier)
    verifier_pass(verifier, torch.tensor(PROMPT), cache, want_hidden=False)
    snapshot = snapshot_state(cache, len(PROMPT))
    verifier_pass(verifier, torch.tensor([5, 6]), cache, want_hidden=False)
    with pytest.raises(ValueError, match="recurrent state.*snapshot"):
        crop_cache(cache, len(PROMPT) + 1)
    with pytest.raises(ValueError, match="snapshot taken there"):
        crop_cache(cache, len(PROMPT) + 1, snapshot)
    assert snapshot_state(rollback_cache(build_family("qwen3")), 0) is None  # attention only: nothing to keep


@pytest.mark.parametrize("family", HYBRID)
def test_tree_with_a_hybrid_verifier_is_refused(family, hybrids):
    """A tree's nodes go through a recurrent layer as one sequence: refused with the reason, from the config alone
    (before weights load) and by the decoder."""
    from stores.errors import InputError

    with pytest.raises(InputError, match=r"recurrent state.*state per branch.*Use the chain"):
        check_tree_config(family_config(family))
    verifier = hybrids[family]
    oracle = Oracle(verifier.config.get_text_config(), PROMPT * 3, num_depths=3, wrong_from=2)
    with pytest.raises(InputError, match="recurrent state"):
        tree_generate(verifier, oracle, PROMPT, 6, TreeSpec(topk=(2, 1, 1)))
    check_tree_config(family_config("gemma3_text"))  # attention-only: allowed


# ------------------------------------------------------------------------------------------ DFlash drafters
def _random_dflash(verifier, block_size: int = 4, seed: int = 0) -> DFlashDrafter:
    """An untrained DFlash drafter (one Qwen3 layer, blocks of ``block_size``) reading the family verifier's hidden
    states 0, 1, 2 (the embeddings and both layers' outputs, a recurrent layer's among them in the hybrids), its embeddings and lm_head the verifier's."""
    text = verifier.config.get_text_config()
    cfg = DFlashConfig(hidden_size=text.hidden_size, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=text.vocab_size,
                       draft_vocab_size=text.vocab_size, aux_layer_ids=[0, 1, 2], num_hidden_layers=1,
                       mask_token_id=5, block_size=block_size, rope_theta=10000.0, verifier_name_or_path="tiny")
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg).eval()
    drafter.init_from_verifier(verifier.get_input_embeddings().weight.detach(),
                               verifier.get_output_embeddings().weight.detach())
    return drafter


@pytest.mark.parametrize("family", FAMILIES + HYBRID)
def test_dflash_drafter_decodes_every_family_as_greedy(family, hybrids):
    """The family matrix for DFlash (issue 52): a DFlash drafter whose aux features come from each family's layers
    (the hybrids' linear-attention / Mamba-2 outputs among them) decodes past the sliding window with the verifier's
    greedy output, a step drafting B - 1 = 3; its drafts, almost all rejected, cut the verifier's cache back (the
    hybrids' recurrent state put back) at every step."""
    verifier = hybrids[family] if family in HYBRID else build_family(family)
    greedy = greedy_generate(verifier, PROMPT, 14)
    spec = speculative_generate(verifier, _random_dflash(verifier), PROMPT, 14)
    assert spec.tokens == greedy.tokens
    assert len(PROMPT) + len(spec.tokens) > 3 * WINDOW
    assert spec.drafted_per_step[0] == max(spec.drafted_per_step) == 3  # fewer only where the turn's end is near
    if family in HYBRID:
        assert spec.restored_steps >= 1  # a rejected draft put the recurrent state back
