"""Peak memory and time of ``peagle-eval --store`` (the replay judge) for a drafter of an 8B verifier's shape.

The replay reads the store's tokens and features, the drafter, and the verifier's tokenizer and generation config:
never the verifier's weights. ``--all-anchor`` adds the verifier's output head alone (``[V, H]`` in its dtype).
Before, every ``peagle-eval --store`` loaded the whole verifier in float32 (``load_verifier(name, device="cpu")``)
for the all-anchor figure; that load is measured here on a verifier of the 8B shape with ``--verifier-layers``
decoder layers (its embeddings and head at full size), and estimated at the full depth as parameters x 4 bytes
(the float32 weights alone; the load's measured overhead over that is printed too).

Each measurement runs in a fresh subprocess (``ru_maxrss`` is its own peak resident memory), the same run, the same
machine:

- ``replay``: ``run_offline_eval(drafter, store)`` (the default ``peagle-eval --store``);
- ``all_anchor``: ``run_offline_eval(..., all_anchor=True)``;
- ``old_verifier_load``: ``load_verifier(verifier, device="cpu")``, what the old path loaded besides the replay.

Sizes (defaults): Llama-3.1-8B's (hidden 4096, MLP 14336, 32 heads / 8 KV heads of 128, 32 layers, vocab 128256,
untied head, bf16), a 1-layer float32 drafter with draft vocab 32000 and 3 aux layers, K = 2, ``--conversations`` of
``--prompt-tokens`` prompt tokens and ``--answer-tokens`` answer tokens (the last an EOS). Random weights and
features: the figures are memory and time, not acceptance. The synthetic files (about 8 GB with the defaults) go to
``--work`` and stay there for a rerun.

Usage (from the repository root, inside .venv):
    python bench/bench_replay_memory.py --work /tmp/replay_bench
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peagle_train.evaluate.offline import run_offline_eval  # noqa: E402
from peagle_train.model.checkpoint import save_drafter  # noqa: E402
from peagle_train.model.config import DrafterConfig  # noqa: E402
from peagle_train.model.drafter import PEagleDrafter  # noqa: E402
from stores.features.feature_store import FeatureStore  # noqa: E402
from runtime.model_cache import load_verifier, resolve_model  # noqa: E402

EOS = 2
AUX = [2, 16, 29]


def verifier_config(a, layers: int) -> dict:
    """A Llama config of the 8B shape with ``layers`` decoder layers (config.json fields)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
            "intermediate_size": a.mlp, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": a.hidden // 32,
            "num_hidden_layers": layers, "vocab_size": a.vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": EOS,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}


