"""Extraction speed of a hybrid verifier against an attention-only verifier of the same size, and the padding waste.

The hf engine packs the conversations of an attention-only verifier into one sequence per block (a block mask
keeps them apart), but runs a hybrid's (gated DeltaNet / Mamba-2 layers, whose state would flow from one packed
conversation into the next) as the rows of right-padded batches, longest first, at most a block's tokens of
slots a batch (``peagle_data.extract.hf_forward.segments_padded``). This measures, on the same context blocks:

- ``attention``: a Qwen3 (dense, every layer full attention), packed blocks (``verifier_features``);
- ``hybrid_padded``: a Qwen3.5 text model of the same hidden size, layers, heads and MLP (gated DeltaNet and gated
  attention layers, 3 to 1), the engine's padded batches;
- ``hybrid_alone``: the same hybrid, one conversation per forward (the exact form without padding), to show
  what batching buys;

tokens/s of each (the verifier forward alone: it is the whole of the hf engine's time) and the padding waste
(padded slots / conversation tokens - 1). Random weights; CPU float32 runs transformers' PyTorch fallbacks of the
gated DeltaNet kernels (flash-linear-attention is CUDA only), so the CPU ratio is not a GPU one.

Usage (from the repository root, inside .venv):
    python bench/bench_hybrid_extract.py --hidden 256 --layers 8 --blocks 6 --block-size 2048
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from peagle_data.extract.hf_forward import padded_batches, segments_alone, verifier_features
from peagle_data.prepare.packing import pack_blocks


def models(hidden: int, layers: int, vocab: int):
    """``(attention-only Qwen3, hybrid Qwen3.5 text)`` decoder stacks of the same shape, float32, eval."""
    import transformers as tf

    heads = max(hidden // 64, 2)
    shape = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
                 max_position_embeddings=8192, tie_word_embeddings=False)
    kinds = ["linear_attention"] * 3 + ["full_attention"]
    hybrid = tf.Qwen3_5TextConfig(**shape, layer_types=[kinds[i % 4] for i in range(layers)],
                                  linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                                  linear_num_key_heads=heads, linear_num_value_heads=2 * heads)
    out = []
    for cfg in (tf.Qwen3Config(**shape), hybrid):
        torch.manual_seed(0)
        out.append(tf.AutoModel.from_config(cfg, dtype=torch.float32).eval())
    return out


def context_blocks(n_blocks: int, block_size: int, lo: int, hi: int, vocab: int, seed: int = 0):
    """Random conversations of ``lo..hi`` tokens packed best-fit into blocks of ``block_size`` slots: per block
    ``(input_ids [T], position_ids [T], cu_seqlens [S+1])``; the first ``n_blocks``."""
    g = np.random.default_rng(seed)
    lengths = g.integers(lo, hi + 1, n_blocks * block_size // ((lo + hi) // 2) + 8).tolist()
    blocks = []
    for members in pack_blocks(lengths, block_size)[:n_blocks]:
        lens = [lengths[k] for k in members]
        ids = torch.from_numpy(g.integers(3, vocab - 3, sum(lens)))
        pos = torch.cat([torch.arange(n) for n in lens])
        blocks.append((ids, pos, torch.tensor([0] + lens).cumsum(0)))
    return blocks


def timed(fn, decoder, blocks, layers) -> float:
    """Seconds of ``fn(decoder, ids, pos, cu, layers)`` over every block (one warm-up block first, untimed)."""
    fn(decoder, *blocks[0], layers)
    t0 = time.perf_counter()
    for ids, pos, cu in blocks:
        fn(decoder, ids, pos, cu, layers)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    attention, hybrid = models(args.hidden, args.layers, args.vocab)
    blocks = context_blocks(args.blocks, args.block_size, args.min_len, args.max_len, args.vocab)
    layers = [2, args.layers // 2, args.layers - 3]
    tokens = sum(int(cu[-1]) for _, _, cu in blocks)
    slots = 0
    for _, _, cu in blocks:
        lengths = (cu[1:] - cu[:-1]).tolist()
        slots += sum(len(b) * lengths[b[0]] for b in padded_batches(lengths, int(cu[-1])))
    with torch.no_grad():
        seconds = {"attention": timed(verifier_features, attention, blocks, layers),
                   "hybrid_padded": timed(verifier_features, hybrid, blocks, layers),
                   "hybrid_alone": timed(segments_alone, hybrid, blocks, layers)}
    print(json.dumps({
        "config": vars(args), "tokens": tokens, "segments": sum(len(cu) - 1 for _, _, cu in blocks),
        "padding_waste": round(slots / tokens - 1, 4),
        "tokens_per_s": {k: round(tokens / s, 1) for k, s in seconds.items()},
        "hybrid_padded_vs_attention": round(seconds["attention"] / seconds["hybrid_padded"], 3),
        "hybrid_padded_vs_alone": round(seconds["hybrid_alone"] / seconds["hybrid_padded"], 3),
        "load_average": os.getloadavg(), "torch": torch.__version__,
    }, indent=1))


if __name__ == "__main__":
    main()
