"""peagle's trainer against speculators' P-EAGLE model and loss on the same data, in one run (issue 23).

Both trainers take the same blocks of a feature store in the same order (peagle's block sequence for
the seed), with the same K (``--num-depths``), COD ratios r / r_min, ``max_anchors``, AdamW with the same
lr, weight decay and schedule (peagle's linear warm-up over ``max_steps // 20`` steps, then cosine to 0),
gradient clipping at 1.0, steps, draft vocab (peagle's, the ``--draft-vocab-size`` most frequent
supervised tokens, given to speculators as ``t2d``/``d2t``), mask token and seed. Their steps alternate,
one peagle step then one speculators step on the same block, so a busy machine slows both alike.

- **peagle**: :func:`peagle_train.train.run.build_trainer` and ``Trainer.train_step``, as
  ``peagle-train`` runs them (its checkpoints are ``peagle-train``'s).
- **speculators**: the released 0.9.0 ``PEagleDraftModel``, built by its own ``from_training_args`` from
  the verifier's config with ``num_hidden_layers`` set to ``--num-layers`` (its first-layer class and
  decoder layers, its verifier-weight loading: embeddings trained, lm_head and verifier head frozen, as
  peagle) and trained by its own ``forward`` (its COD sampling, mask, KL via ``compound_loss`` with the
  ``eager`` implementation; the fused one needs Triton). Adapted to the store, and only that: its
  input is each segment shifted as its ``shift_batch`` does (token ``x[t+1]``, features ``g[t]``, target
  state ``y[t+1]`` and ``loss_mask[t+1]`` side by side), segments concatenated with their document ids;
  its ``verifier_norm`` is the identity, because the store's final state is already after the verifier's
  final norm (speculators normally receives it before); its attention runs on ``sdpa`` with a dense
  mask (flex attention has no backward on CPU). Its checkpoints are its own ``save_pretrained``.
  Training time per step includes its optimizer's dense update of the 49152-row embedding, where
  peagle updates only the rows a step touched (``LazyRowAdamW``): that is part of each trainer.

Time per step is the median wall time of a step (forward, backward, clipping, optimizer), the first 5
steps left out. Peak memory needs one trainer per process (``--trainers peagle`` or ``--trainers
speculators``, a few dozen steps): the resident high-water mark over the training steps above the
resident size once everything is set up (VmHWM, reset through ``/proc/self/clear_refs``); a run of both
trainers leaves it out, since each reuses the pages the other freed.

Checkpoints land in ``OUT/peagle-L{n}/checkpoint-{step}`` and ``OUT/speculators-L{n}/checkpoint-{step}``
every ``--save-every`` steps and at the end; ``OUT/speculators-L{n}/summary.json`` and
``OUT/peagle-L{n}/summary.json`` hold the timings. Evaluate them all with the same code, peagle-eval
(offline per-depth acceptance on a held-out store, online AL, AL served by vLLM): the commands are in
docs/benchmarks.md, "peagle against speculators: drafter quality (issue 23)".

``--peagle-loss-mask shifted`` (an ablation) trains the peagle drafter on each block's ``loss_mask``
moved one token later inside each segment, so that its element ``(a, d)`` has speculators' weight
``m[a+d+1]`` (and its COD seeds speculators' seeds) instead of its own ``m[a+d+2]``.

``--peagle-mask-hidden-std STD`` (an ablation) draws peagle's ``mask_hidden`` from normal(0, STD), as
speculators draws its own from normal(0, 1), instead of normal(0, 0.02).

``--init-layers verifier`` trains the peagle drafter with ``peagle-train --init-layers verifier`` (its
decoder layers from the verifier's last ones) instead; ``--trainers peagle`` trains peagle alone.

Usage (from the repository root, inside .venv with ``PEAGLE_BENCH=1 bash scripts/setup_env.sh`` done):
    OMP_NUM_THREADS=2 python bench/bench_quality_vs_speculators.py --store quality/features.zarr \\
        --out bench_out/sbs --num-layers 1 --steps 600 --save-every 200
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import speculators_ref  # noqa: E402

from peagle_train.data.loader import BlockLoader  # noqa: E402
from peagle_train.train.config import TrainConfig  # noqa: E402
from peagle_train.train.optim import CosineWithWarmup  # noqa: E402
from peagle_train.train.run import build_trainer  # noqa: E402
from peagle_train.train.step import cod_generator  # noqa: E402
from stores.features.feature_schema import Block  # noqa: E402
from runtime.model_cache import resolve_model  # noqa: E402

WARM_STEPS = 5
"""Steps left out of the time and memory medians (allocator and page-cache warm-up)."""


def rss_mib() -> float:
    """Resident set size now (MiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def reset_peak() -> float:
    """Reset the resident high-water mark (VmHWM) to the resident size now; returns that size (MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_mib()


def peak_mib() -> float:
    """The resident high-water mark (VmHWM, MiB) since the last :func:`reset_peak`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def timed(fn):
    """``(fn(), wall seconds)``."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def mask_shifted_right(block: Block) -> Block:
    """``block`` with its ``loss_mask`` moved one token later inside every segment (``m'[t] = m[t-1]``,
    0 at a segment's first token): peagle's element ``(a, d)`` then has speculators' weight
    ``m[a+d+1]`` (and its COD seeds speculators' seeds) instead of ``m[a+d+2]``. For the loss-weight
    ablation (``--peagle-loss-mask shifted``) only."""
    m = torch.zeros_like(block.loss_mask)
    m[1:] = block.loss_mask[:-1]
    starts = block.cu_seqlens[:-1]
    m[starts[starts < m.numel()]] = 0
    return dataclasses.replace(block, loss_mask=m)


def speculators_batch(block: Block, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A store block (``aux_hidden [T, L*H]``) as speculators' P-EAGLE ``forward`` takes it: every segment
    shifted by one as ``speculators.models.eagle3.data.shift_batch`` does, concatenated, with the segment
    index as ``document_ids``. Shapes ``[1, T - S, ...]`` for S segments."""
    cu = block.cu_seqlens.tolist()
    ids, g, y, lm, doc = [], [], [], [], []
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if b - a < 2:
            continue
        ids.append(block.input_ids[a + 1:b])
        g.append(block.aux_hidden[a:b - 1])
        y.append(block.final_hidden[a + 1:b])
        lm.append(block.loss_mask[a + 1:b])
        doc.append(torch.full((b - a - 1,), s, dtype=torch.long))
    return {"input_ids": torch.cat(ids)[None], "hidden_states": torch.cat(g).to(dtype)[None],
            "verifier_last_hidden_states": torch.cat(y).to(dtype)[None],
            "loss_mask": torch.cat(lm).to(dtype)[None], "document_ids": torch.cat(doc)[None]}


class SpeculatorsTrainer:
    """speculators' ``PEagleDraftModel`` and loss, with peagle's optimizer settings and schedule."""

    def __init__(self, spec, verifier_dir: str, layers: list[int], num_layers: int, d2t: torch.Tensor | None,
                 vocab_size: int, mask_token_id: int, cfg: TrainConfig, max_steps: int, warmup: int):
        from transformers import AutoConfig

        vc = copy.deepcopy(AutoConfig.from_pretrained(verifier_dir))
        vc.num_hidden_layers = num_layers
        D = vocab_size if d2t is None else int(d2t.numel())
        t2d = None
        if d2t is not None:
            ids = torch.arange(D) + d2t
            t2d = torch.zeros(vocab_size, dtype=torch.bool)
            t2d[ids] = True
        torch.manual_seed(cfg.run.seed)
        self.model = spec.PEagleDraftModel.from_training_args(
            vc, t2d=t2d, d2t=d2t, draft_vocab_size=D, mask_token_id=mask_token_id, verifier_name_or_path=verifier_dir,
            target_layer_ids=layers, num_depths=cfg.model.num_depths, draft_attn_impl="sdpa")
        self.model.verifier_norm = torch.nn.Identity()  # the store's final state is after the final norm
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, CosineWithWarmup(warmup, max_steps))
        self.loss_config = spec.resolve_loss_config("kl_div", "eager")
        self.cfg = cfg
        self.dtype = next(self.model.parameters()).dtype

    def train_step(self, block: Block) -> dict:
        batch = speculators_batch(block, self.dtype)
        d = self.cfg.data
        _, loss, metrics = self.model(**batch, loss_config=self.loss_config, max_anchors=d.max_anchors,
                                      num_depths=self.cfg.model.num_depths, down_sample_ratio=d.down_sample_ratio,
                                      down_sample_ratio_min=d.down_sample_ratio_min)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        acc = [float(metrics[f"position_{k}_acc_sum"]) / max(1.0, float(metrics[f"position_{k}_acc_total"]))
               for k in range(self.cfg.model.num_depths)]
        return {"loss": float(loss), "acc": acc, "grad_norm": grad_norm}

    def save(self, path: Path) -> None:
        self.model.save_pretrained(str(path))


def speculators_trainer_for(trainer, cfg: TrainConfig) -> SpeculatorsTrainer:
    """speculators' drafter and loss set up as peagle's ``trainer`` (built from ``cfg`` by
    :func:`~peagle_train.train.run.build_trainer`): its verifier, aux layers, ``num_layers``, draft vocab
    (peagle's d2t), mask token, steps and warm-up; it then trains on the same block sequence."""
    model, run = trainer.unwrapped, trainer.run
    reduced = model.config.draft_vocab_size != model.config.vocab_size
    return SpeculatorsTrainer(speculators_ref.speculators_peagle(),
                              str(resolve_model(run.store.attrs["verifier"]["name_or_path"])),
                              list(model.config.aux_layer_ids), cfg.model.num_layers,
                              model.d2t.clone() if reduced else None, model.config.vocab_size,
                              int(model.config.mask_token_id), cfg, trainer.max_steps, trainer.warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--num-depths", type=int, default=4)
    ap.add_argument("--down-sample-ratio", type=float, default=0.5)
    ap.add_argument("--down-sample-ratio-min", type=float, default=0.2)
    ap.add_argument("--max-anchors", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-layers", choices=("random", "verifier"), default="random")
    ap.add_argument("--trainers", default="peagle,speculators")
    ap.add_argument("--peagle-mask-hidden-std", type=float, default=None,
                    help="draw peagle's mask_hidden from normal(0, STD) (speculators: 1.0; an ablation)")
    ap.add_argument("--peagle-loss-mask", choices=("own", "shifted"), default="own",
                    help="shifted: peagle trains with speculators' loss weights m[a+d+1] (an ablation)")
    args = ap.parse_args()
    trainers = args.trainers.split(",")
    ablations = [f for f, on in (("--peagle-mask-hidden-std", args.peagle_mask_hidden_std is not None),
                                 ("--peagle-loss-mask shifted", args.peagle_loss_mask == "shifted")) if on]
    if ablations and "peagle" not in trainers:
        ap.error(f"{' and '.join(ablations)} change only the peagle drafter, which --trainers {args.trainers} "
                 "does not train")
    if args.peagle_mask_hidden_std is not None and not args.peagle_mask_hidden_std > 0:
        ap.error(f"--peagle-mask-hidden-std must be > 0, got {args.peagle_mask_hidden_std}")
    n = args.num_layers
    tag = f"L{n}" + ("-verifier-init" if args.init_layers == "verifier" else "") + \
        ("-mask-shifted" if args.peagle_loss_mask == "shifted" else "") + \
        (f"-mask-hidden-std{args.peagle_mask_hidden_std:g}" if args.peagle_mask_hidden_std is not None else "")
    cfg = TrainConfig.from_flat(
        store=args.store, output=str(args.out / f"peagle-{tag}"), max_steps=args.steps, num_depths=args.num_depths,
        down_sample_ratio=args.down_sample_ratio, down_sample_ratio_min=args.down_sample_ratio_min,
        max_anchors=args.max_anchors, lr=args.lr, draft_vocab_size=args.draft_vocab_size, num_layers=n,
        seed=args.seed, save_every=None, force=True, init_layers=args.init_layers)
    trainer = build_trainer(cfg)
    run = trainer.run
    model = trainer.unwrapped
    mask_id = int(model.config.mask_token_id)
    if args.peagle_mask_hidden_std is not None:  # before any step: the optimizer holds no state yet
        with torch.no_grad():
            model.mask_hidden.normal_(0.0, args.peagle_mask_hidden_std,
                                      generator=torch.Generator().manual_seed(args.seed))
    layers = list(model.config.aux_layer_ids)
    spec = speculators_trainer_for(trainer, cfg) if "speculators" in trainers else None
    spec_dir = args.out / f"speculators-L{n}"
    loader = BlockLoader(run.store, run.sequence, cursor=0, grad_accum=1)
    batches = iter(loader)
    rows = {"peagle": [], "speculators": []}
    trainer.model.train()
    rss0 = reset_peak()
    print(f"{n}-layer drafters, {args.steps} steps, K {args.num_depths}, r {args.down_sample_ratio}, "
          f"r_min {args.down_sample_ratio_min}, max_anchors {args.max_anchors}, lr {args.lr}, "
          f"draft vocab {model.config.draft_vocab_size}, mask token {mask_id}, layers {layers}", flush=True)
    try:
        for step in range(1, args.steps + 1):
            cursor, block = next(batches)
            if "peagle" in trainers:
                own = mask_shifted_right(block) if args.peagle_loss_mask == "shifted" else block
                row, dt = timed(lambda: trainer.train_step([(own, cod_generator(cfg.run.seed, cursor))]))
                rows["peagle"].append({"step": step, "loss": row["loss"], "acc": row["acc"], "s": dt,
                                       "tokens": block.n_tokens})
            if spec is not None:
                row, dt = timed(lambda: spec.train_step(block))
                rows["speculators"].append({"step": step, "s": dt, "tokens": block.n_tokens, **row})
            if step % 20 == 0 or step == args.steps:
                shown = "  ".join(f"{k} loss {r[-1]['loss']:.3f} {r[-1]['s']:.2f}s" for k, r in rows.items() if r)
                print(f"step {step}: {shown}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                if "peagle" in trainers:
                    trainer.save(f"checkpoint-{step}")
                if spec is not None:
                    spec.save(spec_dir / f"checkpoint-{step}")
    finally:
        loader.close()
    peak = peak_mib() - rss0 if len([r for r in rows.values() if r]) == 1 else None  # saves included
    for name, r in rows.items():
        if not r:
            continue
        steady = r[WARM_STEPS:] or r
        summary = {"trainer": name, "num_layers": n, "init_layers": args.init_layers if name == "peagle" else "random",
                   "steps": len(r), "median_step_s": statistics.median(x["s"] for x in steady),
                   "peak_mib_above_setup": peak, "tokens": sum(x["tokens"] for x in r),
                   "last_loss_mean_20": statistics.fmean(x["loss"] for x in r[-20:]), "rows": r}
        out = (args.out / f"peagle-{tag}" if name == "peagle" else spec_dir) / "summary.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
        shown = f"{peak:.0f} MiB" if peak is not None else "not measured (two trainers in one process)"
        print(f"{name}: median step {summary['median_step_s']:.3f} s, peak memory above the set-up {shown}, "
              f"mean loss of the last 20 steps {summary['last_loss_mean_20']:.4f}")
    trainer.close()


if __name__ == "__main__":
    main()
