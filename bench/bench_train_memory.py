"""Peak memory and step time of one P-EAGLE training step on CPU, per block length.

A 1-layer drafter at the real SmolLM2-135M sizes (H 576, 9 heads / 3 KV heads of 64, MLP 1536,
3 aux layers, vocab 49152, draft vocab 49152 unless ``--draft-vocab``), one synthetic packed block
of T tokens (segments of 2048 tokens, 70% supervised, K = 8), the full step of ``peagle-train``
(COD sampling, mask, forward, chunked or unchunked KL, backward, clipping, LazyRowAdamW). Each
configuration runs in a fresh subprocess, so its peak resident memory (``ru_maxrss``) is its own;
``base`` is the resident memory after building the model and optimizer state, before the steps.
Configurations whose estimated time exceeds ``--max-step-s`` or whose estimated unchunked logits
exceed ``--max-gb`` are skipped and listed as such; a subprocess is also capped by RLIMIT_AS.

``--backends sdpa,split`` compares the dense-mask attention with the split one (no ``[E, E]``
tensor; ``peagle_train.model.attention.SplitElementAttention``). ``--layers 1,4`` sets the drafter's
decoder layers. ``--gradient-checkpointing`` runs every configuration twice, with the activations kept
and with ``--gradient-checkpointing`` (each decoder layer recomputed in the backward), one after the
other in alternating order (kept first for the 1st, 3rd, ... configuration), and prints their ratios.

Usage (from the repository root, inside .venv):
    python bench/bench_train_memory.py --tokens 1024,2048,4096,8192,16384 --steps 1
    python bench/bench_train_memory.py --tokens 8192 --anchors 1024 --chunks 2048 --backends split \
        --layers 1,4 --gradient-checkpointing
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

H, NH, NKV, HD, FFN, L, V = 576, 9, 3, 64, 1536, 3, 49152
SEGMENT = 2048
SUPERVISED = 0.7
K = 8
GFLOPS = 25.0  # measured single-process matmul rate on the shared 2-core box, for the skip estimate


def estimate_elements(T: int, max_anchors: int | None, K: int = K, r: float = 0.7, r_min: float = 0.2) -> int:
    """Depth-0 elements plus the COD draws (§8) for a 70%-supervised block."""
    seeds = SUPERVISED * T
    if max_anchors is not None:
        seeds = min(seeds, max_anchors)
    return int(T + sum(seeds * max(r ** d, r_min) for d in range(1, K)))


def estimate(T: int, max_anchors: int | None, D: int, layers: int = 1,
             checkpointing: bool = False) -> tuple[float, float]:
    """(seconds, GB of one [E, D] float32 logits buffer) for one step, rough; a checkpointed layer
    runs its forward twice (4 passes of its matmuls instead of 3)."""
    E = estimate_elements(T, max_anchors)
    passes = 4 if checkpointing else 3
    layer = 2 * E * (2 * H * (NH + 2 * NKV) * HD + NH * HD * H + 3 * H * FFN) * passes * layers
    attn = 2 * 2 * NH * E * E * HD * passes * layers
    loss = 2 * E * H * D * 3
    return (layer + attn + loss) / (GFLOPS * 1e9), E * D * 4 / 1e9


def make_block(T: int, seed: int = 0):
    """A synthetic packed block: segments of SEGMENT tokens, 70% supervised, random features."""
    import torch

    from peagle_train.data.loader import Block

    g = torch.Generator().manual_seed(seed)
    lens = [min(SEGMENT, T - s) for s in range(0, T, SEGMENT)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return Block(block_id=0, input_ids=torch.randint(0, V, (T,), generator=g),
                 loss_mask=(torch.rand(T, generator=g) < SUPERVISED).long(),
                 position_ids=torch.cat([torch.arange(n) for n in lens]), cu_seqlens=cu,
                 aux_hidden=torch.randn(T, L * H, generator=g).to(torch.bfloat16),
                 final_hidden=(3 * torch.randn(T, H, generator=g)).to(torch.bfloat16))


def make_trainer(D: int, chunk: int | None, num_depths: int = K, max_anchors: int | None = None,
                 backend: str = "sdpa", layers: int = 1, checkpointing: bool = False):
    """(a :class:`peagle_train.train.trainer.Trainer` of a drafter at SmolLM2 sizes, its drafter).

    Lazy embedding rows (LazyRowAdamW), lr 1e-4 with no warm-up or decay within the run, loss
    chunks of ``chunk`` elements (None: unchunked, one chunk larger than any block), ``layers``
    decoder layers, ``--gradient-checkpointing`` when ``checkpointing``.
    """
    import torch

    from peagle_train.model.config import DrafterConfig
    from peagle_train.model.drafter import PEagleDrafter
    from peagle_train.train.config import TrainConfig
    from peagle_train.train.kinds import drafter_kind
    from peagle_train.train.trainer import Trainer

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=FFN, num_attention_heads=NH, num_key_value_heads=NKV,
                        head_dim=HD, vocab_size=V, draft_vocab_size=D, aux_layer_ids=[2, 15, 27],
                        num_depths=num_depths, num_hidden_layers=layers)
    model = PEagleDrafter(cfg)
    d2t = torch.zeros(D, dtype=torch.long) if D < V else None
    model.init_from_verifier(0.02 * torch.randn(V, H), 0.02 * torch.randn(V, H), d2t)
    vhead = 0.05 * torch.randn(D, H)
    train_cfg = TrainConfig.from_flat(store="-", output="-", lr=1e-4, num_depths=num_depths, max_anchors=max_anchors,
                            loss_chunk_size=chunk or 2 ** 62, attention_backend=backend,
                            num_layers=layers, gradient_checkpointing=checkpointing)
    return Trainer(train_cfg, model, vhead, kind=drafter_kind(train_cfg.model.method), attention=backend,
                   max_steps=10 ** 9, warmup=0), model


def train_step(trainer, block, seed: int) -> dict:
    """One full training step (:meth:`Trainer.train_step`); its timings in seconds and element counts.

    COD sampling and the attention's structure (the dense mask, or the split attention's tables) are
    also timed apart (the step samples again with the same seed).
    """
    import torch

    from peagle_train.model.attention import SplitElementAttention
    from peagle_train.model.element_mask import build_attention_mask
    from peagle_train.train.step import sample_elements

    t0 = time.perf_counter()
    el = sample_elements(block, trainer.cfg, torch.Generator().manual_seed(seed))
    t1 = time.perf_counter()
    (SplitElementAttention if trainer.attention == "split" else build_attention_mask)(el)
    t2 = time.perf_counter()
    row = trainer.train_step([(block, torch.Generator().manual_seed(seed))])
    t3 = time.perf_counter()
    return {"cod_s": t1 - t0, "mask_s": t2 - t1, "step_s": t3 - t2, "elements": len(el), "loss": row["loss"]}


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(T: int, max_anchors: int | None, chunk: int | None, D: int, steps: int, backend: str = "sdpa",
            layers: int = 1, checkpointing: bool = False) -> dict:
    import torch

    trainer, _ = make_trainer(D, chunk, max_anchors=max_anchors, backend=backend, layers=layers,
                              checkpointing=checkpointing)
    block = make_block(T)
    base = rss_mb()
    runs = [train_step(trainer, block, seed=i) for i in range(steps)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"T": T, "max_anchors": max_anchors, "chunk": chunk, "backend": backend, "D": D,
            "layers": layers, "checkpointing": checkpointing, "loss": runs[0]["loss"],
            "threads": torch.get_num_threads(),
            "elements": runs[-1]["elements"], "step_s": min(r["step_s"] for r in runs),
            "cod_s": runs[-1]["cod_s"], "mask_s": runs[-1]["mask_s"], "base_mb": base, "peak_mb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--draft-vocab", type=int, default=V)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--anchors", default="none,1024", help="max_anchors values to try (none: unset)")
    ap.add_argument("--chunks", default="2048,none", help="loss chunk sizes to try (none: unchunked)")
    ap.add_argument("--max-step-s", type=float, default=120.0)
    ap.add_argument("--max-gb", type=float, default=12.0)
    ap.add_argument("--backends", default="sdpa", help="attention backends to try: sdpa (dense mask), split")
    ap.add_argument("--layers", default="1", help="drafter decoder layers to try")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="run each configuration with the activations kept and with gradient checkpointing, "
                         "alternating, and print their ratios")
    ap.add_argument("--one", nargs=6, metavar=("T", "MAX_ANCHORS", "CHUNK", "BACKEND", "LAYERS", "CKPT"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        T, a, c = (None if v == "none" else int(v) for v in args.one[:3])
        layers, ckpt = int(args.one[4]), args.one[5] == "1"
        limit = int(args.max_gb * 1.25 * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            print(json.dumps(run_one(T, a, c, args.draft_vocab, args.steps, args.one[3], layers, ckpt)))
        except (MemoryError, RuntimeError) as e:
            print(json.dumps({"T": T, "max_anchors": a, "chunk": c, "backend": args.one[3], "layers": layers,
                              "checkpointing": ckpt, "skipped": f"out of memory: {str(e)[:80]}"}))
        return
    rows, n = [], 0
    modes = (False, True) if args.gradient_checkpointing else (False,)
    for T in (int(t) for t in args.tokens.split(",")):
        for a in (None if v == "none" else int(v) for v in args.anchors.split(",")):
            for c in (None if v == "none" else int(v) for v in args.chunks.split(",")):
                for backend in args.backends.split(","):
                    for layers in (int(v) for v in args.layers.split(",")):
                        for ckpt in (modes if n % 2 == 0 else modes[::-1]):  # alternating order
                            rows.append(run_config(T, a, c, backend, args, layers, ckpt))
                            print(json.dumps(rows[-1]), flush=True)
                        n += 1
    print("\n| T | max_anchors | loss | attention | layers | gradient checkpointing | elements | step s | "
          "peak RSS MB | RSS before step MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        loss = f"chunked {r['chunk']}" if r["chunk"] else "unchunked"
        head = f"| {r['T']} | {r['max_anchors']} | {loss} | {r['backend']} | {r['layers']} | {_on(r['checkpointing'])} |"
        if "skipped" in r:
            print(f"{head} | skipped: {r['skipped']} | | |")
        else:
            print(f"{head} {r['elements']} | {r['step_s']:.2f} | {r['peak_mb']:.0f} | {r['base_mb']:.0f} |")
    if args.gradient_checkpointing:
        print("\n| T | max_anchors | attention | layers | peak MB kept / checkpointed | ratio | above base MB "
              "kept / checkpointed | ratio | step s kept / checkpointed | time ratio | loss equal |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        key = lambda r: (r["T"], r["max_anchors"], r["chunk"], r["backend"], r["layers"])  # noqa: E731
        pairs: dict = {}
        for r in rows:
            pairs.setdefault(key(r), {})[r["checkpointing"]] = r
        for (T, a, _, backend, layers), p in pairs.items():
            kept, ck = p.get(False), p.get(True)
            if kept is None or ck is None or "skipped" in kept or "skipped" in ck:
                why = "; ".join(f"{_on(m)}: {p[m]['skipped']}" for m in (False, True) if m in p and "skipped" in p[m])
                print(f"| {T} | {a} | {backend} | {layers} | {why} | | | | | | |")
                continue
            above = kept["peak_mb"] - kept["base_mb"], ck["peak_mb"] - ck["base_mb"]
            print(f"| {T} | {a} | {backend} | {layers} | {kept['peak_mb']:.0f} / {ck['peak_mb']:.0f} | "
                  f"{ck['peak_mb'] / kept['peak_mb']:.3f} | {above[0]:.0f} / {above[1]:.0f} | {above[1] / above[0]:.3f} | "
                  f"{kept['step_s']:.2f} / {ck['step_s']:.2f} | {ck['step_s'] / kept['step_s']:.3f} | "
                  f"{kept['loss'] == ck['loss']} |")


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def run_config(T: int, a: int | None, c: int | None, backend: str, args, layers: int = 1,
               checkpointing: bool = False) -> dict:
    """One configuration in a fresh subprocess (or the reason it was skipped)."""
    secs, logits_gb = estimate(T, a, args.draft_vocab, layers, checkpointing)
    row = {"T": T, "max_anchors": a, "chunk": c, "backend": backend, "layers": layers, "checkpointing": checkpointing,
           "est_step_s": round(secs, 1)}
    if secs > args.max_step_s:
        row["skipped"] = f"estimated {secs:.0f} s per step > {args.max_step_s:.0f} s"
    elif c is None and 4 * logits_gb > args.max_gb:
        row["skipped"] = f"unchunked logits alone ~{4 * logits_gb:.1f} GB > {args.max_gb:.0f} GB"
    else:
        cmd = [sys.executable, __file__, "--one", str(T), str(a).lower(), str(c).lower(), backend, str(layers),
               str(int(checkpointing)), "--draft-vocab", str(args.draft_vocab), "--steps", str(args.steps),
               "--max-gb", str(args.max_gb)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parents[1])
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        row.update(json.loads(lines[-1]) if lines else {"skipped": out.stderr[-200:]})
    return row


if __name__ == "__main__":
    main()
