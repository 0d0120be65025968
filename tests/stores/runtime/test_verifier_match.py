"""tokenizer_fingerprint: what a tokenizer's ids mean, robust to saving and reloading."""

from __future__ import annotations

from stores.runtime.verifier_match import has_tokenizer, tokenizer_fingerprint


def test_the_fingerprint_follows_the_vocabulary(tmp_path, smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    fp = tokenizer_fingerprint(tok)
    assert len(fp) == 16 and int(fp, 16) >= 0
    tok.save_pretrained(tmp_path / "copy")
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path / "copy")) == fp  # a saved copy: the same
    tok.add_tokens(["<|peagle_extra|>"])
    assert tokenizer_fingerprint(tok) != fp and len(tok) == 49153
    assert has_tokenizer(smollm2_tokenizer_dir) and not has_tokenizer(tmp_path)
