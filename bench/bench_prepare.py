"""Tokenization with loss masks: peagle against the tokenizer's limit and a naive baseline, one run.

On the same ShareGPT conversations (the first ``--limit`` usable ones) and the same tokenizer:

1. **peagle**: render every conversation, locate each assistant span by prefix renders, tokenize
   in batched calls of ``CHUNK_CONVERSATIONS`` with offsets and build the loss masks (what
   ``peagle-data tokenize`` does per chunk, one worker).
2. **limit**: the tokenizer's batched encode of the already rendered texts (rendering not timed,
   no offsets, no masks): no mask method can be faster.
3. **naive**: ``apply_chat_template(tokenize=True)`` per conversation plus, for every assistant
   turn, a re-render and re-tokenization of the prefix through that turn (the usual way masks
   are found without ``{% generation %}`` tags).

Every figure is tokens/s over the same token count (the peagle ids are checked against the
naive ones). Goal: peagle ≥ 50% of the limit and ≥ 3× naive.

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_prepare.py --limit 2000
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from peagle_data.chat.render import render_rows
from peagle_data.chat.tokens import tokenize_rendered
from peagle_data.prepare.config import CHUNK_CONVERSATIONS
from peagle_data.readers.conversations import read_conversations
from peagle_data.readers.rows import Conversation
from runtime.model_cache import load_tokenizer


def load_conversations(limit: int) -> list[Conversation]:
    items = (c for c in read_conversations(["sharegpt"]) if isinstance(c, Conversation))
    return list(itertools.islice(items, limit))


def run_peagle(tok, convs) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = []
    for k in range(0, len(convs), CHUNK_CONVERSATIONS):
        rows = [r for c in convs[k:k + CHUNK_CONVERSATIONS] for r in render_rows(tok, c.messages, c.tools)]
        out += tokenize_rendered(tok, rows)
    return time.perf_counter() - t0, out


def run_limit(tok, convs) -> tuple[float, int]:
    texts = [tok.apply_chat_template(c.messages, tokenize=False) for c in convs]
    t0 = time.perf_counter()
    enc = tok(texts, add_special_tokens=False)
    return time.perf_counter() - t0, sum(len(ids) for ids in enc["input_ids"])


def run_naive(tok, convs) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = []
    for c in convs:
        ids = tok.apply_chat_template(c.messages, tokenize=True, return_dict=False)
        mask = [0] * len(ids)
        for i, m in enumerate(c.messages):
            if m["role"] != "assistant":
                continue
            start = len(tok.apply_chat_template(c.messages[:i], tokenize=True, return_dict=False,
                                                add_generation_prompt=True)) if i else 0
            end = len(tok.apply_chat_template(c.messages[: i + 1], tokenize=True, return_dict=False))
            mask[start:end] = [1] * (end - start)
        out.append(ids)
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=2000, help="usable ShareGPT conversations")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    args = parser.parse_args()
    tok = load_tokenizer(args.tokenizer)
    convs = load_conversations(args.limit)
    tok(["warm up"], add_special_tokens=False)

    t_peagle, rows = run_peagle(tok, convs)
    n_tokens = sum(len(r.input_ids) for r in rows)
    t_limit, n_limit = run_limit(tok, convs)
    t_naive, naive_ids = run_naive(tok, convs)
    assert n_limit == n_tokens == sum(len(i) for i in naive_ids), (n_limit, n_tokens)
    assert all(r.input_ids.tolist() == list(i) for r, i in zip(rows, naive_ids)), "ids differ"
    result = {
        "conversations": len(convs), "tokens": n_tokens,
        "peagle_tokens_per_s": round(n_tokens / t_peagle),
        "limit_tokens_per_s": round(n_tokens / t_limit),
        "naive_tokens_per_s": round(n_tokens / t_naive),
        "peagle_over_limit": round(t_limit / t_peagle, 3),
        "peagle_over_naive": round(t_naive / t_peagle, 2),
        "seconds": {"peagle": round(t_peagle, 2), "limit": round(t_limit, 2), "naive": round(t_naive, 2)},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
