"""tokenizer_fingerprint: what a tokenizer's ids mean, robust to saving and reloading; check_store_verifier:
a store's verifier is the same content, by part (or by an older store's whole-file fingerprint)."""

from __future__ import annotations

import pytest

from stores.errors import StoreMismatchError
from runtime.model_cache import has_tokenizer, model_files
from runtime.verifier_match import check_store_verifier, tokenizer_fingerprint


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


def _store(verifier_dir, identity: bool = True):
    """A store's attributes as extraction records its verifier (or, ``identity=False``, as older stores did:
    the whole-file fingerprint alone)."""
    from types import SimpleNamespace

    from runtime.model_identity import legacy_model_fingerprint, model_fingerprint, model_identity

    record = ({"fingerprint": model_fingerprint(verifier_dir), "identity": model_identity(verifier_dir)} if identity
              else {"fingerprint": legacy_model_fingerprint(verifier_dir)})
    return SimpleNamespace(path="s.zarr", attrs={"verifier": {"name_or_path": str(verifier_dir), **record}})


def test_a_store_opens_with_a_resaved_copy_of_its_verifier(tmp_path, tiny_verifier_dir, caplog):
    """Loader arguments, paths, versions and where the chat template is kept are no part of the verifier."""
    import logging

    from tests.runtime.test_model_identity import resaved

    with caplog.at_level(logging.INFO, logger="runtime.verifier_match"):
        check_store_verifier(_store(tiny_verifier_dir),
                             model_files(str(resaved(tiny_verifier_dir, tmp_path / "copy"))))
    assert "(identity fingerprint" in caplog.text


def test_another_verifier_is_refused_with_what_differs(tmp_path, tiny_verifier_dir):
    import json
    import shutil

    other = shutil.copytree(tiny_verifier_dir, tmp_path / "other")
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(StoreMismatchError) as e:
        check_store_verifier(_store(tiny_verifier_dir), model_files(str(other)))
    msg = " ".join(str(e.value).split())
    assert msg.startswith(f"verifier {str(other)!r} is not the model the store s.zarr was extracted with (differs "
                          "in config fields (num_hidden_layers); chat template (default) (fingerprint "), msg
    assert msg.endswith(f"the store's verifier {str(tiny_verifier_dir)!r}): its targets would come from another "
                        "model; pass --verifier with the extraction's model"), msg


def test_an_older_store_is_compared_by_its_whole_file_fingerprint(tmp_path, tiny_verifier_dir, caplog):
    """A store that records no identity opens with the directory it was extracted with (the log names the
    comparison), and a copy that differs in a loader argument is refused naming the comparison."""
    import logging

    from tests.runtime.test_model_identity import resaved

    old = _store(tiny_verifier_dir, identity=False)
    with caplog.at_level(logging.INFO, logger="runtime.verifier_match"):
        check_store_verifier(old, model_files(str(tiny_verifier_dir)))
    assert "(whole-file, as an older store records it: fingerprint" in caplog.text
    with pytest.raises(StoreMismatchError, match="compared by the whole-file fingerprint the store recorded"):
        check_store_verifier(old, model_files(str(resaved(tiny_verifier_dir, tmp_path / "copy"))))
