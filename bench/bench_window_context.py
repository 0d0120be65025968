"""Window context vs full context (issue 21, first step): how far the features and targets peagle
extracts for a window are from what the verifier computes at the same token when it serves.

``peagle-data pack`` cuts a conversation longer than ``--max-seq-len`` into windows (overlap 0.5, the
default ``skip`` overlap loss rule, the verifier's default system prompt prepended to every window:
:func:`peagle_data.prepare.windows.make_windows` on the rows of
:func:`peagle_data.prepare.tokenizing.iter_tokenized`), and extraction runs each window alone, positions
from 0. When the drafter is served, the verifier has read the whole conversation before each token.
This script runs the verifier (SmolLM2-135M, float32, transformers, SDPA) once on every window alone
and once on the whole conversation (one forward, positions from 0), and compares the two at the
positions that feed a supervised token.

Positions compared (docs/design.md §4): a supervised token ``x_t`` of a window (``loss_mask[t] = 1``,
``t >= 1``) is predicted with the soft target ``softmax(z_{t-1})``, the verifier's next-token
distribution at position ``t - 1``, computed from the final (normed) state there. Every figure is
taken there, one per supervised token: window position ``t - 1`` against conversation position
``c(t) - 1``, where ``c`` maps a window position to its place in the conversation (the system prefix
``0..P-1`` to itself, body token ``j >= P`` to ``j + body_start``, ``body_start`` counted from the
body's start). The two are the same token except for the first body token of a later window (``t =
P``), whose window predecessor is the prefix's last token. Windows are counted as FIRST (window index 0: its context is already the start of the
conversation, so both forwards should agree up to float noise; the control) or LATER (every other).

Figures, per group (first / later), over all its supervised tokens:

- ``argmax_differs``: share of supervised tokens whose argmax of ``lm_head(final)`` differs between
  the window forward and the full forward (both float32).
- ``argmax_differs_bf16``: the same with the window's final state rounded to bfloat16 first (the
  value the store holds; the full forward stays float32): in first windows this is the rounding floor.
- ``kl``: mean over supervised tokens of KL(full ‖ window) = ``Σ_v p_full(v) (log p_full(v) - log
  p_window(v))`` over the whole vocabulary, in nats (computed in float64 from float32 logits).
- ``cos[l]``: cosine similarity of the float32 hidden states (window vs full), mean and minimum over
  supervised tokens, at the aux layers extraction stores by default for the verifier
  (:func:`peagle_data.extract.hf_forward.default_layers`: ``[2, 15, 27]`` for SmolLM2's 30 layers;
  the store's ``vllm_aux`` convention: aux id ``l < L`` is Hugging Face's ``hidden_states[l]``, id ``L``
  the last decoder layer's output before the final norm) and ``final`` (after the final norm).

Conversations: ShareGPT (the ``sharegpt`` alias) tokenized by peagle with the default settings,
each kept with probability ``SAMPLE_RATE`` drawn from ``--seed`` in input order; the first
``--conversations`` rows longer than a ``--max-seq-len`` are that length's sample (a row longer than
both lengths serves both; its full forward runs once). Rows longer than the verifier's
``max_position_embeddings`` cannot be run whole and are skipped and counted. Windows are the
untrimmed ones ``make_windows`` returns: ``pack`` may later trim leading loss-0 context off the last
window of a conversation to fill a block (``trim_window``), which only shortens that window's context.

Usage (from the repository root, inside .venv; a few minutes on one core):
    OMP_NUM_THREADS=1 python bench/bench_window_context.py --max-seq-len 1024,2048 --conversations 8 \\
        --json /tmp/window_context.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from peagle_data.extract.hf_forward import default_layers, language_model
from peagle_data.prepare.config import PackConfig, TokenizeConfig
from peagle_data.prepare.counts import Counts
from peagle_data.prepare.tokenizing import iter_tokenized
from peagle_data.prepare.windows import Window, make_windows
from runtime.model_cache import load_tokenizer, load_verifier
from stores.tables.token_tables import RejectsWriter

SAMPLE_RATE = 0.25
"""Chance that a ShareGPT conversation (in input order) is tokenized and considered (``--seed``)."""

UNSUPPORTED_LOGIT_OPTIONS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields that change logits after ``lm_head``: this script computes ``lm_head(final)`` only."""


