"""peagle's DFlash training step against speculators' DFlash training step on the same store: time and memory,
the ratio from one run.

Both trainers take the same blocks of one feature store in the same order (peagle's block sequence for the
seed), with the same block size B (``--block-size``), anchor cap (``--max-anchors``), drafter layers
(``--num-layers``, Qwen3 layers of the verifier's shapes), draft vocabulary (peagle's ``--draft-vocab-size``
most frequent supervised tokens, given to speculators as ``t2d`` / ``d2t``), mask token, loss (forward KL to the
verifier, per-draft weights ``exp(-d / 4)``: peagle's DFlash default and speculators' ``fixed-exp-decay`` with
gamma 4), trained parameters (embedding and lm_head frozen in both: speculators freezes them, peagle runs with
``--freeze-embedding``), and optimizer (AdamW at ``--lr``, weight decay 0, peagle's warm-up and cosine schedule,
gradient clipping at 1.0).

- **peagle**: :func:`peagle_train.train.run.build_trainer` and ``Trainer.train_step`` with ``--method dflash``,
  as ``peagle-train`` runs them (anchors drawn by :func:`peagle_train.data.anchors.sample_anchors`, one dense
  ``[Q, T + Q]`` block mask, sdpa, chunked KL over the supervised slots).
- **speculators**: the released 0.9.0 ``DFlashDraftModel`` (``bench/speculators_ref.py``), built by its own
  ``from_training_args`` from the verifier's config with ``num_hidden_layers`` set to ``--num-layers``, trained
  by its own ``forward`` (its ``select_anchors``, block mask, layers and ``compute_metrics`` loss) with its
  ``get_trainer_kwargs`` settings except ``max_anchors``; the store's rows go in as they are (speculators'
  DFlash reads row ``p + j - 1``'s verifier state and ``loss_mask[p + j]`` for slot j, as peagle does), the
  segment index as ``document_ids``, the store's ``position_ids``.

Where the two cannot be set up identically (printed under ``"differences"`` too):
- attention: speculators' default ``simple_flex_attention`` has no backward on CPU, so its ``sdpa`` path runs
  (``create_mask``: a dense boolean mask from its mask function); peagle's block mask is dense too.
- loss implementation: speculators' ``eager`` (its default ``fused`` needs Triton); it scores every slot of
  every block against the full draft vocabulary and masks after, peagle scores only slots with a weight.
- anchors: the same cap, not the same rows. speculators draws from the global RNG (seeded per step here) among
  supervised rows outside the row's last B, always running ``max_anchors`` blocks (blocks beyond the candidates
  are padding with weight 0); peagle draws from an explicit generator among supervised rows with context before
  them in their segment and a supervised slot, and runs only those. The anchors of both are printed per step:
  with ``--max-anchors`` at most every block's candidates, both run the same number of blocks.
- verifier norm: the store's final hidden state is after the verifier's final norm, so speculators'
  ``verifier_norm`` is the identity (it normally receives the state before the norm).

Measured: the wall time of each training step (forward, backward, clipping, optimizer; for speculators also
its batch's views of the block), the median over the steps after ``--warmup``; and peak memory as the
process's resident high-water mark (``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs``
once the trainer is set up) above its resident size at that moment, over all steps (warm-up included: the
optimizer's state is allocated in the first). CPU torch keeps no allocator statistics, so this is resident
memory (RSS), not torch's allocated bytes. Each trainer runs in its own worker process (so each peak is its
own), and their steps alternate (one peagle step, one speculators step, the first of a pair swapping each
time), so a busy machine slows both alike. The ratios are peagle / speculators: below 1, peagle is faster or
smaller.

Usage (from the repository root, inside .venv with ``PEAGLE_BENCH=1 bash scripts/setup_env.sh`` done):
    python bench/bench_dflash_train.py --store demo/features.zarr --steps 20 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).parent))
import speculators_ref  # noqa: E402
from bench_quality_vs_speculators import peak_mib, reset_peak  # noqa: E402

import peagle_train  # noqa: E402
from peagle_train.data.cod import segment_ids  # noqa: E402
from peagle_train.data.loader import BlockLoader  # noqa: E402
from peagle_train.train.config import DFLASH_DECAY_GAMMA, TrainConfig  # noqa: E402
from peagle_train.train.optim import CosineWithWarmup  # noqa: E402
from peagle_train.train.run import build_trainer  # noqa: E402
from peagle_train.train.step import cod_generator  # noqa: E402
from runtime.model_cache import resolve_model  # noqa: E402
from stores.features.feature_schema import Block  # noqa: E402

TRAINERS = ("peagle", "speculators")

DIFFERENCES = [
    "attention: speculators runs its sdpa path (its default simple_flex_attention has no backward on CPU), a dense "
    "boolean mask from its mask function; peagle's block mask is dense too",
    "loss implementation: speculators' eager (fused needs Triton), over every slot of every block, masked after; "
    "peagle scores only the slots with a weight",
    "anchors: the same cap, not the same rows: speculators draws them from the global RNG (seeded per step) among "
    "supervised rows outside the row's last B and always runs max_anchors blocks (padding beyond its candidates); "
    "peagle draws from its generator among supervised rows with context and a supervised slot, and runs only those",
    "verifier norm: identity in speculators (the store's final state is already after the verifier's final norm)",
]


def train_config(args: argparse.Namespace, output: Path) -> TrainConfig:
    """The peagle run both trainers follow: ``--method dflash`` with the bench's settings, embedding frozen, every
    block a training block (``--val-fraction 0``: no validation runs)."""
    return TrainConfig.from_flat(
        store=args.store, output=str(output), method="dflash", block_size=args.block_size,
        max_anchors=args.max_anchors, num_layers=args.num_layers, draft_vocab_size=args.draft_vocab_size,
        lr=args.lr, seed=args.seed, max_steps=args.warmup + args.steps, train_embedding=False, val_fraction=0.0,
        save_every=None, force=True)


def speculators_inputs(block: Block, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A store block as speculators' DFlash ``forward`` takes it, rows unshifted: ``hidden_states [1, T, L*H]``,
    ``verifier_last_hidden_states [1, T, H]`` (``dtype``), ``input_ids``, ``position_ids``, ``document_ids``
    (the segment of each row) ``[1, T] int64`` and ``loss_mask [1, T]`` (``dtype``)."""
    T = block.input_ids.numel()
    return {"hidden_states": block.aux_hidden.reshape(T, -1).to(dtype)[None],
            "verifier_last_hidden_states": block.final_hidden.to(dtype)[None],
            "input_ids": block.input_ids.long()[None], "position_ids": block.position_ids.long()[None],
            "document_ids": segment_ids(block.cu_seqlens).long()[None], "loss_mask": block.loss_mask.to(dtype)[None]}


