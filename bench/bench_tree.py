"""Tree verification against the chain, in one run: AL and tokens/s on MT-Bench prompts, the verifier's cost
per tree size on this machine, and what the cost model predicts for a GPU from the measured AL (issue 35).

Each prompt (the first turn of MT-Bench questions, which no stage trains on) is decoded by plain greedy
decoding and then by every case (chain K = 4, fixed trees, dynamic trees), one after the other, so a change of
load on a shared machine hits a case and its baseline alike; speedups are ratios of summed tokens and seconds
within the run. Every case's output is checked token for token against greedy decoding.

Costs (medians of ``--cost-rounds`` interleaved rounds after 2 untimed, KV cache of the first prompt): a greedy
one-token verifier pass ``t_v(1)``, the drafter's pass drafting K = 4 ``t_d``, and one verifier pass over the
root and N tree nodes ``t_v(N + 1)`` with the tree mask and the cache compaction (N = 4 is the chain's mask).
Predicted speedup of a case: ``AL · t_v(1) / (t_v(N + 1) + t_d)`` (docs/design.md §9's cost model with the
tree's pass); for a GPU at small batch, where a pass over N + 1 ≤ 33 tokens costs about one over 1 token
(memory-bound), ``AL / (1 + t_d / t_v(1))`` with this CPU's drafter-to-verifier cost ratio (an assumption,
not a GPU measurement: no GPU was lent).

    OMP_NUM_THREADS=1 python bench/bench_tree.py --drafter /tmp/hf_bench/drafter/final --num-prompts 6 \
        --max-new-tokens 64 --output /tmp/hf_bench/tree.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from peagle_train.generate.inference import PEAGLEInference, acceptance_summary, load_for_decoding
from peagle_train.evaluate.prompts import read_prompts, render_turn
from peagle_train.generate.speculative import DrafterSession, aux_features, plain_generate
from peagle_train.evaluate.cost_model import measure_step_costs
from peagle_train.generate.tree import TreeSpec, build_tree, compact_cache, tree_attention_mask
from peagle_train.generate.verifier import (aux_hidden_states, crop_cache, new_cache, rollback_cache,
                                            verifier_body_pass, verifier_pass)
from peagle_train.model.checkpoint import find_drafter, load_drafter
from runtime.model_cache import load_tokenizer

CASES = [("chain K=4", None),
         ("fixed 2,1,1,1", TreeSpec(topk=(2, 1, 1, 1))), ("fixed 4,1,1,1", TreeSpec(topk=(4, 1, 1, 1))),
         ("fixed 8,1,1,1", TreeSpec(topk=(8, 1, 1, 1))),
         ("dynamic 8", TreeSpec(nodes=8)), ("dynamic 16", TreeSpec(nodes=16)), ("dynamic 32", TreeSpec(nodes=32))]
"""(name, tree): K = 4 depths each; fixed trees of 8, 16 and 32 nodes (the width at depth 0, where a P-EAGLE
drafter's acceptance is highest), dynamic ones of 8, 16, 32."""


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.no_grad()
def pass_costs(verifier, drafter, ids: list[int], sizes: list[int], rounds: int) -> dict:
    """Median seconds of a greedy pass, the drafter pass (K = 4, :func:`measure_step_costs`) and a tree pass of
    each size, timed in interleaved rounds (see the module docstring)."""
    K = 4
    ctx = torch.tensor(ids)
    P = ctx.numel()
    greedy_cache = new_cache(verifier)
    verifier_pass(verifier, ctx, greedy_cache, want_hidden=False, last_only=True)
    times: dict[str, list[float]] = {"greedy": [], **{f"tree_{n}": [] for n in sizes}}
    with aux_hidden_states(verifier) as last:
        cache = rollback_cache(verifier)
        _, hs = verifier_pass(verifier, ctx, cache, want_hidden=True, last_only=True)
        aux = aux_features(hs, last, drafter.config.aux_layer_ids)
        logits = DrafterSession(drafter).draft(torch.cat([ctx[1:], ctx[-1:]]), aux, K)  # [K, D]
        trees = {n: build_tree(logits, drafter.draft_ids, TreeSpec(nodes=n), K) for n in sizes}
        trees[K] = build_tree(logits, drafter.draft_ids, TreeSpec(topk=(1,) * K), K)  # the chain
        for r in range(rounds + 2):
            t = {"greedy": _timed(lambda: verifier_pass(verifier, ctx[-1:], greedy_cache, want_hidden=False))}
            crop_cache(greedy_cache, P)
            for n in sizes:
                tree = trees[n]

                def verify():
                    mask, pos = tree_attention_mask(verifier, tree, P, torch.float32, "cpu")
                    verifier_body_pass(verifier, torch.cat([ctx[-1:], tree.tokens]), cache,
                                       extra={"attention_mask": mask, "position_ids": pos})
                    compact_cache(cache, P, [tree.size])  # keep the last node, as a step compacts to its path
                t[f"tree_{n}"] = _timed(verify)
                crop_cache(cache, P)
            if r >= 2:
                for k, v in t.items():
                    times[k].append(v)
    step = measure_step_costs(verifier, drafter, ids, K, rounds)
    return {k: statistics.median(v) for k, v in times.items()} | {
        "draft": step.draft_s[K - 1], "cost_model_verify_1_s": step.verify_1_s, "cost_model_verify_5_s":
        step.verify_s[K - 1], "context_tokens": P, "rounds": rounds, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="/work/shared/data/mt_bench_question.jsonl")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cost-rounds", type=int, default=9)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    found, _ = find_drafter(args.drafter)
    verifier, drafter = load_for_decoding(load_drafter(found), args.verifier)
    tokenizer = load_tokenizer(args.verifier)
    prompts = read_prompts(args.prompts, args.num_prompts)
    engines = {name: PEAGLEInference.from_models(verifier, drafter, tokenizer, speculation_depth=4, tree=spec)
               for name, spec in CASES}
    first = render_turn(tokenizer, prompts[0], 0, [])
    plain_generate(verifier, first, 2)
    for engine in engines.values():
        engine.warm_up(first)
    eos = engines["chain K=4"].eos
    runs: dict[str, list] = {name: [] for name, _ in CASES}
    plain_tokens = plain_time = 0.0
    same = {name: True for name, _ in CASES}
    for prompt in prompts:
        ids = render_turn(tokenizer, prompt, 0, [])
        base = plain_generate(verifier, ids, args.max_new_tokens, eos)
        plain_tokens += len(base.tokens)
        plain_time += base.wall_time_s
        for name, _ in CASES:
            spec, _ = engines[name].generate_ids(ids, args.max_new_tokens)
            runs[name].append(spec)
            same[name] &= spec.tokens == base.tokens
        print(f"prompt {prompt.prompt_id} done", flush=True)
    costs = pass_costs(verifier, drafter, first, [4, 8, 16, 32], args.cost_rounds)
    t1, td = costs["greedy"], costs["draft"]
    plain_tps = plain_tokens / plain_time
    rows = []
    for name, spec in CASES:
        acc = acceptance_summary(runs[name], 4)
        tokens = sum(len(r.tokens) for r in runs[name])
        seconds = sum(r.wall_time_s for r in runs[name])
        n = 4 if spec is None else spec.max_nodes
        tv = costs[f"tree_{n}"]
        al = acc["acceptance_length"]
        rows.append({"case": name, "nodes": n, "acceptance_length": al,
                     "per_position_acceptance": acc["per_position_acceptance"],
                     "tokens_per_second": tokens / seconds, "speedup_vs_greedy": tokens / seconds / plain_tps,
                     "identical_to_greedy": same[name], "verify_s": tv,
                     "predicted_speedup_this_cpu": al * t1 / (tv + td),
                     "predicted_speedup_gpu": al / (1 + td / t1)})
    report = {"drafter": str(found), "verifier": args.verifier, "prompts": args.prompts,
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "greedy_tokens_per_second": plain_tps, "costs": costs, "rows": rows}
    print(json.dumps(report, indent=1))
    print("| case | nodes | AL | tok/s | vs greedy | identical | t_v(N+1) / t_v(1) | predicted CPU | predicted GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['nodes']} | {r['acceptance_length']:.3f} | {r['tokens_per_second']:.1f} | "
              f"{r['speedup_vs_greedy']:.2f}x | {r['identical_to_greedy']} | {r['verify_s'] / t1:.2f} | "
              f"{r['predicted_speedup_this_cpu']:.2f}x | {r['predicted_speedup_gpu']:.2f}x |")
    print(f"greedy {plain_tps:.1f} tok/s; t_v(1) {t1 * 1e3:.1f} ms, t_d(4) {td * 1e3:.1f} ms")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
