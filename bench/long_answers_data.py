"""Conversations with long reasoning answers for the issue-32 cost bench (bench/bench_long_answers.sh).

Writes ``--rows`` OpenAI-messages rows: a short user question, then one assistant answer of about
``--answer-tokens`` SmolLM2 tokens: a ``<think>`` block (90% of it) and a final answer, written as the
content text (SmolLM2's template renders no ``reasoning_content``; the cost is that of the tokens). The
text is seeded pseudo-English (words drawn from a fixed list), so its token count is stable.

Usage: python bench/long_answers_data.py OUT.jsonl --rows 8 --answer-tokens 8192 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random

WORDS = ("the", "answer", "so", "we", "need", "to", "check", "whether", "this", "holds", "for", "every", "case",
         "first", "consider", "n", "equals", "two", "then", "three", "which", "gives", "a", "sum", "of", "terms",
         "wait", "let", "me", "recompute", "that", "step", "because", "product", "is", "even", "odd", "therefore",
         "and", "hence", "result", "follows", "from", "lemma", "above", "with", "value", "x", "y", "plus", "minus")


def text(rng: random.Random, tokenizer, n_tokens: int) -> str:
    """Pseudo-English of about ``n_tokens`` tokens (sentences of 8-20 words)."""
    out, n = [], 0
    while n < n_tokens:
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
        out.append(sentence)
        n += len(tokenizer(" " + sentence, add_special_tokens=False)["input_ids"])
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from runtime.model_cache import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m", need_weights=False))
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for i in range(args.rows):
            think = text(rng, tok, int(args.answer_tokens * 0.9))
            final = text(rng, tok, args.answer_tokens - int(args.answer_tokens * 0.9))
            row = {"id": f"long{i}", "messages": [
                {"role": "user", "content": f"Problem {i}: show that the sum of the first n odd numbers is n squared."},
                {"role": "assistant", "content": f"<think>\n{think}\n</think>\n\n{final}"}]}
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
