"""A model directory's identity is its content: the same for every conversion or re-save of one model,
different (and named by part) for another model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.model_cache import resolve_model
from runtime.model_identity import (compare_identity, identity_differences, legacy_model_fingerprint,
                                           model_fingerprint, model_identity)

ROOT = Path(__file__).resolve().parents[3]
_CONVERT = "from runtime.model_cache import resolve_model; resolve_model('smollm2-135m', need_weights={})"


def _convert(home: Path, offline: bool, need_weights: bool = False) -> Path:
    """Convert the embedded verifier into ``home`` in a fresh process (``HF_HUB_OFFLINE`` is read at import)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(PEAGLE_HOME=str(home), PYTHONPATH=str(ROOT), **({"HF_HUB_OFFLINE": "1"} if offline else {}))
    subprocess.run([sys.executable, "-c", _CONVERT.format(need_weights)], env=env, cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    return home / "models" / "smollm2-135m"


def _same_json_files(a: Path, b: Path) -> list[str]:
    names = sorted(f.name for f in a.iterdir() if f.suffix in (".json", ".jinja"))
    assert names == sorted(f.name for f in b.iterdir() if f.suffix in (".json", ".jinja"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return names


def test_the_embedded_conversion_is_one_model_with_and_without_hf_hub_offline(tmp_path):
    """The saved tokenizer config recorded the loader's ``local_files_only`` (``HF_HUB_OFFLINE``), so
    two conversions had two fingerprints; now they write the same bytes."""
    offline, online = _convert(tmp_path / "offline", True), _convert(tmp_path / "online", False)
    assert "tokenizer_config.json" in _same_json_files(offline, online)
    assert "local_files_only" not in json.loads((offline / "tokenizer_config.json").read_text())
    assert model_fingerprint(offline) == model_fingerprint(online)
    assert legacy_model_fingerprint(offline) == legacy_model_fingerprint(online)


@pytest.mark.skipif(not os.environ.get("PEAGLE_SLOW_TESTS"), reason="slow: a full conversion (~30 s)")
def test_two_full_conversions_have_one_fingerprint(tmp_path):
    """The suite's own converted verifier (its model home) against a full conversion into another home with
    ``HF_HUB_OFFLINE`` the other way round."""
    shared = resolve_model("smollm2-135m")
    other = _convert(tmp_path / "other", not os.environ.get("HF_HUB_OFFLINE"), True)
    assert shared.parent.parent != other.parent.parent
    assert model_identity(shared) == model_identity(other)  # byte-equal JSON: the tokenizer-only test above
    assert model_fingerprint(shared) == model_fingerprint(other)


def resaved(src: Path, out: Path) -> Path:
    """A copy of model ``src`` as another tool might save it: loader arguments, a path and a version in its
    JSON files, the chat template moved from ``chat_template.jinja`` into ``tokenizer_config.json``."""
    shutil.copytree(src, out)
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok.update(local_files_only=True, is_local=True, name_or_path=str(src),
               chat_template=(out / "chat_template.jinja").read_text())
    (out / "chat_template.jinja").unlink()
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=4))
    config = json.loads((out / "config.json").read_text())
    config.update(transformers_version="9.9.9", _name_or_path=str(src))
    config["torch_dtype"] = config.pop("dtype", "float32")  # transformers 4 writes the field under this name
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_resaved_copy_has_the_same_identity(tmp_path, tiny_verifier_dir):
    copy = resaved(tiny_verifier_dir, tmp_path / "copy")
    assert model_identity(copy) == model_identity(tiny_verifier_dir)
    assert model_fingerprint(copy) == model_fingerprint(tiny_verifier_dir)
    assert legacy_model_fingerprint(copy) != legacy_model_fingerprint(tiny_verifier_dir)  # the old hash differed
    check = compare_identity({"fingerprint": model_fingerprint(tiny_verifier_dir),
                              "identity": model_identity(tiny_verifier_dir)}, copy)
    assert check.same and check.comparison == "identity"


def test_the_differing_parts_are_named(tmp_path, tiny_verifier_dir):
    import torch
    from safetensors.torch import load_file, save_file

    other = shutil.copytree(tiny_verifier_dir, tmp_path / "other")
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1  # the last tensor of the file
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    assert identity_differences(model_identity(tiny_verifier_dir), model_identity(other)) == [
        "weights (model.safetensors)", "config fields (rms_norm_eps)", "chat template (default)"]
    assert not torch.equal(weights["model.norm.weight"], load_file(tiny_verifier_dir / "model.safetensors")[
        "model.norm.weight"])
