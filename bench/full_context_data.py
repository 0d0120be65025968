"""Data of the window-context / full-context drafter comparison (issue 21, "Does it pay?"):
long ShareGPT conversations split into a training set and held-out long-history prompts.

``bench/bench_full_context_al.sh`` runs this; two subcommands:

``select`` reads a ``peagle-data tokenize sharegpt`` output (for ``n_tokens`` and the ids of the
rows it used, duplicates already rejected) and the same ShareGPT rows again through
:func:`peagle_data.readers.conversations.read_conversations` (for their normalised messages), and
writes:

- ``--train-out``: JSONL ``{"id", "messages"}`` of ``--train-conversations`` conversations of more
  than ``--min-tokens`` and at most ``--max-tokens`` tokens (chat template applied, as tokenize
  counts them), for ``peagle-data pack``;
- ``--prompts-out``: JSONL ``{"id", "messages"}`` of ``--held-out-prompts`` held-out prompts for
  ``peagle-eval --prompts``: a held-out conversation cut just after a user turn, so that
  peagle-eval answers that turn (its last user message) with everything before it as history. The
  turn chosen is the last one whose history (the prompt tokens before that user turn, chat template
  and default system prompt included) is longer than ``--min-history`` tokens and whose whole prompt
  (with the generation prompt) plus ``--max-new-tokens`` fits in the verifier's
  ``max_position_embeddings``; a conversation with no such turn is skipped and counted;
- ``--held-out-out``: JSONL ``{"id", "messages"}`` of the same held-out conversations cut the same
  way but keeping the answer to the chosen turn (the offline held-out store's data).

Split: ShareGPT ids are ``BASE_k`` (piece k of one original conversation cut at about 2,048 Llama
tokens); a conversation is HELD-OUT when the first byte of ``sha256(BASE)`` is ``< 32`` (1/8 of the
bases), else TRAIN, so no piece of a held-out conversation is ever trained on. Within each side
conversations are taken in order of ``sha256(conversation_id)``, the first ones that qualify
(deterministic: no random state). At most one held-out prompt per BASE.

``check`` compares a tokenize output of ``--train-out`` with the ShareGPT tokenize output row by
row (every id of the JSONL there, same ``n_tokens`` and ``n_loss_tokens``): the JSONL round trip must
neither lose a conversation nor change its tokens; exits 1 naming the first difference.

Usage (from the repository root, inside .venv; about a minute):
    python bench/full_context_data.py select --tokenized TOK --tokenizer smollm2-135m \\
        --train-out train.jsonl --prompts-out prompts.jsonl --held-out-out held_out.jsonl
    python bench/full_context_data.py check --tokenized TOK --train-tokenized TRAIN_TOK --train-jsonl train.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import polars as pl

from peagle_data.readers.conversations import read_conversations
from peagle_data.readers.rows import SHAREGPT_ALIAS, Conversation
from runtime.chat.chat_template import render as render_text
from runtime.model_cache import load_tokenizer, resolve_model

HELD_OUT_BYTE = 32
"""A BASE id is held out when ``sha256(BASE)[0] < HELD_OUT_BYTE`` (32 / 256 = 1/8)."""


def base_id(conversation_id: str) -> str:
    """The original ShareGPT conversation of a piece id ``BASE_k`` (the id itself without ``_k``)."""
    head, sep, tail = conversation_id.rpartition("_")
    return head if sep and tail.isdigit() else conversation_id


def is_held_out(conversation_id: str) -> bool:
    return hashlib.sha256(base_id(conversation_id).encode()).digest()[0] < HELD_OUT_BYTE


def order_key(conversation_id: str) -> str:
    return hashlib.sha256(conversation_id.encode()).hexdigest()


def read_table(directory: str) -> pl.DataFrame:
    return pl.read_parquet(f"{directory}/*.parquet", columns=["conversation_id", "n_tokens", "n_loss_tokens"])


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` as peagle-eval and vLLM render them (the one renderer of every stage)."""
    text = render_text(tokenizer, messages, None, None, add_generation_prompt=generation_prompt)
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def plain(messages: list[dict]) -> list[dict] | None:
    """The messages as ``{"role", "content": str}`` (what peagle-eval reads), or None when one is not."""
    out = []
    for m in messages:
        if not isinstance(m.get("content"), str) or m.get("tool_calls") or m["role"] not in ("system", "user",
                                                                                             "assistant"):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out


def cut(tokenizer, messages: list[dict], min_history: int, max_prompt: int) -> tuple[int, int, int] | None:
    """``(user index, history tokens, prompt tokens)`` of the last user turn that qualifies, or None.

    History = ``render(messages[:i])`` (no generation prompt); prompt = ``render(messages[:i+1])``
    with the generation prompt; the history must be a token prefix of the prompt (else the turn is
    not used: the template would not tokenize the history the same way inside the prompt).
    """
    best = None
    for i, m in enumerate(messages):
        if m["role"] != "user" or i == 0:
            continue
        history = render(tokenizer, messages[:i], False)
        if len(history) <= min_history:
            continue
        prompt = render(tokenizer, messages[: i + 1], True)
        if len(prompt) > max_prompt or prompt[: len(history)] != history:
            continue
        best = (i, len(history), len(prompt))
    return best


