"""The replay judge's standard error at T = 1 against the spread of new judge sets (docs/benchmarks.md, "The judge's
standard errors"): a simulated judge set of PROMPTS prompts x SAMPLES samples whose acceptance depends on the prompt
(each prompt's acceptance probability drawn once from Beta(2, 5), 20 drafting steps of K = 3 per sample). The SE of
``bootstrap_al`` resampling prompts (a prompt's samples together) and resampling samples as independent conversations,
each divided by the standard deviation of the AL over 400 independently drawn judge sets.

    PYTHONPATH=. python bench/bench_judge_se.py [--prompts 80] [--samples 3] [--seeds 3]
"""

from __future__ import annotations

import argparse

import numpy as np

from peagle_train.evaluate.replay import bootstrap_al


def judge_draws(rng: np.random.Generator, prompts: int, samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(accepted [C], num_drafts [C], prompt [C])`` of one simulated judge set, C = prompts x samples."""
    p = np.repeat(rng.beta(2, 5, prompts), samples)
    drafts = np.full(prompts * samples, 20)
    return rng.binomial(drafts * 3, p), drafts, np.repeat(np.arange(prompts), samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=80)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    for seed in range(a.seeds):
        rng = np.random.default_rng(seed)
        truth = np.std([bootstrap_al(*judge_draws(rng, a.prompts, a.samples)[:2])[0] for _ in range(400)], ddof=1)
        acc, drafts, prompts = judge_draws(rng, a.prompts, a.samples)
        by_prompt = bootstrap_al(acc, drafts, seed=1, clusters=prompts)[1]
        by_conversation = bootstrap_al(acc, drafts, seed=1)[1]
        print(f"seed {seed}: spread of new judge sets {truth:.4f}; SE over prompts {by_prompt:.4f} "
              f"({by_prompt / truth:.2f}x); SE over samples as conversations {by_conversation:.4f} "
              f"({by_conversation / truth:.2f}x, too small by {truth / by_conversation:.2f}x)")


if __name__ == "__main__":
    main()