def make_verifier(a, directory: Path, layers: int, weight_layers: int) -> None:
    """config.json (``layers`` decoder layers), generation_config.json, the SmolLM2 tokenizer files (its ids are below
    the vocab) and random bf16 weights (one safetensors file) of the embeddings, final norm, head and the first
    ``weight_layers`` decoder layers."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    cfg = verifier_config(a, layers)
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS], "bos_token_id": 1}))
    tok = resolve_model("smollm2-135m", need_weights=False)
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, directory / f.name)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(**cfg))
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(t.shape, generator=gen) * 0.02).bfloat16() for k, t in skeleton.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < weight_layers}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def make_drafter(a, directory: Path, verifier: Path) -> None:
    """A 1-layer drafter of the 8B shape (draft vocab: the first ``--draft-vocab`` ids), float32 as ``peagle-train``
    saves it."""
    cfg = DrafterConfig(hidden_size=a.hidden, intermediate_size=a.mlp, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=a.hidden // 32, vocab_size=a.vocab, draft_vocab_size=a.draft_vocab, aux_layer_ids=AUX,
                        num_depths=a.depths, verifier_name_or_path=str(verifier))
    drafter = PEagleDrafter(cfg).eval()
    drafter.t2d[:a.draft_vocab] = True
    save_drafter(drafter, directory)


def make_store(a, path: Path, verifier: Path) -> None:
    """One block of ``--conversations`` segments: prompt tokens (loss 0) then an answer ending with the EOS (loss 1),
    random bf16 features."""
    gen = torch.Generator().manual_seed(1)
    n = a.prompt_tokens + a.answer_tokens
    T = n * a.conversations
    store = FeatureStore.create(str(path), n_blocks=1, block_size=T, max_segments=a.conversations, layers=AUX,
                                hidden_size=a.hidden, vocab_size=a.vocab,
                                verifier={"name_or_path": str(verifier), "architecture": "LlamaForCausalLM"})
    tokens, mask, pos = [], [], []
    for _ in range(a.conversations):
        answer = torch.randint(3, 40000, (a.answer_tokens - 1,), generator=gen).tolist() + [EOS]
        tokens += torch.randint(3, 40000, (a.prompt_tokens,), generator=gen).tolist() + answer
        mask += [0] * a.prompt_tokens + [1] * a.answer_tokens
        pos += list(range(n))
    store.write_tokens(0, tokens, mask, pos, list(range(0, T + 1, n)))
    store.write_features(0, (torch.randn(T, len(AUX), a.hidden, generator=gen)).bfloat16(),
                         torch.randn(T, a.hidden, generator=gen).bfloat16())
    store.write_all_n_tokens([T])
    store.mark_done(0)


def child(mode: str, work: Path, a) -> dict:
    """One measurement in this process: seconds and peak resident memory (GB)."""
    t = time.perf_counter()
    out: dict = {"mode": mode}
    if mode == "old_verifier_load":
        model = load_verifier(str(work / "verifier_weights"), device="cpu")  # what the old path loaded
        out["params"] = sum(p.numel() for p in model.parameters())
    else:
        rep = run_offline_eval(work / "drafter", work / "store", max_new_tokens=a.answer_tokens,
                               verifier_name=str(work / "verifier"), all_anchor=mode == "all_anchor")
        out["replay_acceptance_length"] = rep["replay"].get("acceptance_length")
        out["replay_steps"] = rep["replay"].get("steps")
        out["all_anchor_al"] = rep.get("simulated_acceptance_length")
    out["seconds"] = time.perf_counter() - t
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    return out


def full_params(a) -> int:
    """Parameters of the full-depth verifier (counted on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**verifier_config(a, a.full_layers))).parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/peagle_replay_bench"))
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--mlp", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--depths", type=int, default=2)
    p.add_argument("--full-layers", type=int, default=32)
    p.add_argument("--verifier-layers", type=int, default=1, help="decoder layers of the verifier the old load reads")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=224)
    p.add_argument("--modes", default="replay,all_anchor,old_verifier_load")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.work, a)))
        return
    work = a.work
    if not (work / "store").exists():
        t = time.perf_counter()
        make_verifier(a, work / "verifier", a.full_layers, 0)  # the replay's: no decoder layer's weights
        make_verifier(a, work / "verifier_weights", a.verifier_layers, a.verifier_layers)
        make_drafter(a, work / "drafter", work / "verifier")
        make_store(a, work / "store", work / "verifier")
        print(f"built the synthetic files in {time.perf_counter() - t:.0f} s under {work}", file=sys.stderr)
    rows = {}
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        rows[mode] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        print(json.dumps(rows[mode]), file=sys.stderr)
    report(a, rows)


def report(a, rows: dict) -> None:
    """Ratios against the replay's peak, and the old path's full-depth estimate."""
    base = rows.get("replay")
    tokens = a.conversations * (a.prompt_tokens + a.answer_tokens)
    print(f"store: {a.conversations} conversations, {tokens} tokens; drafter hidden {a.hidden}, vocab {a.vocab}, draft "
          f"vocab {a.draft_vocab}, {len(AUX)} aux layers, K = {a.depths}")
    for mode, r in rows.items():
        ratio = f" ({r['peak_rss_gb'] / base['peak_rss_gb']:.2f}x the replay's peak)" if base else ""
        print(f"  {mode:18s} peak RSS {r['peak_rss_gb']:6.2f} GB{ratio}, {r['seconds']:7.1f} s")
    old = rows.get("old_verifier_load")
    if old:
        full = full_params(a)
        overhead = old["peak_rss_gb"] - old["params"] * 4 / 1e9
        est = full * 4 / 1e9
        line = (f"  old path at {a.full_layers} layers held at least the verifier in float32 = {full / 1e9:.2f} B params "
                f"x 4 B = {est:.1f} GB (its load measured {overhead:.1f} GB above that at {a.verifier_layers} layer(s))")
        if base:
            line += f": >= {est / base['peak_rss_gb']:.1f}x the replay's whole peak"
        print(line)


if __name__ == "__main__":
    main()
