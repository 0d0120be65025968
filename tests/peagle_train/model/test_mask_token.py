"""The drafter's mask token is never a token supervised in the data (peagle_train.model.mask_token)."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer, LlamaConfig

from peagle_train.model.mask_token import choose_mask_token, mask_token_candidates
from stores.errors import InputError

V = 49152  # SmolLM2's vocab: len(tokenizer) == V, no spare embedding rows


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def smol_no_unk(smollm2_tokenizer_dir):
    """SmolLM2-style fine-tune tokenizer: no unk token, pad == eos == <|im_end|> (2)."""
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, unk_token=None, pad_token="<|im_end|>")
    assert tok.unk_token_id is None and tok.pad_token_id == tok.eos_token_id == 2
    return tok


def _freq(**supervised) -> np.ndarray:
    """Counts of supervised tokens: ids 100..199 (content) plus the given ``id=count``."""
    freq = np.zeros(V, dtype=np.int64)
    freq[100:200] = 7
    for tid, count in supervised.items():
        freq[int(tid.lstrip("t"))] = count
    return freq


def test_smollm2_keeps_its_unk_token(smol):
    mask = choose_mask_token(smol, None, V, _freq(t2=50))  # <|im_end|> supervised at every turn end
    assert (mask.id, mask.token, mask.source) == (0, "<|endoftext|>", "the tokenizer's unk token")


def test_no_unk_and_pad_equal_eos_never_picks_the_end_of_turn_token(smol_no_unk):
    # the old rule (unk, else pad) gave 2 = <|im_end|>, a supervised token
    mask = choose_mask_token(smol_no_unk, None, V, _freq(t2=50))
    assert (mask.id, mask.token, mask.source) == (0, "<|endoftext|>", "a reserved special token")
    # a template that also supervises <|endoftext|>: the next unused reserved token, <repo_name>
    mask = choose_mask_token(smol_no_unk, None, V, _freq(t0=9, t2=50))
    assert (mask.id, mask.token, mask.source) == (3, "<repo_name>", "a reserved special token")


def test_candidate_order(smol_no_unk):
    ids = [tid for tid, _ in mask_token_candidates(smol_no_unk, None, V)]
    assert ids == [0, *range(3, 17), 2, 1]  # reserved 0, 3..16; then pad (2); then named specials (bos 1)


def test_tokenizer_mask_token_and_spare_embedding_rows_come_first(smollm2_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, mask_token="<file_sep>")
    assert choose_mask_token(tok, None, V, _freq()).id == 5  # the tokenizer's mask token
    assert choose_mask_token(tok, None, V, _freq(t5=1)).id == 0  # supervised: no spare row, so unk
    freq = np.concatenate([_freq(t5=1), np.zeros(64, dtype=np.int64)])  # 64 rows beyond the tokenizer
    mask = choose_mask_token(tok, None, V + 64, freq)
    assert (mask.id, mask.token, mask.source) == (V, None, "an embedding row beyond the tokenizer")


def test_every_candidate_supervised_is_a_clear_error(smol_no_unk):
    freq = _freq()
    freq[:17] = 3  # all 17 special tokens supervised
    with pytest.raises(InputError, match=r"--mask-token-id.*no special or reserved token is unused.*tried 0 "
                                         r"\('<\|endoftext\|>': 3 supervised\)"):
        choose_mask_token(smol_no_unk, None, V, freq)


def test_without_tokenizer_the_config_ids():
    cfg = LlamaConfig(vocab_size=256, pad_token_id=3, bos_token_id=1, eos_token_id=[2, 7])
    assert [t for t, _ in mask_token_candidates(None, cfg, 256)] == [3, 1, 2, 7]
    freq = np.zeros(256, dtype=np.int64)
    freq[[3, 1]] = 5
    mask = choose_mask_token(None, cfg, 256, freq)
    assert (mask.id, mask.token, mask.source) == (2, None, "the config's eos_token_id")


def test_override_is_validated(smol):
    mask = choose_mask_token(smol, None, V, _freq(), override=16)
    assert (mask.id, mask.token, mask.source) == (16, "<empty_output>", "--mask-token-id")
    with pytest.raises(InputError, match=r"--mask-token-id.*token 150 \('.*'\) occurs 7 times as a supervised"):
        choose_mask_token(smol, None, V, _freq(), override=150)
    with pytest.raises(InputError, match=r"--mask-token-id.*49152 is outside the verifier vocab \[0, 49152\)"):
        choose_mask_token(smol, None, V, _freq(), override=V)
