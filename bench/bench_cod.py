"""COD sampling and attention-mask construction time against a training step, on CPU.

Synthetic packed blocks of T tokens (segments of 2048, 70% supervised), K = 8, r = 0.7,
r_min = 0.2: the time of ``sample_cod_elements`` and of ``build_attention_mask`` (median of
``--repeats``), with ``max_anchors`` unset and 1024. The training step (SmolLM2 sizes, 1 layer,
draft vocab ``--draft-vocab``; see ``bench_train_memory.py``) is measured where ``--step-tokens``
lists T and its estimate fits ``--max-step-s``; elsewhere the table gives the FLOP-count estimate
(marked ~) so the fraction can still be read. A dense ``[E, E]`` mask over 4 GiB is not built.

Usage (from the repository root, inside .venv):
    python bench/bench_cod.py --tokens 8192,32768 --step-tokens 8192 --draft-vocab 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_train_memory import K, estimate, make_block, make_trainer, train_step  # noqa: E402

from peagle_train.model.element_mask import build_attention_mask
from peagle_train.data.cod import sample_cod_elements  # noqa: E402


def time_cod_and_mask(T: int, max_anchors: int | None, repeats: int) -> dict:
    block = make_block(T)
    cod, mask, E = [], [], 0
    for i in range(repeats):
        t0 = time.perf_counter()
        el = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, 0.7, 0.2, max_anchors,
                                 torch.Generator().manual_seed(i))
        cod.append(time.perf_counter() - t0)
        E = len(el)
        if E * E <= 4 * 2 ** 30:
            t0 = time.perf_counter()
            build_attention_mask(el)
            mask.append(time.perf_counter() - t0)
    return {"elements": E, "cod_s": statistics.median(cod), "mask_s": statistics.median(mask) if mask else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,32768")
    ap.add_argument("--step-tokens", default="8192", help="T values whose training step is measured")
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-step-s", type=float, default=150.0)
    args = ap.parse_args()
    step_T = {int(t) for t in args.step_tokens.split(",") if t}
    print(f"torch threads: {torch.get_num_threads()}, draft vocab {args.draft_vocab}, K {K}")
    print("| T | max_anchors | elements | COD s | mask s | step s | (COD + mask) / step |")
    print("|---|---|---|---|---|---|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        for a in (None, 1024):
            r = time_cod_and_mask(T, a, args.repeats)
            est_s, _ = estimate(T, a, args.draft_vocab)
            if T in step_T and est_s <= args.max_step_s:
                trainer, _ = make_trainer(args.draft_vocab, 2048, max_anchors=a)
                step = train_step(trainer, make_block(T), seed=0)["step_s"]
                shown = f"{step:.1f}"
            else:
                step, shown = est_s, f"~{est_s:.0f} (estimate, not run)"
            mask = f"{r['mask_s']:.3f}" if r["mask_s"] is not None else "not built (> 4 GiB)"
            frac = (r["cod_s"] + (r["mask_s"] or 0.0)) / step
            print(f"| {T} | {a} | {r['elements']} | {r['cod_s']:.3f} | {mask} | {shown} | {frac:.2%} |",
                  flush=True)


if __name__ == "__main__":
    main()