def select(args: argparse.Namespace) -> None:
    table = read_table(args.tokenized)
    n_tokens = dict(zip(table["conversation_id"].to_list(), table["n_tokens"].to_list()))
    tokenizer = load_tokenizer(args.tokenizer)
    config = json.loads((resolve_model(args.tokenizer, need_weights=False) / "config.json").read_text())
    max_prompt = int(config["max_position_embeddings"]) - args.max_new_tokens

    train_ids = sorted((c for c, n in n_tokens.items() if args.min_tokens < n <= args.max_tokens
                        and not is_held_out(c)), key=order_key)[: args.train_conversations]
    held_candidates = sorted((c for c, n in n_tokens.items() if n > args.min_history and is_held_out(c)),
                             key=order_key)
    wanted = set(train_ids) | set(held_candidates)
    messages: dict[str, list[dict]] = {}
    for row in read_conversations([SHAREGPT_ALIAS]):
        if isinstance(row, Conversation) and row.conversation_id in wanted:
            messages[row.conversation_id] = row.messages
    missing = [c for c in train_ids if c not in messages]
    if missing:
        sys.exit(f"full_context_data.py: {len(missing)} conversations of {args.tokenized} not read back from "
                 f"ShareGPT (first: {missing[0]}); the tokenize output is not of the embedded ShareGPT")
    with open(args.train_out, "w", encoding="utf-8") as f:
        for c in train_ids:
            f.write(json.dumps({"id": c, "messages": messages[c]}, ensure_ascii=False) + "\n")

    prompts, bases, skipped = [], set(), {"no_turn_fits": 0, "not_plain": 0, "same_base": 0}
    for c in held_candidates:
        if len(prompts) >= args.held_out_prompts:
            break
        if base_id(c) in bases:
            skipped["same_base"] += 1
            continue
        msgs = plain(messages[c])
        if msgs is None:
            skipped["not_plain"] += 1
            continue
        found = cut(tokenizer, msgs, args.min_history, max_prompt)
        if found is None:
            skipped["no_turn_fits"] += 1
            continue
        i, history, prompt = found
        answer = msgs[i + 1: i + 2] if i + 1 < len(msgs) and msgs[i + 1]["role"] == "assistant" else []
        prompts.append({"id": c, "user_index": i, "history_tokens": history, "prompt_tokens": prompt,
                        "prompt": msgs[: i + 1], "held_out": msgs[: i + 1] + answer})
        bases.add(base_id(c))
    if len(prompts) < args.held_out_prompts:
        sys.exit(f"full_context_data.py: only {len(prompts)} of {args.held_out_prompts} held-out prompts "
                 f"qualify ({skipped})")
    with open(args.prompts_out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p["id"], "messages": p["prompt"]}, ensure_ascii=False) + "\n")
    with open(args.held_out_out, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"id": p["id"], "messages": p["held_out"]}, ensure_ascii=False) + "\n")
    hist = [p["history_tokens"] for p in prompts]
    train_tokens = [n_tokens[c] for c in train_ids]
    print(json.dumps({
        "train_conversations": len(train_ids), "train_tokens": sum(train_tokens),
        "train_tokens_min_max": [min(train_tokens), max(train_tokens)],
        "held_out_prompts": len(prompts), "history_tokens_min_mean_max": [min(hist), round(sum(hist) / len(hist)),
                                                                          max(hist)],
        "prompt_tokens_max": max(p["prompt_tokens"] for p in prompts), "held_out_skipped": skipped,
        "train_bases_held_out": sum(is_held_out(c) for c in train_ids),
    }, indent=1))


def check(args: argparse.Namespace) -> None:
    original = read_table(args.tokenized)
    again = read_table(args.train_tokenized)
    with open(args.train_jsonl, encoding="utf-8") as f:
        wanted = [json.loads(line)["id"] for line in f if line.strip()]
    lost = sorted(set(wanted) - set(again["conversation_id"].to_list()))
    if lost:
        sys.exit(f"full_context_data.py check: {len(lost)} conversations of {args.train_jsonl} are not in "
                 f"{args.train_tokenized} (rejected by tokenize? see its rejects.jsonl); first: {lost[0]}")
    joined = again.join(original, on="conversation_id", how="left", suffix="_sharegpt")
    bad = joined.filter((pl.col("n_tokens") != pl.col("n_tokens_sharegpt"))
                        | (pl.col("n_loss_tokens") != pl.col("n_loss_tokens_sharegpt"))
                        | pl.col("n_tokens_sharegpt").is_null())
    if bad.height:
        sys.exit(f"full_context_data.py check: {bad.height} of {again.height} conversations differ from the "
                 f"ShareGPT tokenize output; first: {bad.row(0, named=True)}")
    print(f"check: {again.height} conversations, same n_tokens and n_loss_tokens as {args.tokenized}")


