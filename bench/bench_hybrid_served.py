"""Features as served, for hybrid verifiers: the store's features against what the verifier computes when it serves.

Extraction runs each conversation in one forward (``peagle_data.extract.hf_forward.verifier_features``: a hybrid's
gated DeltaNet / Mamba-2 layers in their chunked form, their state from zero) and stores bf16. When the drafter is
served, the verifier computes the same tokens otherwise: the prompt in prefill chunks of ``--chunk`` tokens, each
chunk starting from the recurrent and convolution state the previous one left (chunked prefill), and every token
after the prompt in a decode step of one token (the recurrent form of the layer). This is the hybrid counterpart
of ``bench/bench_window_context.py`` (the serving-context check of attention models: there the context differs,
here the algorithm computing the same context).

Positions compared: as ``bench_window_context.py``, one per supervised token ``x_t`` (``loss_mask[t] = 1``,
``t >= 1``), at position ``t - 1`` (the soft target ``softmax(z_{t-1})`` and the features that feed it):

- ``argmax_differs``: share of supervised tokens whose argmax of ``lm_head(final)`` differs between the store's
  final state (bf16, as stored) and the served one (the goal: at most 1%);
- ``argmax_differs_f32``: the same with the store's forward kept in float32 (the algorithms alone, no rounding);
- ``cos_min[l]``: the smallest cosine similarity of the stored aux layer ``l`` (bf16) and the served one, per
  layer (the store's ``vllm_aux`` convention: id ``L`` is the last decoder layer's output before the final norm);
- ``max_abs``: the largest absolute difference of any stored feature (float32 forward) and the served one.

Verifiers: the tiny random hybrid families of ``tests/families.py`` (no hybrid checkpoint is reachable here),
float32 on CPU with transformers' PyTorch forms of the kernels; conversations are random tokens with supervised
turns. A real checkpoint in bf16 on a GPU (its CUDA kernels) is not measured by this script.

Usage (from the repository root, inside .venv):
    python bench/bench_hybrid_served.py --conversations 8 --prompt-len 48 --chunk 16
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_data.extract.hf_forward import language_model, verifier_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from families import HYBRID, build_family  # noqa: E402


def capture(decoder, layers: list[int], store: dict[int, list[torch.Tensor]]):
    """Forward hooks appending aux layer ``l``'s ``[T, H]`` of every forward to ``store[l]`` (0: the first decoder
    layer's input; ``l >= 1``: decoder layer ``l - 1``'s output). Returns the hook handles."""
    def keep(l):
        def hook(module, args, kwargs, out=None):
            h = (args[0] if args else kwargs["hidden_states"]) if l == 0 else (out[0] if isinstance(out, tuple) else out)
            store.setdefault(l, []).append(h[0].detach().float())
        return hook
    handles = []
    for l in layers:
        if l == 0:
            handles.append(decoder.layers[0].register_forward_pre_hook(keep(0), with_kwargs=True))
        else:
            handles.append(decoder.layers[l - 1].register_forward_hook(
                lambda m, a, kw, o, f=keep(l): f(m, a, kw, o), with_kwargs=True))
    return handles


@torch.no_grad()
def served_states(model, input_ids: torch.Tensor, layers: list[int], prompt_len: int,
                  chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The verifier as it serves ``input_ids [T]``: prefill chunks of ``chunk`` tokens up to ``prompt_len``, then
    one decode step per token, the cache carrying every layer's state. Returns ``aux [T, L, H]`` and ``final
    [T, H]`` (float32)."""
    decoder = language_model(model)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    T = int(input_ids.numel())
    bounds = [(lo, min(lo + chunk, prompt_len)) for lo in range(0, prompt_len, chunk)]
    bounds += [(t, t + 1) for t in range(prompt_len, T)]
    got: dict[int, list[torch.Tensor]] = {}
    finals, cache = [], None
    handles = capture(decoder, layers, got)
    try:
        for lo, hi in bounds:
            extra = {} if cache is None else {kw: cache}
            out = decoder(input_ids=input_ids[None, lo:hi], use_cache=True, cache_position=torch.arange(lo, hi),
                          position_ids=torch.arange(lo, hi)[None], **extra)
            cache = out.past_key_values
            finals.append(out.last_hidden_state[0].float())
    finally:
        for h in handles:
            h.remove()
    return torch.stack([torch.cat(got[l]) for l in layers], dim=1), torch.cat(finals)


