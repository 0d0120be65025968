"""Online speculative decoding speed on this machine: greedy vs speculative with an oracle-like drafter.

The real drafter runs every step (its cost is paid), but its drafts are replaced by the verifier's
own greedy continuation, right up to depth ``wrong_from`` (all depths when None). This shows what
speculative decoding gains at a given acceptance, independent of how well a drafter is trained.

    OMP_NUM_THREADS=1 python bench/bench_speculative.py --drafter /tmp/demo/d2/final --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import json

import torch

import peagle_train.speculative as spec
from peagle_train.checkpoint import load_drafter
from peagle_train.evaluate import read_prompts, render_turn
from stores.model_cache import load_tokenizer, load_verifier


def oracle_run(verifier, drafter, ids, full, max_new, K, wrong_from):
    """speculative_generate with the drafts replaced by ``full`` (prompt + greedy tokens)."""
    state = {}
    orig_draft, orig_propose = spec.DrafterSession.draft, spec._propose

    def draft(self, new_tokens, new_aux, k):
        out = orig_draft(self, new_tokens, new_aux, k)  # the real drafter's cost
        state["t"] = self.n_ctx - 1
        return out

    def propose(draft_logits, draft_ids, vocab, temperature, generator):
        t, k = state["t"], draft_logits.shape[0]
        toks = [full[i] if i < len(full) else 0 for i in range(t + 2, t + 2 + k)]
        if wrong_from is not None:
            toks = [tok if d < wrong_from else (tok + 1) % vocab for d, tok in enumerate(toks)]
        return torch.tensor(toks), None

    spec.DrafterSession.draft, spec._propose = draft, propose
    try:
        return spec.speculative_generate(verifier, drafter, ids, max_new, K)
    finally:
        spec.DrafterSession.draft, spec._propose = orig_draft, orig_propose


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="examples/prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    verifier = load_verifier(args.verifier, dtype=torch.float32)
    drafter = load_drafter(args.drafter).eval().float()
    tok = load_tokenizer(args.verifier)
    K, n = args.num_draft_tokens, args.max_new_tokens
    rows = {"greedy": [0, 0.0]}
    cases = {"oracle_all": None, "oracle_wrong_from_2": 2, "oracle_wrong_from_1": 1, "real_drafter": "real"}
    for name in cases:
        rows[name] = [0, 0.0, 0, 0]
    identical = True
    for prompt in read_prompts(args.prompts, args.num_prompts):
        ids = render_turn(tok, prompt, 0, [])
        spec.greedy_generate(verifier, ids, 2)  # warm-up
        base = spec.greedy_generate(verifier, ids, n)
        rows["greedy"][0] += len(base.tokens)
        rows["greedy"][1] += base.wall_time_s
        for name, wrong in cases.items():
            out = spec.speculative_generate(verifier, drafter, ids, n, K) if wrong == "real" else \
                oracle_run(verifier, drafter, ids, ids + base.tokens, n, K, wrong)
            identical &= out.tokens == base.tokens
            r = rows[name]
            r[0] += len(out.tokens)
            r[1] += out.wall_time_s
            r[2] += out.accepted
            r[3] += out.verifier_steps
    report = {"identical_to_greedy": identical, "K": K, "max_new_tokens": n,
              "greedy_tokens_per_second": rows["greedy"][0] / rows["greedy"][1]}
    for name in cases:
        toks, secs, acc, steps = rows[name]
        report[name] = {"tokens_per_second": toks / secs, "acceptance_length": 1 + acc / max(steps, 1),
                        "speedup": toks / secs / report["greedy_tokens_per_second"]}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