def speculators_anchor_count(loss_mask: torch.Tensor, block_size: int, max_anchors: int) -> int:
    """Blocks speculators' ``select_anchors`` fills with a real anchor: its candidates (supervised rows outside
    the row's last ``block_size``), at most ``max_anchors``; it runs ``max_anchors`` blocks whatever this is."""
    valid = loss_mask.bool().clone()
    valid[-block_size:] = False
    return min(int(valid.sum()), max_anchors)


class SpeculatorsDFlash:
    """speculators' ``DFlashDraftModel`` and loss with peagle's optimizer settings and schedule, set up as the
    peagle ``trainer`` (its verifier, aux layers, draft vocab, mask token, steps and warm-up)."""

    def __init__(self, trainer, cfg: TrainConfig):
        spec = speculators_ref.speculators_dflash()
        model = trainer.unwrapped
        verifier_dir = str(resolve_model(trainer.run.store.attrs["verifier"]["name_or_path"]))
        vc = copy.deepcopy(AutoConfig.from_pretrained(verifier_dir))
        vc.num_hidden_layers = cfg.model.num_layers
        V, D = model.config.vocab_size, model.config.draft_vocab_size
        d2t = t2d = None
        if D != V:
            d2t = model.d2t.clone()
            t2d = torch.zeros(V, dtype=torch.bool)
            t2d[torch.arange(D) + d2t] = True
        torch.manual_seed(cfg.run.seed)
        self.model = spec.DFlashDraftModel.from_training_args(
            vc, t2d=t2d, d2t=d2t, draft_vocab_size=D, mask_token_id=int(model.config.mask_token_id),
            verifier_name_or_path=verifier_dir, target_layer_ids=list(model.config.aux_layer_ids),
            block_size=cfg.model.block_size, draft_attn_impl="sdpa")
        self.model.verifier_norm = torch.nn.Identity()  # the store's final state is after the final norm
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           CosineWithWarmup(trainer.warmup, trainer.max_steps))
        kwargs, _ = spec.DFlashDraftModel.get_trainer_kwargs(loss_fn=cfg.optim.loss, loss_implementation="eager",
                                                             dflash_decay_gamma=DFLASH_DECAY_GAMMA)
        self.kwargs = {**kwargs, "max_anchors": cfg.data.max_anchors}
        self.cfg, self.dtype = cfg, next(self.model.parameters()).dtype

    def train_step(self, block: Block) -> float:
        """One optimizer step on ``block``; its loss."""
        _, loss, _ = self.model(**speculators_inputs(block, self.dtype), **self.kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def worker(name: str, args: argparse.Namespace) -> None:
    """One trainer in this process, driven through stdin / stdout JSON lines: after set-up it prints its set-up
    line; then ``step`` runs the next block's step (printing ``s``, ``loss``, ``anchors``, ``blocks``), ``peak``
    prints its memory, ``quit`` ends it."""
    torch.set_num_threads(args.threads)
    cfg = train_config(args, Path(args.output))
    trainer = build_trainer(cfg)
    B, cap = cfg.model.block_size, cfg.data.max_anchors
    spec = SpeculatorsDFlash(trainer, cfg) if name == "speculators" else None
    model = spec.model if spec is not None else trainer.unwrapped
    setup = {"trainer": name, "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype),
             "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
             "block_size": B, "max_anchors": cap, "num_layers": cfg.model.num_layers,
             "draft_vocab_size": int(trainer.unwrapped.config.draft_vocab_size),
             "mask_token_id": int(trainer.unwrapped.config.mask_token_id)}
    run = trainer.run
    if spec is not None:
        trainer.close()  # speculators' worker keeps only the run's store and block sequence
    loader = BlockLoader(run.store, run.sequence, cursor=0, grad_accum=1)
    batches = iter(loader)
    rss0 = reset_peak()
    print(json.dumps(setup), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            cursor, block = next(batches)
            t0 = time.perf_counter()
            if spec is None:
                row = trainer.train_step([(block, cod_generator(cfg.run.seed, cursor))])
                loss, anchors = row["loss"], row["n_elements"] // B
            else:
                torch.manual_seed(cfg.run.seed + cursor)  # speculators' select_anchors draws from the global RNG
                loss = spec.train_step(block)
                anchors = speculators_anchor_count(block.loss_mask, B, cap)
            dt = time.perf_counter() - t0
            print(json.dumps({"s": dt, "loss": loss, "anchors": anchors, "block": block.block_id}), flush=True)
        elif cmd == "peak":
            peak = peak_mib()
            print(json.dumps({"setup_rss_mib": rss0, "peak_rss_mib": peak, "peak_above_setup_mib": peak - rss0}),
                  flush=True)
        elif cmd == "quit":
            break
    loader.close()


class Worker:
    """A :func:`worker` subprocess: ``ask(cmd)`` sends one command and returns its JSON answer."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        root = str(Path(peagle_train.__file__).resolve().parents[1])  # the workers import this process's peagle
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        self.proc = subprocess.Popen([sys.executable, __file__, *argv, "--worker", name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": path})
        self.setup = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (exit {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def summarise(steps: dict[str, list[dict]], peaks: dict[str, dict], warmup: int) -> dict:
    """Per trainer: the median step wall time over the steps after ``warmup``, the loss and anchors of each step,
    the memory of :func:`worker`'s ``peak``; and the peagle / speculators ratios."""
    out = {}
    for name, rows in steps.items():
        timed = rows[warmup:]
        out[name] = {"median_step_s": statistics.median(r["s"] for r in timed), "timed_steps": len(timed),
                     "step_s": [round(r["s"], 4) for r in rows], "loss": [round(r["loss"], 4) for r in rows],
                     "anchors": [r["anchors"] for r in rows], **peaks[name]}
    p, s = out["peagle"], out["speculators"]
    out["ratio"] = {"step_time": p["median_step_s"] / s["median_step_s"],
                    "peak_memory": (p["peak_above_setup_mib"] / s["peak_above_setup_mib"]
                                    if s["peak_above_setup_mib"] > 0 else None)}  # None: no growth to compare
    return out


def run_bench(args: argparse.Namespace, argv: list[str]) -> dict:
    """Start both workers (one after the other: both set up the same run), alternate their steps, gather."""
    with tempfile.TemporaryDirectory(prefix="peagle-dflash-bench-") as tmp:
        argv = [*argv, "--output", str(Path(tmp) / "peagle-run")]
        workers = {}
        try:
            for name in TRAINERS:
                workers[name] = Worker(name, argv)
            blocks = {name: [] for name in TRAINERS}
            for i in range(args.warmup + args.steps):
                for name in (TRAINERS if i % 2 == 0 else TRAINERS[::-1]):
                    blocks[name].append(workers[name].ask("step"))
            peaks = {name: w.ask("peak") for name, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
    if [r["block"] for r in blocks["peagle"]] != [r["block"] for r in blocks["speculators"]]:
        raise RuntimeError("the two trainers read different blocks")
    setups = {name: w.setup for name, w in workers.items()}
    return {"store": args.store, "torch": torch.__version__, "speculators": speculators_ref.VERSION,
            "settings": {k: getattr(args, k) for k in ("block_size", "max_anchors", "num_layers", "draft_vocab_size",
                                                       "lr", "seed", "steps", "warmup", "threads")},
            "blocks": [r["block"] for r in blocks["peagle"]], "setup": setups,
            "memory": "resident set size (VmHWM above VmRSS after set-up, /proc/self), not torch allocator stats",
            "differences": DIFFERENCES, **summarise(blocks, peaks, args.warmup)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, help="a feature store (peagle-data extract)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per trainer (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3, help="steps per trainer left out of the time median")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--max-anchors", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    ap.add_argument("--worker", choices=TRAINERS, help=argparse.SUPPRESS)
    ap.add_argument("--output", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser().error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.worker is not None:
        return worker(args.worker, args)
    result = run_bench(args, argv)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
