"""Where the time of one speculative step goes, against one greedy step (issue 12, "cheaper verification").

One greedy step is a one-token verifier pass with its lm_head row. One speculative step (K = 4, the
drafts are the verifier's own greedy continuation, so every draft is accepted) is: the drafter
pass, the proposal, the verifier body over K+1 tokens, the lm_head rows and acceptance, and the
cache cut-back. Both are timed step by step in interleaved rounds (medians), with the lm_head as
``speculative_generate`` computes it now (all K+1 rows in one product) and as it did before issue 12
(one ``lm_head`` call per row, up to the first rejection: here all 5 rows). The break-even
acceptance length is the median speculative step over the median greedy step: a drafter must
reach that AL for speculative decoding to match greedy decoding.

    OMP_NUM_THREADS=1 python bench/profile_speculative_step.py --drafter /tmp/demo/d2/final
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_speculative import RowByRowLogits  # noqa: E402  (bench/ is on sys.path when run as a script)

import peagle_train.generate.speculative as spec
import peagle_train.generate.verifier as verifier_mod  # its verifier passes call lm_head_logits: patched here
from peagle_train.evaluate.prompts import read_prompts, render_turn
from peagle_train.generate.verifier import (aux_hidden_states, crop_cache, new_cache, rollback_cache,
                                            verifier_body_pass, verifier_pass)
from peagle_train.model.checkpoint import load_drafter
from runtime.model_cache import load_tokenizer, load_verifier


def greedy_steps(verifier, ids, n, times):
    """``n`` one-token verifier passes after a prefill of ``ids``."""
    cache = new_cache(verifier)
    logits, _ = verifier_pass(verifier, ids, cache, want_hidden=False, last_only=True)
    last = int(logits[-1].argmax())
    for _ in range(n):
        t0 = time.perf_counter()
        logits, _ = verifier_pass(verifier, torch.tensor([last]), cache, want_hidden=False)
        last = int(logits[-1].argmax())
        times.setdefault("greedy_step", []).append(time.perf_counter() - t0)


def spec_steps(verifier, drafter, ids, full, n, K, times, prefix):
    """``n`` speculative steps whose drafts are ``full``'s tokens (all accepted), timed per part."""
    layers = drafter.config.aux_layer_ids
    with aux_hidden_states(verifier) as last:  # layer L = the last decoder layer's output before the norm
        _spec_steps(verifier, drafter, ids, full, n, K, times, prefix, layers, last)


def _spec_steps(verifier, drafter, ids, full, n, K, times, prefix, layers, last):
    cache, session = rollback_cache(verifier), spec.DrafterSession(drafter)
    logits, hs = verifier_pass(verifier, ids, cache, want_hidden=True, last_only=True)
    toks, read = [int(logits[-1].argmax())], ids.numel()
    new_tokens, new_aux = torch.cat([ids[1:], torch.tensor(toks)]), spec.aux_features(hs, last, layers)
    vocab = verifier.config.get_text_config().vocab_size
    for _ in range(n):
        marks = [time.perf_counter()]
        draft_logits = session.draft(new_tokens, new_aux, K)
        marks.append(time.perf_counter())
        spec.propose_drafts(draft_logits, drafter.draft_ids, vocab, 0.0, None)
        drafts = torch.tensor(full[read + 1:read + 1 + K], dtype=torch.long)
        marks.append(time.perf_counter())
        logits, hs = verifier_body_pass(verifier, torch.cat([torch.tensor(toks[-1:]), drafts]), cache)
        marks.append(time.perf_counter())
        accepted, emitted = spec.accept_drafts(drafts, logits, 0.0, None, None)
        marks.append(time.perf_counter())
        read += accepted + 1
        crop_cache(cache, read)
        new_tokens, new_aux = emitted, spec.aux_features(hs, last, layers)[:accepted + 1]
        toks.extend(emitted.tolist())
        marks.append(time.perf_counter())
        for name, a, b in zip(("drafter", "propose", "verifier_body", "lm_head_and_accept", "cut_back"),
                              marks, marks[1:]):
            times.setdefault(f"{prefix}{name}", []).append(b - a)
        times.setdefault(f"{prefix}step", []).append(marks[-1] - marks[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="examples/prompts.jsonl")
    ap.add_argument("--steps", type=int, default=12, help="speculative steps per round (5 tokens each)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    verifier = load_verifier(args.verifier, dtype=torch.float32)
    drafter = load_drafter(args.drafter).eval().float()
    tok = load_tokenizer(args.verifier)
    K = 4
    ids = torch.tensor(render_turn(tok, read_prompts(args.prompts, 1)[0], 0, []))
    full = ids.tolist() + spec.plain_generate(verifier, ids, (K + 1) * args.steps + K + 2).tokens
    times: dict[str, list[float]] = {}
    orig = verifier_mod.lm_head_logits
    with torch.no_grad():
        for _ in range(args.rounds):
            greedy_steps(verifier, ids, args.steps, times)
            spec_steps(verifier, drafter, ids, full, args.steps, K, times, "after_")
            verifier_mod.lm_head_logits = RowByRowLogits
            try:
                spec_steps(verifier, drafter, ids, full, args.steps, K, times, "before_")
            finally:
                verifier_mod.lm_head_logits = orig
    ms = {name: round(statistics.median(v) * 1e3, 2) for name, v in times.items()}
    report = {"median_ms": ms, "K": K, "prompt_tokens": ids.numel(),
              "break_even_acceptance_length_after": round(ms["after_step"] / ms["greedy_step"], 3),
              "break_even_acceptance_length_before": round(ms["before_step"] / ms["greedy_step"], 3)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