@dataclass(frozen=True)
class States:
    """One forward's float32 states.

    Attributes:
        aux: float32 ``[T, len(layers), H]`` at the aux ids of ``layers`` (``vllm_aux`` convention).
        final: float32 ``[T, H]`` after the final norm.
    """

    aux: torch.Tensor
    final: torch.Tensor


@dataclass(frozen=True)
class WindowComparison:
    """Window forward vs full forward at the positions that feed one window's supervised tokens.

    Attributes (``n`` = the window's supervised tokens ``t >= 1``):
        positions: int64 ``[n]``, conversation positions ``c(t) - 1`` compared with window positions
            ``t - 1`` (module docstring).
        argmax_differs: bool ``[n]``, float32 argmax of ``lm_head(final)`` window != full.
        argmax_differs_bf16: bool ``[n]``, the same with the window's final rounded to bfloat16.
        kl: float64 ``[n]``, KL(full ‖ window) of the next-token distributions, nats.
        cosine: float32 ``[n, len(layers) + 1]``, window vs full, the aux layers then the final state.
    """

    positions: np.ndarray
    argmax_differs: np.ndarray
    argmax_differs_bf16: np.ndarray
    kl: np.ndarray
    cosine: np.ndarray


def check_logits_plain(config) -> None:
    """Raises ValueError when the verifier's logits are not ``lm_head(final)`` alone (soft-capping, scaling)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in UNSUPPORTED_LOGIT_OPTIONS:
        if getattr(text, name, None) not in (None, 1.0):
            raise ValueError(f"verifier config sets {name}={getattr(text, name)}: this benchmark computes the "
                             "next-token distribution as lm_head(final) only; it does not support that model")


@torch.no_grad()
def verifier_states(verifier, input_ids: np.ndarray, layers: list[int]) -> States:
    """One forward of ``input_ids`` (int ``[T]``, positions ``0..T-1``, no cache) in the verifier's dtype.

    Aux id ``l < L`` is ``hidden_states[l]``; id ``L`` (= ``num_hidden_layers``) is the input of the
    final norm (the last layer's output before it), as the store holds it (docs/design.md §7).

    Raises:
        ValueError: a layer id outside ``0..L``.
    """
    decoder = language_model(verifier)
    n_layers = len(decoder.layers)
    if any(not 0 <= l <= n_layers for l in layers):
        raise ValueError(f"layers {layers} outside 0..{n_layers}")
    captured = {}
    hook = decoder.norm.register_forward_pre_hook(lambda m, args: captured.__setitem__("pre_norm", args[0]))
    try:
        ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64))[None]
        out = decoder(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False,
                      output_hidden_states=True)
    finally:
        hook.remove()
    aux = torch.stack([captured["pre_norm"][0] if l == n_layers else out.hidden_states[l][0] for l in layers], 1)
    return States(aux=aux.float(), final=out.last_hidden_state[0].float())


def window_conversation_positions(window: Window, system_len: int) -> np.ndarray:
    """int64 ``[n]``: the conversation position of each token of ``window`` (prefix, then body piece)."""
    n, p = window.n_tokens, window.prefix_len
    if p == 0:  # the whole conversation, or a piece without a system prefix
        return np.arange(n, dtype=np.int64) + (system_len + window.body_start if window.index > 0 else 0)
    return np.r_[np.arange(p), system_len + window.body_start + np.arange(n - p)].astype(np.int64)


def target_positions(loss_mask: np.ndarray) -> np.ndarray:
    """int64: window positions ``t - 1`` of the supervised tokens ``t >= 1`` (``loss_mask[t] = 1``)."""
    t = np.flatnonzero(np.asarray(loss_mask)[1:]) + 1
    return (t - 1).astype(np.int64)


def _log_probs(lm_head, final: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(lm_head(final).double(), dim=-1)


@torch.no_grad()
def compare_window(verifier, conv_ids: np.ndarray, full: States, window: Window, system_len: int,
                   layers: list[int], chunk: int = 256) -> WindowComparison:
    """Run ``window`` alone through the verifier and compare it with the full forward ``full``.

    Args:
        verifier: the causal LM (its decoder stack and ``lm_head``); its logits must be ``lm_head(final)``.
        conv_ids: int ``[T]``, the conversation ``full`` was computed on (positions ``0..T-1``).
        full: :func:`verifier_states` of ``conv_ids`` at ``layers``.
        window: one window of that conversation (:func:`peagle_data.prepare.windows.make_windows`).
        system_len: the conversation's system prefix length (the row's ``system_len``).
        layers: aux ids, as for ``full``.
        chunk: positions per lm_head call (bounds the ``[chunk, vocab]`` float64 logits).

    Raises:
        ValueError: the window's tokens are not the conversation's at the mapped positions, or the
            verifier's logits are not ``lm_head(final)`` (:func:`check_logits_plain`).
    """
    check_logits_plain(verifier.config)
    conv_pos = window_conversation_positions(window, system_len)
    if conv_pos[-1] >= len(conv_ids) or not np.array_equal(np.asarray(conv_ids)[conv_pos], window.input_ids):
        raise ValueError(f"window {window.index} (body_start {window.body_start}) does not match its conversation "
                         "at the mapped positions")
    local = target_positions(window.loss_mask)
    at = conv_pos[local + 1] - 1  # serving predicts x_t from the conversation token before it
    win = verifier_states(verifier, window.input_ids, layers)
    lm_head = verifier.get_output_embeddings()
    w_final, f_final = win.final[local], full.final[at]
    differs, differs_bf16, kl = [], [], []
    for lo in range(0, len(local), chunk):
        hi = lo + chunk
        lp_full = _log_probs(lm_head, f_final[lo:hi])
        lp_win = _log_probs(lm_head, w_final[lo:hi])
        lp_bf16 = lm_head(w_final[lo:hi].to(torch.bfloat16).float())
        top = lp_full.argmax(-1)
        differs.append((lp_win.argmax(-1) != top).numpy())
        differs_bf16.append((lp_bf16.argmax(-1) != top).numpy())
        kl.append((lp_full.exp() * (lp_full - lp_win)).sum(-1).numpy())
    w_all = torch.cat([win.aux[local], w_final[:, None]], 1)  # [n, L+1, H]
    f_all = torch.cat([full.aux[at], f_final[:, None]], 1)
    cosine = torch.nn.functional.cosine_similarity(w_all, f_all, dim=-1).numpy()
    empty = np.zeros(0)
    return WindowComparison(positions=at, argmax_differs=np.concatenate(differs or [empty]).astype(bool),
                            argmax_differs_bf16=np.concatenate(differs_bf16 or [empty]).astype(bool),
                            kl=np.concatenate(kl or [empty]).astype(np.float64), cosine=cosine)


@dataclass
class Group:
    """The comparisons of one group of windows (first or later) at one max_seq_len, concatenated."""

    windows: int = 0
    parts: list[WindowComparison] = field(default_factory=list)

    def add(self, c: WindowComparison) -> None:
        self.windows += 1
        self.parts.append(c)

    def summary(self, names: list[str]) -> dict:
        """``{"windows", "tokens", "argmax_differs", "argmax_differs_bf16", "kl_mean", "cos_mean", "cos_min"}``."""
        if not self.parts or not sum(len(p.kl) for p in self.parts):
            return {"windows": self.windows, "tokens": 0}
        cat = lambda a: np.concatenate([getattr(p, a) for p in self.parts])  # noqa: E731
        cos = cat("cosine")
        return {"windows": self.windows, "tokens": int(len(cat("kl"))),
                "argmax_differs": float(cat("argmax_differs").mean()),
                "argmax_differs_bf16": float(cat("argmax_differs_bf16").mean()),
                "kl_mean": float(cat("kl").mean()),
                "cos_mean": dict(zip(names, map(float, cos.mean(0)))),
                "cos_min": dict(zip(names, map(float, cos.min(0))))}


def long_rows(lengths: list[int], n: int, max_tokens: int, seed: int, tokenizer, skipped: dict[int, int]):
    """Yield ``(row, [the max_seq_len it serves])`` until every length has ``n`` rows longer than it.

    Rows come from :func:`iter_tokenized` (pack's tokenizing, default settings) on ``sharegpt``, each
    conversation kept with probability :data:`SAMPLE_RATE` (``seed``). ``skipped[w]`` counts the
    rows longer than ``w`` and ``max_tokens`` (not run).
    """
    rng = np.random.default_rng(seed)
    taken = {w: 0 for w in lengths}

    def sample(items):
        for item in items:
            if rng.random() < SAMPLE_RATE:
                yield item

    with tempfile.TemporaryDirectory() as tmp, RejectsWriter(tmp) as rejects:
        for rows in iter_tokenized(["sharegpt"], tokenizer, TokenizeConfig(), rejects, Counts(), select=sample):
            for row in rows:
                serves = [w for w in lengths if row.n_tokens > w and taken[w] < n]
                if not serves:
                    continue
                if row.n_tokens > max_tokens:
                    for w in serves:
                        skipped[w] += 1
                    continue
                for w in serves:
                    taken[w] += 1
                yield row, serves
            if all(taken[w] >= n for w in lengths):
                return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-seq-len", action="append", default=None,
                    help="window length(s) in tokens, repeatable or comma-separated (default 1024,2048)")
    ap.add_argument("--conversations", type=int, default=8, help="long conversations per max_seq_len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args(argv)
    lengths = sorted({int(x) for v in (args.max_seq_len or ["1024,2048"]) for x in str(v).split(",") if x})
    pack = PackConfig()  # pack's defaults: overlap 0.5, skip
    tokenizer = load_tokenizer(args.verifier)
    verifier = load_verifier(args.verifier, dtype=torch.float32)
    check_logits_plain(verifier.config)
    text_cfg = verifier.config.get_text_config()
    layers = default_layers(text_cfg.num_hidden_layers)
    names = [str(l) for l in layers] + ["final"]
    max_tokens = int(text_cfg.max_position_embeddings)
    groups = {w: {"first": Group(), "later": Group()} for w in lengths}
    n_rows = {w: 0 for w in lengths}
    skipped = {w: 0 for w in lengths}
    t0 = time.perf_counter()
    for row, serves in long_rows(lengths, args.conversations, max_tokens, args.seed, tokenizer, skipped):
        full = verifier_states(verifier, row.input_ids, layers)
        for w in serves:
            n_rows[w] += 1
            for window in make_windows(row.input_ids, row.loss_mask, int(row.system_len), w, pack.overlap,
                                       pack.overlap_loss):
                c = compare_window(verifier, row.input_ids, full, window, int(row.system_len), layers)
                groups[w]["first" if window.index == 0 else "later"].add(c)
        print(f"[{time.perf_counter() - t0:6.0f} s] {row.conversation_id}: {row.n_tokens} tokens, "
              f"max_seq_len {serves}", file=sys.stderr, flush=True)
    result = {"verifier": args.verifier, "layers": layers, "seed": args.seed, "overlap": pack.overlap,
              "overlap_loss": pack.overlap_loss, "seconds": round(time.perf_counter() - t0, 1), "by_max_seq_len": {}}
    print(f"| max_seq_len | conversations (skipped: > {max_tokens} tokens) | later windows | supervised tokens | "
          "argmax differs | argmax differs (bf16) | mean KL (nats) | " +
          " | ".join(f"cos {n} mean / min" for n in names) +
          " | first windows: tokens, argmax differs, (bf16), mean KL, min cos final |")
    print("|" + "---|" * (8 + len(names)))
    for w in lengths:
        entry = {"conversations": n_rows[w], "skipped_too_long": skipped[w],
                 **{g: groups[w][g].summary(names) for g in ("later", "first")}}
        result["by_max_seq_len"][str(w)] = entry
        s, f = entry["later"], entry["first"]
        later = (f"{s['tokens']:,} | {100 * s['argmax_differs']:.2f}% | {100 * s['argmax_differs_bf16']:.2f}% | "
                 f"{s['kl_mean']:.4f} | " + " | ".join(f"{s['cos_mean'][n]:.4f} / {s['cos_min'][n]:.3f}" for n in names)
                 if s["tokens"] else "0 |" + " - |" * (3 + len(names)))
        first = (f"{f['tokens']:,}, {100 * f['argmax_differs']:.2f}%, ({100 * f['argmax_differs_bf16']:.2f}%), "
                 f"{f['kl_mean']:.2g}, {f['cos_min']['final']:.6f}" if f["tokens"] else "-")
        print(f"| {w} | {n_rows[w]} ({skipped[w]}) | {s['windows']} | {later} | {first} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