def al_and_se(report: dict) -> tuple[float, float, int]:
    """``(AL, one standard error of AL, steps)`` of a peagle-eval report, online or offline.

    ``per_position_accepted[i]`` counts the verifier steps (offline: scored positions) that kept
    more than ``i`` drafts, so with ``a`` the drafts kept in a step, ``E[a] = sum_i P(a > i)`` and
    ``E[a^2] = sum_i (2i + 1) P(a > i)``; the standard error treats steps as independent.
    """
    n = int(report.get("num_drafts") or report["positions_scored"])
    tail = [c / n for c in report["per_position_accepted"]]
    mean = sum(tail)
    second = sum((2 * i + 1) * t for i, t in enumerate(tail))
    return 1.0 + mean, ((second - mean * mean) / n) ** 0.5, n


def per_prompt_al(report: dict) -> dict[tuple[str, int], float]:
    """AL of each prompt turn, ``1 + accepted / verifier_steps`` (the turn's drafts kept per step)."""
    out = {}
    for p in report["per_prompt"]:
        steps = p["verifier_steps"] if "vllm_steps" not in p else len(p["vllm_steps"]["accepted"])
        out[(str(p["prompt_id"]), int(p["turn"]))] = 1.0 + p["accepted"] / steps
    return out


def table(args: argparse.Namespace) -> None:
    """Print the markdown table of OUT/drafter_{window,full}: AL (one standard error, steps) per
    evaluation, the paired per-prompt difference full - window with its standard error over prompts,
    and training seconds per step (train wall time / steps from OUT/train_SIDE.log)."""
    out = Path(args.out)
    sides = [s for s in ("window", "full") if (out / f"drafter_{s}").is_dir()]
    reports = {s: {k: json.loads(p.read_text()) for k in ("vllm", "online", "offline")
                   if (p := out / f"drafter_{s}" / f"{k}.json").is_file()} for s in sides}
    print("| drafter | held-out AL, vLLM (SE, drafts) | AL, peagle engine (SE, drafts) | offline AL (SE, positions) "
          "| identical to greedy | training s / step |")
    print("|---|---|---|---|---|---|")
    for s in sides:
        cells = []
        for k in ("vllm", "online", "offline"):
            r = reports[s].get(k)
            cells.append("-" if r is None else "{:.3f} ({:.3f}, {:,})".format(*al_and_se(r)))
        same = ", ".join(f"{k} {'yes' if r['identical_to_greedy'] else 'NO'}" for k, r in reports[s].items()
                         if "identical_to_greedy" in r) or "-"
        log = out / f"train_{s}.log"
        per_step = "-"
        if log.is_file():
            wall = re.search(r"wall ([0-9.]+) s", log.read_text())
            cfg = out / f"drafter_{s}" / "train_config.json"
            steps = json.loads(cfg.read_text())["optim"]["max_steps"] if cfg.is_file() else None
            if wall and steps:
                per_step = f"{float(wall.group(1)) / steps:.2f}"
        print(f"| {s} context | {cells[0]} | {cells[1]} | {cells[2]} | {same} | {per_step} |")
    if len(sides) == 2:
        for k in ("vllm", "online"):
            if all(k in reports[s] for s in sides):
                a, b = (per_prompt_al(reports[s][k]) for s in sides)
                diffs = [b[key] - a[key] for key in a if key in b]
                m = sum(diffs) / len(diffs)
                se = (sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
                wins = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
                print(f"\n{k}: per-prompt AL, full - window: mean {m:+.3f}, SE over {len(diffs)} prompts {se:.3f}; "
                      f"full higher on {wins[0]}, window higher on {wins[1]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("select")
    s.add_argument("--tokenized", required=True, help="peagle-data tokenize sharegpt output")
    s.add_argument("--tokenizer", default="smollm2-135m")
    s.add_argument("--train-conversations", type=int, default=160)
    s.add_argument("--held-out-prompts", type=int, default=24)
    s.add_argument("--min-tokens", type=int, default=1024, help="training rows: more tokens than this")
    s.add_argument("--max-tokens", type=int, default=8192, help="training rows: at most this many tokens")
    s.add_argument("--min-history", type=int, default=1024, help="held-out prompts: more history tokens than this")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--train-out", required=True)
    s.add_argument("--prompts-out", required=True)
    s.add_argument("--held-out-out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--tokenized", required=True)
    c.add_argument("--train-tokenized", required=True, help="peagle-data tokenize output of --train-jsonl")
    c.add_argument("--train-jsonl", required=True)
    t = sub.add_parser("table")
    t.add_argument("out", help="the bench's OUT directory")
    args = p.parse_args()
    {"select": select, "check": check, "table": table}[args.command](args)


if __name__ == "__main__":
    main()