def supervised_positions(loss_mask: np.ndarray) -> np.ndarray:
    """Positions ``t - 1`` of the supervised tokens ``t >= 1``."""
    return np.flatnonzero(loss_mask[1:]) if len(loss_mask) > 1 else np.zeros(0, np.int64)


def compare(model, input_ids: torch.Tensor, loss_mask: np.ndarray, layers: list[int], prompt_len: int,
            chunk: int) -> dict[str, Any]:
    """One conversation: the figures of the module doc over its supervised tokens (counts, not shares)."""
    decoder = language_model(model)
    T = int(input_ids.numel())
    cu = torch.tensor([0, T])
    aux16, final16 = verifier_features(decoder, input_ids, torch.arange(T), cu, layers)
    with torch.no_grad():  # the store's forward in float32 (no rounding)
        got: dict[int, list[torch.Tensor]] = {}
        handles = capture(decoder, layers, got)
        try:
            final32 = decoder(input_ids=input_ids[None], use_cache=False).last_hidden_state[0].float()
        finally:
            for h in handles:
                h.remove()
        aux32 = torch.stack([got[l][0] for l in layers], dim=1)
    aux_s, final_s = served_states(model, input_ids, layers, prompt_len, chunk)
    pos = torch.from_numpy(supervised_positions(loss_mask))
    head = model.get_output_embeddings()
    with torch.no_grad():
        served = head(final_s[pos]).argmax(-1)
        stored = head(final16[pos].float()).argmax(-1)
        stored32 = head(final32[pos]).argmax(-1)
    cos = torch.nn.functional.cosine_similarity(aux16[pos].float(), aux_s[pos], dim=-1)  # [n, L]
    return {"supervised": int(len(pos)), "argmax_differs": int((served != stored).sum()),
            "argmax_differs_f32": int((served != stored32).sum()),
            "cos_min": cos.min(dim=0).values.tolist() if len(pos) else [1.0] * len(layers),
            "max_abs": max(float((aux32 - aux_s).abs().max()), float((final32 - final_s).abs().max()))}


def conversations(n: int, vocab: int, seed: int, lo: int, hi: int):
    """``n`` random conversations of ``lo..hi`` tokens: ids in ``3..vocab-3``, every other turn of 8-24 tokens
    supervised (``loss_mask`` 1), the first turn not."""
    g = np.random.default_rng(seed)
    for _ in range(n):
        T = int(g.integers(lo, hi + 1))
        mask = np.zeros(T, np.uint8)
        t, on = 0, False
        while t < T:
            n_turn = int(g.integers(8, 25))
            mask[t:t + n_turn] = on
            t, on = t + n_turn, not on
        yield torch.from_numpy(g.integers(3, vocab - 3, T)), mask


def run(family: str, n: int, prompt_len: int, chunk: int, lo: int, hi: int, seed: int) -> dict[str, Any]:
    """The figures of one family over ``n`` conversations (each's first ``prompt_len`` tokens the prompt)."""
    model = build_family(family)
    L = len(language_model(model).layers)
    layers = list(range(L + 1))
    total = {"supervised": 0, "argmax_differs": 0, "argmax_differs_f32": 0, "cos_min": [1.0] * len(layers),
             "max_abs": 0.0}
    for ids, mask in conversations(n, model.config.get_text_config().vocab_size, seed, lo, hi):
        c = compare(model, ids, mask, layers, prompt_len, chunk)
        for k in ("supervised", "argmax_differs", "argmax_differs_f32"):
            total[k] += c[k]
        total["cos_min"] = [min(a, b) for a, b in zip(total["cos_min"], c["cos_min"])]
        total["max_abs"] = max(total["max_abs"], c["max_abs"])
    s = max(total["supervised"], 1)
    return {**total, "argmax_differs_pct": round(100 * total["argmax_differs"] / s, 3),
            "argmax_differs_f32_pct": round(100 * total["argmax_differs_f32"] / s, 3),
            "cos_min": [round(x, 6) for x in total["cos_min"]], "layers": layers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(HYBRID))
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48, help="tokens prefilled; the rest are decode steps")
    ap.add_argument("--chunk", type=int, default=16, help="prefill chunk (vLLM's chunked prefill)")
    ap.add_argument("--min-len", type=int, default=96)
    ap.add_argument("--max-len", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = {f: run(f, args.conversations, args.prompt_len, args.chunk, args.min_len, args.max_len, args.seed)
           for f in args.families.split(",")}
    print(json.dumps({"config": vars(args), "families": out, "load_average": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
