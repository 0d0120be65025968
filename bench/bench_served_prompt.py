"""The served-prompt check of tokenize (``served_prompt_mismatch``): its cost, and its tail form against the
whole generation prompts.

On the first ``--limit`` usable ShareGPT conversations, rendered once (``render_rows``), in chunks of
``CHUNK_CONVERSATIONS`` as ``peagle-data tokenize`` does, best of ``--repeat``:

1. **tokenize_rendered**: the batched encode with offsets, the masks and all four checks (the served
   prompt's tails, after each prompt's last added token, tokenized in one more batched call);
2. **whole prompts**: every ``P_i`` tokenized whole in one batched call per chunk (the check's plain form,
   which would add this time to 1).

Then, per supervised turn, the verdict of the tail form (the row built as served, ``served_pieces``, or its reject
reason) against the whole ``P_i`` tokenized alone and compared with the row's tokens before the turn:
``disagreements`` must be 0.

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_served_prompt.py --limit 300
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from bench.bench_prepare import load_conversations
from peagle_data.chat.render import render_rows
from peagle_data.chat.tokens import tokenize_rendered
from peagle_data.prepare.config import CHUNK_CONVERSATIONS
from runtime.chat.chat_template import ChatTemplateError
from runtime.model_cache import load_tokenizer

REASON = "the prompt's last tokens change when the reply follows"


def rendered(tok, conv) -> list:
    """The conversation's rendered rows, none for a render reject (counted by tokenize, not timed here)."""
    try:
        return render_rows(tok, conv.messages, conv.tools)
    except ChatTemplateError:
        return []


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=300, help="usable ShareGPT conversations")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    convs = load_conversations(args.limit)
    chunks = [[r for c in convs[k:k + CHUNK_CONVERSATIONS] for r in rendered(tok, c)]
              for k in range(0, len(convs), CHUNK_CONVERSATIONS)]
    tok(["warm up"], add_special_tokens=False)
    outs = [tokenize_rendered(tok, rows) for rows in chunks]

    t_rendered = best(lambda: [tokenize_rendered(tok, rows) for rows in chunks], args.repeat)
    t_whole = best(lambda: [tok([r.text[:a] for r in rows for a, _ in r.spans], add_special_tokens=False)
                            for rows in chunks], args.repeat)
    disagreements, turns, rejects, pieces = 0, 0, 0, 0
    for rows, out in zip(chunks, outs):
        enc = tok([r.text for r in rows], add_special_tokens=False, return_offsets_mapping=True)
        for row, tokenized, ids, offsets in zip(rows, out, enc["input_ids"], enc["offset_mapping"]):
            starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
            differs = False
            for a, _ in row.spans:
                lo = int(np.searchsorted(starts, a, side="left"))
                differs |= tok(row.text[:a], add_special_tokens=False)["input_ids"] != ids[:lo]
                turns += 1
            served = bool(tokenized.served_pieces)  # built as served: the prompt alone, then the reply
            rejected = bool(tokenized.problem) and tokenized.problem.startswith(REASON)
            rejects += rejected
            pieces += served
            disagreements += differs != (served or rejected) and not (tokenized.problem and not rejected)
    n_tokens = sum(len(t.input_ids) for out in outs for t in out)
    print(json.dumps({
        "conversations": len(convs), "rows": sum(map(len, chunks)), "supervised_turns": turns, "tokens": n_tokens,
        "prompt_chars_whole": sum(a for rows in chunks for r in rows for a, _ in r.spans),
        "text_chars": sum(len(r.text) for rows in chunks for r in rows),
        "seconds": {"tokenize_rendered_with_check": round(t_rendered, 3), "whole_prompts_call": round(t_whole, 3)},
        "whole_prompts_over_tokenize_rendered": round(t_whole / t_rendered, 3),
        "rejects_served_prompt": rejects, "rows_built_as_served": pieces, "disagreements": disagreements},
        indent=2))


if __name__ == "__main__":
    main()
