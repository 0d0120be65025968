"""The P-EAGLE trainer (docs/design.md §8): :class:`Trainer`, built by
:func:`peagle_train.train.run.build_trainer`.

Legend: T tokens in a block, E drafter elements, H hidden size, D draft vocab, K ``num_depths``.

One optimizer step (:meth:`Trainer.train_step`) reads ``grad_accum`` packed blocks (one per
micro-step). For each block: COD sampling (:mod:`peagle_train.data.cod`) with a generator seeded from
``(seed, block position)`` (:func:`cod_generator`), the §8 attention of the run's backend
(:mod:`peagle_train.model.attention`), one drafter forward, and the chunked weighted KL to the verifier's
stored final hidden states (:mod:`peagle_train.train.loss`). The step optimises the pooled objective
``Σ w·KL / Σ w`` over all its blocks and data-parallel ranks (:func:`accumulate_step`), the loss
``metrics.jsonl`` records (:mod:`peagle_train.train.metrics`).

The output directory a run writes is described in :mod:`peagle_train.train.run`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from peagle_train.data.cod import CodElements
from peagle_train.data.loader import Block, BlockLoader, BlockSequence, data_state, derive_seed, to_block
from peagle_train.data.stream import StreamingStore
from peagle_train.model.checkpoint import prune_checkpoints
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.train.checkpointer import Checkpointer
from peagle_train.train.config import TrainConfig
from peagle_train.train.kinds import DrafterKind
from peagle_train.train.loss import LogitTransform, LossOutput
from peagle_train.train.metrics import MetricsLog, plot_metrics, pooled_accuracy
from peagle_train.train.optim import CosineWithWarmup, build_optimizer, clip_grad_norm
from peagle_train.train.step import accumulate_step, add_sums, block_to, cod_generator, gather_ids, summarise
from stores.errors import NonFiniteError
from runtime.progress import progress

__all__ = ["Trainer", "TrainRun"]


@dataclass
class TrainRun:
    """What a full run adds to a :class:`Trainer`: its data, output directory and log.

    Attributes:
        store: the open ``FeatureStore`` (or ``StoreSet``).
        sequence: the run's training blocks in order (its ``usable`` ones are :attr:`train_ids`).
        val_ids: ``[m] int64`` the extracted blocks of the validation side, sorted.
        output: the output directory.
        metrics: the run's ``metrics.jsonl`` and trackers.
        info: recorded in every saved drafter's ``config.json`` under ``peagle_training`` (with the
            step), so evaluation finds the held-out split.
        summary: constant entries of :meth:`Trainer.train`'s summary (draft vocab size, mask token).
        resumed_from: the checkpoint the run continues, or None.
    """

    store: Any
    sequence: BlockSequence
    val_ids: np.ndarray
    output: Path
    metrics: MetricsLog
    info: dict[str, Any]
    summary: dict[str, Any]
    resumed_from: Path | None = None
    stream: StreamingStore | None = None
    """A streaming run's store (:attr:`store` itself; its session holds the plan and the cursor); None: the store
    is complete."""
    training_segments: np.ndarray | None = None
    """``[M] uint64`` hashes of the training side's segments, written into every saved drafter
    (:data:`~peagle_train.model.checkpoint.TRAINING_SEGMENTS_FILE`); None: not recorded."""

    @property
    def train_ids(self) -> np.ndarray:
        """``[n] int64`` the extracted blocks of the train side, sorted."""
        return self.sequence.usable


class Trainer:
    """Optimises one drafter: steps, validation, checkpoints (torchtitan's shape).

    ``train_step`` needs only the model; ``train``, ``validate`` and ``save`` need the ``run``.

    Args:
        cfg: the run's settings (``grad_accum``, ``grad_clip``, COD and loss settings, ``lr``, ...).
        model: the drafter (not yet prepared); its trainable parameters get a
            :func:`build_optimizer` optimizer and a :class:`CosineWithWarmup` schedule.
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab, on the device.
        accelerator: an ``accelerate.Accelerator``; None: a fresh one on the CPU.
        attention: the resolved attention backend, a key of
            :data:`peagle_train.model.attention.ATTENTION_BACKENDS`.
        max_steps: optimizer steps of the run (the schedule's length); warmup: its warm-up steps
            (None: ``max_steps // 20``).
        run: the data and output of a full run (None for a bare step, e.g. in a benchmark).
    """

    def __init__(self, cfg: TrainConfig, model: PEagleDrafter, verifier_head: torch.Tensor, *, kind: DrafterKind,
                 accelerator=None, attention: str = "sdpa", max_steps: int = 1, warmup: int | None = None,
                 run: TrainRun | None = None, logit_transform: LogitTransform | None = None):
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=True)
        self.cfg, self.accelerator, self.attention, self.run = cfg, accelerator, attention, run
        self.kind = kind  # samples, loss and checkpoint format of the drafter (``--method``)
        self.verifier_head, self.max_steps = verifier_head, max_steps
        self.logit_transform = logit_transform  # the verifier's soft-capping / logit scaling, None: identity
        self.warmup = warmup if warmup is not None else max_steps // 20
        self.world, self.rank = accelerator.num_processes, accelerator.process_index
        self.main = accelerator.is_main_process
        self.params = [p for p in model.parameters() if p.requires_grad]
        # a sparse embedding gradient never exists densely; DDP all-reduce needs it dense (NCCL)
        model.embed_tokens.sparse = cfg.optim.lazy_embedding and self.world == 1
        model.gradient_checkpointing = cfg.optim.gradient_checkpointing
        optimizer = build_optimizer(model, cfg.optim)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineWithWarmup(self.warmup, max_steps))
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.unwrapped = accelerator.unwrap_model(self.model)
        self.step, self.tokens_total = 0, 0
        self.resumed_step: int | None = None  # the step of the checkpoint a resumed run continues from
        self.cursor = 0  # the run's block-sequence cursor after the last step (all ranks)
        self.loader: BlockLoader | None = None
        self.recent: list[dict[str, torch.Tensor]] = []  # the last 10 steps' sums, for the pooled accuracy
        self.last_row: dict | None = None
        self.checkpointer = Checkpointer(
            cfg.run, max_steps, accelerator, self.save, blocks_per_step=self.world * cfg.optim.grad_accum,
            validates=run is not None and len(run.val_ids) > 0, stream=run.stream if run is not None else None)
        """When the run saves, validates and lets a streaming extraction move on."""

    # ---------------------------------------------------------------------------------- one step
    def train_step(self, batches: Iterable[tuple[Block, torch.Generator]]) -> dict[str, Any]:
        """One optimizer step over ``cfg.optim.grad_accum`` micro-batches (``block``, COD generator).

        Blocks may be on the CPU (moved to the device here). Returns the step's ``metrics.jsonl``
        row: ``step``, ``loss`` (the pooled objective), ``acc [K]`` (None for a depth without
        weight), ``tokens_per_s``, ``lr`` (of this step), ``n_elements`` (all ranks'), ``blocks`` (every
        rank's ids), ``weight`` (``Σ λ_d m``), ``depth_elements [K]`` (the supervised elements of each depth,
        ``Σ m``: what COD fed each depth), ``step_s``, ``grad_norm`` (before clipping).

        Raises:
            NonFiniteError: the pooled loss or the gradient norm is NaN or infinite, naming the step and
                every rank's blocks; raised before the optimizer step, so the weights stay those of the
                last step.
        """
        cfg, device = self.cfg, self.accelerator.device
        t0 = time.perf_counter()
        seen, sizes = [], []

        def micro_batches() -> Iterator[tuple[Block, CodElements]]:
            for block, gen in batches:
                block = block_to(block, device)
                elements = self.kind.sample(block, cfg, gen).to(device)
                seen.append(block.block_id)
                sizes.append((block.n_tokens, len(elements)))
                yield block, elements

        sums = accumulate_step(self.accelerator, self.model, self.params, micro_batches(), cfg.optim.grad_accum,
                               self._loss)
        grad_norm = float(clip_grad_norm(self.params, cfg.optim.grad_clip))
        loss, acc = summarise(sums)
        blocks = gather_ids(self.accelerator, seen)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # the same on every rank: pooled, all-reduced
            raise NonFiniteError(
                f"step {self.step + 1}: the loss is {loss} and the gradient norm {grad_norm} on blocks {blocks} "
                "(every rank's); the run stops before this step's update, so no checkpoint or metrics row holds "
                f"it. Check those blocks' features (`peagle-data verify {self.run.store.path if self.run else 'STORE'}`) "
                "and the settings (--lr, --grad-clip)")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        dt = time.perf_counter() - t0
        n_tokens, n_elements = self._all_ranks_sum([sum(t for t, _ in sizes), sum(e for _, e in sizes)])
        self.tokens_total += n_tokens
        pooled = {k: sums[k].detach().cpu() for k in ("correct", "counts")}
        self.recent = [*self.recent[-9:], {"step": self.step, **pooled}]
        self.last_row = {"split": "train", "step": self.step, "loss": loss, "acc": acc,
                         "tokens_per_s": n_tokens / dt, "lr": lr, "n_elements": n_elements,
                         "blocks": blocks, "weight": float(sums["weight_sum"].sum()),
                         "depth_elements": [int(c) for c in sums["counts"].tolist()],
                         "step_s": dt, "grad_norm": grad_norm}
        return self.last_row

    def _all_ranks_sum(self, values: list[int]) -> list[int]:
        """``values`` summed over the data-parallel ranks (the step's tokens and elements of all its blocks)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.accelerator.device)
        return [int(x) for x in self.accelerator.reduce(t, reduction="sum").tolist()]

    def _loss(self, item: tuple[Block, CodElements]) -> LossOutput:
        with self.accelerator.autocast():
            return self.kind.loss(self.model, self.unwrapped.lm_head.weight, self.verifier_head, *item, self.cfg,
                                  self.attention, self.logit_transform)

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Loss and per-depth accuracy on the first ``cfg.data.val_max_blocks`` held-out blocks (by id),
        each COD-sampled with its fixed seed: ``{"val_loss", "val_acc", "blocks"}`` (``blocks``: the
        ids scored; a resume after more held-out blocks were extracted may score more), ``{}``
        without held-out blocks.

        Raises:
            NonFiniteError: a block's loss is NaN or infinite, naming the step and those blocks.
        """
        cfg, device, was_training = self.cfg, self.accelerator.device, self.model.training
        self.model.eval()
        sums, nonfinite = None, []
        scored = [int(b) for b in self.run.val_ids[: cfg.data.val_max_blocks]]
        for bid in scored:
            block = block_to(to_block(bid, self.run.store.read_block(bid)), device)
            el = self.kind.sample(block, cfg, torch.Generator().manual_seed(derive_seed(cfg.run.seed, 2, bid))).to(device)
            out = self.kind.loss(self.unwrapped, self.unwrapped.lm_head.weight, self.verifier_head, block, el, cfg,
                                 self.attention, self.logit_transform)
            if not bool(torch.isfinite(out.loss_sum).all()):
                nonfinite.append(bid)
            sums = add_sums(sums, {"loss_sum": out.loss_sum.float().reshape(1), "weight_sum": out.weight_sum.reshape(1),
                               "correct": out.correct, "counts": out.counts})
        self.model.train(was_training)
        if nonfinite:
            raise NonFiniteError(
                f"validation at step {self.step}: the loss of held-out blocks {nonfinite} is NaN or infinite; the "
                f"run stops before writing it. Check those blocks' features (`peagle-data verify {self.run.store.path}`)")
        if sums is None:
            return {}
        loss, acc = summarise(sums)
        return {"val_loss": loss, "val_acc": acc, "blocks": scored}

    # ---------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What ``training_state.pt`` holds: optimizer, scheduler, RNG, ``data``
        (:func:`peagle_train.data.loader.data_state`: the global cursor, blocks per step, world size, ...; None
        without a run), step, ``max_steps`` (the schedule's length) and config."""
        if self.loader is not None:
            data = self.loader.state_dict()
        else:
            data = data_state(self.run.sequence, self.cursor, self.world, self.cfg.optim.grad_accum) if self.run else None
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state()}, "data": data, "step": self.step,
                "max_steps": self.max_steps, "train_config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict[str, Any], cursor: int) -> None:
        """Continue from a :meth:`state_dict` (the model weights are loaded apart, from the checkpoint) at block
        cursor ``cursor``: the state's, checked against this launch by
        :func:`peagle_train.data.loader.resume_cursor` (the plan's, :attr:`peagle_train.train.run.TrainPlan.cursor`).

        Raises:
            ValueError: the trainer's ``max_steps`` is not the saved run's.
        """
        where = str(self.run.resumed_from) if self.run.resumed_from is not None else "the checkpoint"
        self.cursor = cursor
        if int(state["max_steps"]) != self.max_steps:
            raise ValueError(f"{where} is a run of {state['max_steps']} steps, the trainer has max_steps "
                             f"{self.max_steps}; build it with the saved run's")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        self.step = self.resumed_step = int(state["step"])
        self.checkpointer.saved_cursor = self.cursor  # the state resumed is the last one saved

    def training_info(self) -> dict[str, Any]:
        """Recorded in config.json so evaluation can find the held-out split."""
        return {"peagle_training": {"step": self.step, **self.run.info}}

    def save(self, name: str) -> Path:
        """Save ``output/name`` (drafter and :meth:`state_dict`); prune old checkpoints (main rank)."""
        path = self.kind.save_checkpoint(self.unwrapped, self.run.output / name, self.state_dict(),
                                         self.training_info(), self.run.training_segments)
        if self.cfg.run.save_total_limit is not None:
            prune_checkpoints(self.run.output, self.cfg.run.save_total_limit)
        return path

    # ---------------------------------------------------------------------------------- the run
    def train(self) -> dict[str, Any]:
        """Run the steps left up to ``max_steps``, then save ``final/``, validate and plot.

        Returns the summary described in :func:`peagle_train.train.run.run_train`. On an error the
        trackers are finished and the error re-raised.
        """
        run, acc = self.run, self.accelerator
        # the loader stops at the last step: no prefetch of a block past the run (which a stream plan never extracts)
        self.loader = BlockLoader(run.store, run.sequence, cursor=self.cursor, rank=self.rank, world_size=self.world,
                                  grad_accum=self.cfg.optim.grad_accum, pin_memory=acc.device.type == "cuda",
                                  blocks_per_read=self.checkpointer.blocks_per_read,
                                  n_steps=max(0, self.max_steps - self.step))
        batches = iter(self.loader)
        bar = progress(total=self.max_steps, initial=self.step, disable=not self.main, desc="peagle-train",
                       unit="step", dynamic_ncols=True)
        t_start, wait0 = time.perf_counter(), self.loader.wait_s
        self.model.train()
        try:
            while self.step < self.max_steps:
                self._after_step(self.train_step(self._micro_batches(batches)), bar)
        except BaseException:
            run.metrics.finish_trackers()
            raise
        finally:
            bar.close()
            self.loader.close()
            self.checkpointer.close()  # every read of the run is done
        return self._finish(t_start, wait0)

    def _micro_batches(self, batches: Iterator[tuple[int, Block]]) -> Iterator[tuple[Block, torch.Generator]]:
        """This rank's ``grad_accum`` blocks of the next step, each with the COD generator of its cursor."""
        for _ in range(self.cfg.optim.grad_accum):
            cursor, block = next(batches)
            yield block, cod_generator(self.cfg.run.seed, cursor)

    def _after_step(self, row: dict[str, Any], bar) -> None:
        """Log the step (every ``log_every`` and the last); save and validate as the :attr:`checkpointer` says (the
        last step's are :meth:`_final_outputs`')."""
        cfg, step = self.cfg, self.step
        if self.main:
            if step % cfg.run.log_every == 0 or step == self.max_steps:
                self.run.metrics.record(row)
            shown = " ".join(f"{a:.2f}" if a is not None else "-" for a in row["acc"][:4])
            bar.set_postfix_str(f"loss {row['loss']:.3f} acc {shown} tok/s {row['tokens_per_s']:.0f} "
                                f"lr {row['lr']:.2e}")
            bar.update(1)
        self.checkpointer.step_done(step, self.loader.cursor)
        if self.checkpointer.should_validate(step):
            self.run.metrics.record({"split": "val", "step": step, **self.validate()})

    def _finish(self, t_start: float, wait0: float) -> dict[str, Any]:
        self.accelerator.wait_for_everyone()
        summary: dict[str, Any] = {"steps": self.step, "rank": self.rank, "world_size": self.world,
                                   "resumed_from": str(self.run.resumed_from) if self.run.resumed_from else None,
                                   "resumed_step": self.resumed_step}
        if self.main:
            try:
                summary.update(self._final_outputs(t_start, wait0))
            except BaseException:
                self.run.metrics.finish_trackers()
                raise
        self.accelerator.wait_for_everyone()  # not before rank 0 has saved final/
        return summary

    def _final_outputs(self, t_start: float, wait0: float) -> dict[str, Any]:
        """Main rank: the last checkpoint, ``final/``, the last validation, the plot; summary entries."""
        run, step = self.run, self.step
        run.summary.update(self.checkpointer.final(step, self.loader.cursor))
        final = self.kind.save(self.unwrapped, run.output / "final", self.training_info(), run.training_segments)
        val = self.validate() if len(run.val_ids) else {}
        if val and not (run.resumed_from is not None and run.metrics.has_row("val", step)):
            run.metrics.record({"split": "val", "step": step, **val})  # once, also when a finished run is resumed
        path = run.metrics.path
        plot = plot_metrics(path, run.output / "training.png") if path.is_file() else None
        elapsed = time.perf_counter() - t_start
        last = self.last_row or run.metrics.last_row("train") or {}
        return {"last_step_loss": last.get("loss"), "last_step": last.get("step"),
                "per_depth_accuracy_last_steps": pooled_accuracy(self.recent),
                "per_depth_accuracy_steps": [self.recent[0]["step"], self.recent[-1]["step"]] if self.recent else None,
                "val_loss": val.get("val_loss"), "val_per_depth_accuracy": val.get("val_acc"),
                "checkpoint": str(final), "output": str(run.output), "metrics": str(path),
                "plot": str(plot) if plot else None,
                "tokens_per_second": self.tokens_total / elapsed if elapsed > 0 else None,
                "data_wait_fraction": (self.loader.wait_s - wait0) / elapsed if elapsed > 0 else None,
                "train_blocks": int(len(run.train_ids)), "val_blocks": int(len(run.val_ids)), **run.summary}

    def close(self) -> None:
        """Finish the trackers and destroy the process group; call after :meth:`train`, the trainer
        is unusable afterwards.

        The DDP wrapper keeps its own reference to the gloo/NCCL group, so the group outlives
        ``destroy_process_group`` until the wrapper is freed; freed at interpreter exit, its threads can
        abort the rank (SIGABRT, "terminate called without an active exception", about one launch in
        five with two gloo ranks). The prepared model and optimizer are released first.
        """
        if self.loader is not None:
            self.loader.close()
        self.model = self.optimizer = self.scheduler = self.unwrapped = None
        self.accelerator.free_memory()  # drops the accelerator's own references, then gc.collect()
        self.accelerator.end_training()
