"""How far a (K+1)-token verification pass moves the verifier's top-2 logit margin from one-token decoding.

The near-tie rule of ``peagle_train/generate/identity.py`` accepts a greedy divergence only where the
reference's top-2 margin is within ``TIE_ULPS`` units in the last place (ulp) of the dtype at the top
logit. This measures, per dtype, on every generated position of the prompts' first turns: the plain
greedy decoding (prefill, then one token per pass) and the same tokens read in blocks of K+1 after a
prefill of the prompt but its last token (as speculative decoding's verification passes read them);
the change of ``z1 - z2`` (at the decode pass's top-2 tokens) between the two, in ulps of the dtype at
``|z1|``. A position whose margin is below that change can have its argmax swapped by the numerics.

    python bench/bench_bf16_margins.py --verifier smollm2-135m --num-prompts 8 --max-new-tokens 64 --K 3
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from peagle_train.generate.identity import logit_ulp
from peagle_train.evaluate.prompts import read_prompts, render_turn
from peagle_train.generate.verifier import new_cache, rollback_cache, verifier_pass
from runtime.model_cache import load_tokenizer, load_verifier


@torch.no_grad()
def margin_shifts(verifier, ids: list[int], n: int, K: int, dtype: torch.dtype) -> list[dict]:
    """Per position of ``n`` greedy tokens after ``ids``: decode margin, block margin, shift in ulps."""
    cache = new_cache(verifier)
    logits, _ = verifier_pass(verifier, torch.tensor(ids), cache, want_hidden=False, last_only=True)
    rows, tokens = [logits[-1]], []
    for _ in range(n):
        tokens.append(int(rows[-1].argmax()))
        logits, _ = verifier_pass(verifier, torch.tensor(tokens[-1:]), cache, want_hidden=False)
        rows.append(logits[-1])
    block = rollback_cache(verifier)
    verifier_pass(verifier, torch.tensor(ids[:-1]), block, want_hidden=False)
    seq = ids[-1:] + tokens  # the block rows predict tokens[i]
    block_rows = []
    for s in range(0, n, K + 1):
        out, _ = verifier_pass(verifier, torch.tensor(seq[s:s + K + 1]), block, want_hidden=False)
        block_rows += list(out)
    out = []
    for i in range(n):
        a, b = rows[i], block_rows[i]
        top = torch.topk(a, 2).indices
        m_dec, m_blk = float(a[top[0]] - a[top[1]]), float(b[top[0]] - b[top[1]])
        ulp = logit_ulp(float(a[top[0]]), dtype)
        out.append({"margin_ulps": m_dec / ulp, "shift_ulps": abs(m_blk - m_dec) / ulp,
                    "argmax_swapped": int(b.argmax()) != int(top[0])})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="examples/prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args()
    tok = load_tokenizer(args.verifier)
    prompts = read_prompts(args.prompts, args.num_prompts)
    report = {}
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        verifier = load_verifier(args.verifier, dtype=dtype, device="cpu")
        rows = []
        for p in prompts:
            rows += margin_shifts(verifier, render_turn(tok, p, 0, []), args.max_new_tokens, args.K, dtype)
            print(f"{name} prompt {p.prompt_id}: max shift so far {max(r['shift_ulps'] for r in rows):g} ulps over "
                  f"{len(rows)} positions; swaps at margins (ulps) "
                  f"{[round(r['margin_ulps'], 2) for r in rows if r['argmax_swapped']]}", file=sys.stderr, flush=True)
        shifts = sorted(r["shift_ulps"] for r in rows)
        report[name] = {"positions": len(rows), "max_shift_ulps": shifts[-1],
                        "p99_shift_ulps": shifts[int(0.99 * (len(shifts) - 1))],
                        "median_shift_ulps": shifts[len(shifts) // 2],
                        "argmax_swaps": sum(r["argmax_swapped"] for r in rows),
                        "swap_margins_ulps": [r["margin_ulps"] for r in rows if r["argmax_swapped"]],
                        "margins_below_4_ulps": sum(r["margin_ulps"] <= 4 for r in rows)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
