"""One verifier forward with hidden states at each length: what extraction pays per context (issue 32).

Usage: OMP_NUM_THREADS=1 python bench/bench_verifier_forward.py [--verifier smollm2-135m] [--tokens 2048,8192]
Prints seconds, ms per token and the peak RSS for each length (random ids, float32 on CPU, no cache).
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from runtime.model_cache import load_verifier


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--tokens", default="2048,8192")
    args = ap.parse_args()
    model = load_verifier(args.verifier, device="cpu").eval()
    gen = torch.Generator().manual_seed(0)
    for T in (int(t) for t in args.tokens.split(",")):
        ids = torch.randint(100, 40000, (1, T), generator=gen)
        with torch.no_grad():
            start = time.perf_counter()
            model(input_ids=ids, output_hidden_states=True)
            seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        print(f"{T} tokens: {seconds:.1f} s, {seconds / T * 1000:.2f} ms/token, {model.dtype}, peak RSS {rss:.2f} GB",
              flush=True)


if __name__ == "__main__":
    main()
