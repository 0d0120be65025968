"""Online speculative decoding speed on this machine: greedy vs speculative with an oracle-like drafter.

The real drafter runs every step (its cost is paid), but its drafts are replaced by the verifier's
own greedy continuation, right up to depth ``wrong_from`` (all depths when None). This shows what
speculative decoding gains at a given acceptance, independent of how well a drafter is trained.
Each case is timed right after a greedy run of the same prompt, and its speedup is against that
greedy run, so load changes on a shared machine hit a case and its baseline alike; the ``_cpu``
figures use the process's CPU seconds instead of wall time (one thread: what the work cost, not
how long it waited for a core), the steadier measure when other jobs share the cores.

``break_even_acceptance_length`` of a row is ``AL / speedup``: the acceptance length at which a step
of that cost would run exactly as fast as greedy decoding. The oracle rows run twice in the same
process: with the verifier's lm_head as ``speculative_generate`` computes it (all K+1 rows in one
product) and, as the "before" reference, one row at a time up to the first rejected draft (the lazy
rows peagle used until issue 12).

    OMP_NUM_THREADS=1 python bench/bench_speculative.py --drafter /tmp/demo/d2/final --max-new-tokens 48 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import peagle_train.generate.speculative as spec
import peagle_train.generate.verifier as verifier_mod  # its verifier passes call lm_head_logits: patched here
from peagle_train.evaluate.prompts import read_prompts, render_turn
from peagle_train.model.checkpoint import load_drafter
from runtime.model_cache import load_tokenizer, load_verifier


def oracle_run(verifier, drafter, ids, full, max_new, K, wrong_from):
    """speculative_generate with the drafts replaced by ``full`` (prompt + greedy tokens)."""
    state = {}
    orig_draft, orig_propose = spec.DrafterSession.draft, spec.propose_drafts

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

    spec.DrafterSession.draft, spec.propose_drafts = draft, propose
    try:
        return spec.speculative_generate(verifier, drafter, ids, max_new, K)
    finally:
        spec.DrafterSession.draft, spec.propose_drafts = orig_draft, orig_propose


class RowByRowLogits:
    """The lm_head as computed before issue 12: row i on demand, one ``lm_head`` call per row."""

    def __init__(self, lm_head, hidden):
        self.lm_head, self.hidden, self.rows = lm_head, hidden, {}

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            self.rows[i] = self.lm_head(self.hidden[i:i + 1])[0].float().cpu()
        return self.rows[i]


def row_by_row_run(*args):
    """oracle_run with the "before" lm_head (:class:`RowByRowLogits`)."""
    orig = verifier_mod.lm_head_logits
    verifier_mod.lm_head_logits = RowByRowLogits
    try:
        return oracle_run(*args)
    finally:
        verifier_mod.lm_head_logits = orig


def run_case(verifier, drafter, ids, base, n, K, wrong):
    """One generation of a case: the real drafter, an oracle row, or a "before" oracle row."""
    if wrong == "real":
        return spec.speculative_generate(verifier, drafter, ids, n, K)
    if isinstance(wrong, tuple):
        return row_by_row_run(verifier, drafter, ids, ids + base.tokens, n, K, wrong[1])
    return oracle_run(verifier, drafter, ids, ids + base.tokens, n, K, wrong)


CASES = {"oracle_all": None, "oracle_wrong_from_2": 2, "oracle_wrong_from_1": 1, "real_drafter": "real",
         "before_oracle_all": ("before", None), "before_oracle_wrong_from_2": ("before", 2),
         "before_oracle_wrong_from_1": ("before", 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="examples/prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="rounds over all prompts and cases")
    args = ap.parse_args()
    torch.set_num_threads(1)
    verifier = load_verifier(args.verifier, dtype=torch.float32)
    drafter = load_drafter(args.drafter).eval().float()
    tok = load_tokenizer(args.verifier)
    K, n = args.num_draft_tokens, args.max_new_tokens
    # per case: tokens, seconds, accepted, steps, and the greedy run timed right before it (tokens, seconds),
    # so that a load change on a shared machine shifts a case and its baseline alike
    rows = {name: [0, 0.0, 0, 0, 0, 0.0, 0.0, 0.0] for name in CASES}  # + CPU seconds of the case and of greedy
    identical = True
    prompts = [render_turn(tok, p, 0, []) for p in read_prompts(args.prompts, args.num_prompts)]
    for _ in range(args.repeats):
        for ids in prompts:
            spec.greedy_generate(verifier, ids, 2)  # warm-up
            for name, wrong in CASES.items():
                c0 = time.process_time()
                base = spec.greedy_generate(verifier, ids, n)
                c1 = time.process_time()
                out = run_case(verifier, drafter, ids, base, n, K, wrong)
                c2 = time.process_time()
                identical &= out.tokens == base.tokens
                r = rows[name]
                for i, value in enumerate((len(out.tokens), out.wall_time_s, out.accepted, out.verifier_steps,
                                           len(base.tokens), base.wall_time_s, c2 - c1, c1 - c0)):
                    r[i] += value
    greedy_toks, greedy_secs = sum(r[4] for r in rows.values()), sum(r[5] for r in rows.values())
    report = {"identical_to_greedy": identical, "K": K, "max_new_tokens": n, "repeats": args.repeats,
              "greedy_tokens_per_second": greedy_toks / greedy_secs}
    for name, (toks, secs, acc, steps, g_toks, g_secs, cpu, g_cpu) in rows.items():
        al, speedup, cpu_speedup = 1 + acc / max(steps, 1), (toks / secs) / (g_toks / g_secs), g_cpu / cpu
        report[name] = {"tokens_per_second": toks / secs, "acceptance_length": al, "speedup": speedup,
                        "break_even_acceptance_length": al / speedup, "cpu_speedup": cpu_speedup,
                        "break_even_acceptance_length_cpu": al / cpu_speedup}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
