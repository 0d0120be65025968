"""Training a P-EAGLE drafter (docs/design.md §8): :func:`run_train`, store in, drafter checkpoint out.

Legend: H hidden size, D draft vocab, K ``num_depths``.

:func:`run_train` is a list of stages: a streaming run's start checks and its extraction started,
:func:`plan_train` (opens the stores and runs every check that needs no weights, the set-up of
:mod:`peagle_train.train.setup` among them, into a :class:`TrainPlan`), :func:`load_trainer` (the verifier's
heads load, the drafter and the :class:`peagle_train.train.trainer.Trainer` are built), the training, the
extraction finished. :func:`build_trainer` is the plan and the load together. The step, validation and checkpoints live in the Trainer,
``metrics.jsonl``, trackers and the plot in :mod:`peagle_train.train.metrics`.

Output directory layout:
- ``train_config.json``: the :class:`TrainConfig`'s settings, without the actions ``--resume`` and
  ``--force`` (checked again on ``--resume``);
- ``metrics.jsonl``: one line per step (step, loss (the pooled objective), acc per depth, tokens/s, lr, the block ids read,
  grad norm, ...) and one per validation (``"split": "val"``);
- ``checkpoint-N/``: drafter (``config.json``, ``model.safetensors``) plus ``training_state.pt``
  (the AdamW moments of the trainable weights): a full copy per checkpoint, all kept unless
  ``save_total_limit`` (``--save-total-limit``) keeps only the newest N;
- ``final/``: the drafter at the last step, the directory to serve or evaluate;
- ``training.png``: loss and per-depth accuracy against steps;
- ``trackers/``: only with ``report_to`` (``--report-to``): the accelerate trackers' files (TensorBoard
  event files under ``trackers/peagle/``, wandb runs under ``trackers/wandb/``), fed the same rows as
  ``metrics.jsonl`` (see :func:`peagle_train.train.metrics.tracker_values`).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_train.data.loader import BlockSequence, order_warning, resume_cursor
from peagle_train.data.multistore import (conversation_groups, open_stores, split_per_store, store_identities,
                                         usable_blocks)
from peagle_train.data.segment_hashes import training_segment_hashes
from peagle_train.data.split import SPLIT_BLOCKS, SPLIT_CONVERSATIONS, SPLIT_RULES, validation_size
from peagle_train.data.stream import StreamingStore
from peagle_train.model.attention import resolve_attention_backend
from peagle_train.model.checkpoint import latest_checkpoint, load_training_state
from peagle_train.model.mask_token import MaskToken, resolve_mask_token
from peagle_train.model.warm_start import InitSource, copy_verifier_layers, load_init_weights
from peagle_train.train.config import TrainConfig
from peagle_train.train.kinds import DrafterKind, drafter_kind
from peagle_train.train.loss import LogitTransform
from peagle_train.train.metrics import MetricsLog, resolve_trackers
from peagle_train.train.setup import (build_draft_vocab, build_drafter_config, check_before_weights,
                                      load_verifier_heads, prepare_output, resolve_drafter_layer, resolve_epoch_order,
                                      resolve_init_from, val_split_warning)
from peagle_train.train.stream import (Extraction, check_stream_start, rank_from_env, resolve_stream_context,
                                       start_extraction, start_plan, wait_for_store)
from peagle_train.train.trainer import Trainer, TrainRun
from stores.errors import MissingDependencyError, StoreFormatError
from stores.files import strict_json

__all__ = ["run_train", "TrainPlan", "plan_train", "load_trainer", "build_trainer", "resumed_message",
           "resumed_split_rule"]


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a P-EAGLE drafter on a feature store and save it (docs/design.md §8).

    Returns:
        A summary: ``steps``, ``last_step_loss`` (the loss of one step, ``last_step``, the last),
        ``per_depth_accuracy_last_steps`` (pooled over the last 10 steps this process ran, first and
        last given as ``per_depth_accuracy_steps``: Σ weighted correct / Σ weight per depth; [] and
        None when this run took no step),
        ``val_loss``, ``val_per_depth_accuracy``, ``checkpoint`` (the ``final/`` directory),
        ``metrics``, ``plot``, ``tokens_per_second``, ``data_wait_fraction``, ``resumed_from`` and
        ``resumed_step`` (the checkpoint a ``--resume`` continued from and its step; None for a new run), ``rank``,
        ``world_size`` (data-parallel processes), ``mask_token``.

    Stages: a streaming run's start checks (:func:`check_stream_start`) and its extraction started (rank 0 of
    ``--extract-from``), :func:`plan_train` (every check that needs no weights), :func:`load_trainer` (the
    weights load), :meth:`Trainer.train`, the extraction finished.

    A run that fails (any error, a damaged block or a NaN loss among them) before its first checkpoint
    removes the output directory it made, so nothing half-made is left; a resumed run's directory, or one
    holding a checkpoint, is kept.

    Raises:
        StoreFormatError: missing or unfinished store (without ``allow_incomplete``).
        ChunkDamageError: a block read for training or validation fails its crc32c checksum (or is
            missing, truncated), naming the block and the repair command.
        NonFiniteError: a NaN or infinite loss or gradient norm, naming the step and its blocks.
        StoreMismatchError: the verifier does not match the store.
        OutputExistsError: output exists without ``resume`` or ``force``.
        InputError: ``--resume`` with settings that differ from the saved run, or a draft vocab
            larger than the verifier's, or ``attention_backend="flex"`` without CUDA.
        MissingDependencyError: a ``report_to`` tracker whose package is not installed.
    """
    claimed: list[tuple[Path, bool]] = []
    extraction = budget = None
    try:
        if cfg.stream.streaming:
            cfg = resolve_stream_context(cfg)  # (unset: full, or a resumed store's own)
            budget = check_stream_start(cfg)  # before anything starts or loads
            if cfg.stream.extract_from is not None and rank_from_env() == 0:
                extraction = start_extraction(cfg)
        plan = plan_train(cfg, extraction, budget)  # every check that needs no weights
        trainer = load_trainer(plan, claimed)  # the weights load
        summary = trainer.train()
        if extraction is not None:
            extraction.finish(cfg.stream.stream_timeout_s)
            summary["extraction_log"] = str(extraction.log_path)
    except BaseException:
        if extraction is not None:
            extraction.stop()
        _discard_unsaved(claimed)
        raise
    trainer.close()
    return summary


def _discard_unsaved(claimed: list[tuple[Path, bool]]) -> None:
    """A failed run removes what it wrote into its output directory when no checkpoint reached it: a
    ``train_config.json`` or ``metrics.jsonl`` alone is neither a drafter nor a run that ``--resume``
    continues, and would make the next run need ``--force``. ``claimed``: ``(directory, existed)``; a
    directory that existed before the run (empty, or emptied by ``--force``) is emptied, not removed."""
    for out, existed in claimed:
        if not out.is_dir() or latest_checkpoint(out) is not None or (out / "final").exists():
            continue
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
            continue
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


@dataclass
class TrainPlan:
    """A training run that passed every check needing no weights (:func:`plan_train`), and what the weights
    stage (:func:`load_trainer`) needs (docs/design.md §2 "Checks before weights", §8)."""

    cfg: TrainConfig
    """The run's options as run: the ``--init-from`` record and the drafter layer resolved (recorded in
    ``train_config.json``)."""
    trackers: list[str]
    """The ``--report-to`` trackers (:func:`resolve_trackers`)."""
    attention: str
    """The attention backend the drafter runs (:func:`resolve_attention_backend`)."""
    store: Any
    """The training data: a ``FeatureStore``, several stores as one ``StoreSet``, or (streaming) a
    ``StreamingStore`` whose reads wait for the extraction."""
    verifier_name: str
    """``--verifier``, else the store's verifier."""
    init: InitSource | None
    """The ``--init-from`` drafter, read without its weights; None for a fresh drafter."""
    mask: MaskToken
    """The mask token fed at depth > 0 (chosen from the tokenizer files and the store's ``token_freq``)."""
    accelerator: Any
    """The run's ``accelerate.Accelerator`` (:func:`_accelerator`)."""
    resume_from: Path | None
    """``--resume``: the latest checkpoint, None when there is none (or for a new run)."""
    training_state: dict[str, Any] | None
    """That checkpoint's ``training_state.pt``, its block cursor checked against this launch; None: no resume."""
    sequence: BlockSequence
    """The training blocks in the run's order (rank 0's usable ones on every rank)."""
    val_side: np.ndarray
    """``[n] int64`` the validation side of the split (every block id, extracted or not)."""
    val_ids: np.ndarray
    """``[m] int64`` the validation blocks scored (streaming: the whole side, every one will be extracted)."""
    max_steps: int
    """The length of the learning-rate schedule (a resume: the saved run's)."""
    cursor: int
    """The block cursor a resume continues at, checked against this launch (:func:`resume_cursor`); 0: a new run."""
    max_store_bytes: int | None
    """A streaming run's byte budget (``--max-store-bytes``, resolved once); None: the store is complete."""
    stream: StreamingStore | None
    """A streaming run's store (:attr:`store` itself), its plan checked and written into it and held by its
    session; None: the store is complete."""
    kind: DrafterKind
    """The drafter kind (``--method``): its model, samples, loss and checkpoint format."""
    last_layers: int
    """``--init-layers verifier`` of a new run: the verifier's last decoder layers the drafter's start from; else 0."""


def plan_train(cfg: TrainConfig, extraction: Extraction | None = None, budget: int | None = None) -> TrainPlan:
    """Every check of ``peagle-train`` that needs no weights, in one place (docs/design.md §2): the trackers, the
    attention backend, the store(s) (streaming: waited for while ``extraction`` creates it), the ``--init-from``
    drafter, the output, ``--resume``'s settings, verifier and stores, the verifier's config and tokenizer against
    the store (:func:`check_before_weights`), the mask token, the split and block order, ``--resume``'s block
    cursor against this launch (:func:`resume_cursor`), and a streaming run's plan (checked, and written into the
    store by the main process). Reads options, stores, tokenizer files, the verifier's config and a resumed run's
    ``training_state.pt``; never the verifier's weights. A streaming run's start checks
    (:func:`check_stream_start`) come before this: they decide whether the extraction starts, whose store this
    waits for, and resolve the byte ``budget`` it is given.

    Raises:
        see :func:`run_train` (every error it names except a damaged block and a NaN loss).
        ValueError: a streaming ``cfg`` without its ``budget``.
    """
    trackers = resolve_trackers(cfg.run.report_to)  # before anything is read or written
    attention = resolve_attention_backend(cfg.model.attention_backend)  # InputError before any work
    streamed = stream = None
    if cfg.stream.streaming:  # a store being extracted: every block will be there when read
        if budget is None:
            raise ValueError("a streaming run's plan_train takes the budget check_stream_start resolved (run_train "
                             "passes it)")
        streamed = wait_for_store(str(cfg.data.store), cfg.stream.stream_timeout_s, extraction)
        if streamed.attrs.get("shard"):
            raise StoreFormatError(f"{streamed.path} is a shard store: a streaming run trains on a whole store")
        store = stream = StreamingStore(streamed, cfg.stream.stream_timeout_s,
                                        extraction.stopped if extraction else None,
                                        str(extraction.log_path) if extraction else None,
                                        heartbeat=rank_from_env() == 0)
        usable = np.arange(streamed.n_blocks, dtype=np.int64)
    else:
        store = open_stores(cfg.data.store)  # several stores: one StoreSet, a validation split per store
        usable = usable_blocks(store, cfg.data.allow_incomplete)
    verifier_name = cfg.model.verifier or store.attrs["verifier"]["name_or_path"]
    cfg, init = resolve_init_from(cfg)  # the --init-from drafter's config and maps, no weights
    cfg = resolve_drafter_layer(cfg, verifier_name, init)  # recorded in train_config.json
    cfg = resolve_epoch_order(cfg, store)  # (unset: the resumed run's, conversations on full-context stores)
    kind = drafter_kind(cfg.model.method)
    check_before_weights(cfg, store, verifier_name, kind, init)
    mask_id = init.mask_token_id if init is not None and init.mask_token_id is not None else cfg.model.mask_token_id
    mask = resolve_mask_token(verifier_name, store, mask_id)  # InputError before the weights load
    accelerator = _accelerator(cfg, trackers)
    usable = _rank0_blocks(accelerator, usable)
    resume_from = latest_checkpoint(cfg.run.output) if cfg.run.resume else None
    state = load_training_state(resume_from) if resume_from is not None else None
    sequence, val_side, val_ids, max_steps, cursor = _block_order(cfg, accelerator, store, usable, state, resume_from)
    if stream is not None:  # the plan, checked and written before the weights load
        start_plan(cfg, accelerator, stream.session, budget, sequence, val_side, max_steps, state, resume_from)
        val_ids = val_side  # every one will be extracted; validation scores the first --val-max-blocks
    # --init-layers verifier (checked before the weights); a resume takes its layers from the checkpoint
    last_layers = cfg.model.num_layers if cfg.model.init_layers == "verifier" and state is None else 0
    return TrainPlan(cfg=cfg, trackers=trackers, attention=attention, store=store, verifier_name=verifier_name,
                     init=init, mask=mask, accelerator=accelerator, resume_from=resume_from, training_state=state,
                     sequence=sequence, val_side=val_side, val_ids=val_ids, max_steps=max_steps, cursor=cursor,
                     max_store_bytes=budget, stream=stream, last_layers=last_layers, kind=kind)


def _block_order(cfg: TrainConfig, accelerator, store, usable: np.ndarray, state: dict | None,
                 resume_from: Path | None) -> tuple[BlockSequence, np.ndarray, np.ndarray, int]:
    """The run's data: the validation split (a resumed run keeps its rule: :func:`resumed_split_rule`), the
    training blocks in order (:class:`BlockSequence`), a resume's block cursor checked against this launch
    (refused here, before the weights load, unless it continues exactly), and the schedule's length.

    Returns:
        ``(sequence, val_side, val_ids, max_steps, cursor)``: ``cursor`` the block cursor a resume continues at
        (0 for a new run), ``val_side`` every block id of the validation side,
        ``val_ids`` its usable ones (``[m] int64``, sorted).
    """
    rule = resumed_split_rule(state, cfg.data.val_fraction, str(resume_from))  # a resumed run keeps its split
    train_side, val_side = split_per_store(store, cfg.run.seed, cfg.data.val_fraction, rule)  # every block id
    groups = conversation_groups(store) if cfg.data.epoch_order == "conversations" else None
    sequence = BlockSequence(train_side, np.intersect1d(train_side, usable), cfg.run.seed, str(store.path), rule,
                             groups)
    val_ids = np.intersect1d(val_side, usable)
    warning = order_warning(sequence)
    if warning and accelerator.is_main_process:
        print(f"warning: {warning}", file=sys.stderr)
    cursor = 0
    if state is not None:  # refused here, before the weights load, unless it continues exactly
        cursor = resume_cursor(state.get("data") or {}, sequence, accelerator.num_processes, cfg.optim.grad_accum,
                               str(resume_from))
    if state is not None:
        max_steps = int(state["max_steps"])  # the schedule's length, as the saved run computed it
    else:
        per_epoch = max(1, len(sequence.usable) // (cfg.optim.grad_accum * accelerator.num_processes))
        max_steps = cfg.optim.max_steps if cfg.optim.max_steps is not None else per_epoch
    return sequence, val_side, val_ids, max_steps, cursor


def load_trainer(plan: TrainPlan, claimed: list[tuple[Path, bool]] | None = None) -> Trainer:
    """The weights stage of a planned run (:func:`plan_train`): loads the verifier's heads (checked against the
    store), builds the draft vocab and the drafter (seeded by ``cfg.run.seed``; ``--init-from``'s weights),
    prepares the output directory (``--force`` empties it only now, every check passed), resumes from the plan's
    checkpoint and starts the metrics log and trackers. ``claimed`` (a list) gets ``(output directory, whether it
    existed before)`` when this process made it or emptied it (main rank, not ``--resume``).

    Raises:
        StoreMismatchError: the verifier's weights are not the store's (:func:`load_verifier_heads`).
        RuntimeError: the latest checkpoint changed while the run started (another run writing there?).
    """
    cfg, store, init, mask, resume_from, state = (plan.cfg, plan.store, plan.init, plan.mask, plan.resume_from,
                                                  plan.training_state)
    heads = load_verifier_heads(plan.verifier_name, store, mask.id, plan.last_layers)
    if init is not None:  # the drafter's draft vocab (check_init_source: --draft-vocab-size agrees with it)
        d2t, D = init.d2t, init.config.draft_vocab_size
    else:
        d2t = build_draft_vocab(store.token_freq(), cfg.model.draft_vocab_size)
        D = int(d2t.numel()) if d2t is not None else store.vocab_size
    run = _start_run(cfg, plan.accelerator, store, plan.sequence, plan.val_side, plan.val_ids, plan.trackers, claimed)
    run.stream = plan.stream
    if run.resumed_from != resume_from:
        raise RuntimeError(f"the latest checkpoint in {cfg.run.output} changed while the run started "
                           f"({resume_from} -> {run.resumed_from}); is another run writing there?")
    run.info.update(mask_token=mask.to_dict())
    run.summary.update(draft_vocab_size=D, mask_token=mask.to_dict())
    if cfg.model.init_from is not None:  # a warm start, or the resume of one: the drafter it started from
        record = _saved_init_record(resume_from) if resume_from is not None else init.record()
        run.info.update(init_from=record)
        run.summary.update(init_from=record)
    model, verifier_head = _drafter(cfg, plan.kind, heads, store, d2t, D, plan.accelerator.device, init)
    transform = LogitTransform.from_config(heads.config)
    run.info.update(verifier_logit_transform={"scale": transform.scale, "softcap": transform.softcap})
    del heads
    if state is not None:
        model.load_state_dict(plan.kind.load(resume_from).state_dict())
    trainer = Trainer(cfg, model, verifier_head, kind=plan.kind, accelerator=plan.accelerator,
                      attention=plan.attention,
                      max_steps=plan.max_steps, warmup=cfg.optim.warmup_steps, run=run,
                      logit_transform=None if transform.identity else transform)
    if state is not None:
        trainer.load_state_dict(state, plan.cursor)
        if trainer.main:
            removed = run.metrics.truncate(trainer.step)
            print(resumed_message(resume_from, trainer.step, plan.max_steps, removed), file=sys.stderr)
    elif trainer.main:
        if cfg.run.resume:
            print(f"peagle-train: --resume: no checkpoint in {cfg.run.output} yet; starting at step 0",
                  file=sys.stderr)
        if run.metrics.path.exists():
            run.metrics.path.unlink()
    if trainer.main:
        run.metrics.start(_hparams(cfg, trainer, D, plan.verifier_name, run), trainer.step, cfg.run.resume)
    return trainer


def build_trainer(cfg: TrainConfig, claimed: list[tuple[Path, bool]] | None = None,
                  extraction: Extraction | None = None) -> Trainer:
    """The run's :class:`Trainer`: :func:`plan_train` (every check before the verifier's weights load), then
    :func:`load_trainer`. ``claimed``: see :func:`load_trainer`; ``extraction``: see :func:`plan_train`.

    Raises:
        see :func:`run_train`.
    """
    return load_trainer(plan_train(cfg, extraction), claimed)


def resumed_message(checkpoint: Path, step: int, max_steps: int, removed_rows: int) -> str:
    """The stderr line of a resumed run: the checkpoint and step it continues from, and the ``metrics.jsonl`` rows
    of later steps removed (the killed run logged them; the resumed run computes those steps again)."""
    dropped = (f"; metrics.jsonl: {removed_rows} row{'s' if removed_rows != 1 else ''} after step {step} removed "
               "(those steps run again)") if removed_rows else ""
    return f"peagle-train: resumed from {checkpoint} at step {step} of {max_steps}{dropped}"


def _rank0_blocks(accelerator, usable: np.ndarray) -> np.ndarray:
    """Rank 0's usable block ids on every rank (``[m] int64``): every rank must build the same block
    sequence, and a store still being extracted may mark blocks done between the ranks' reads."""
    if accelerator.num_processes == 1:
        return usable
    from accelerate.utils import broadcast_object_list

    return np.asarray(broadcast_object_list([usable.tolist()], from_process=0)[0], dtype=np.int64)


def _accelerator(cfg: TrainConfig, trackers: list[str]):
    """The run's ``Accelerator``: bf16 autocast on CUDA; ``cpu=True`` without CUDA (a multi-process
    launch then runs data-parallel on gloo, MULTI_CPU); its trackers under ``output/trackers``.

    Raises:
        MissingDependencyError: accelerate could not load every tracker of ``trackers``.
    """
    from accelerate import Accelerator

    tracking = {"log_with": trackers, "project_dir": str(Path(cfg.run.output) / "trackers")} if trackers else {}
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no",
                              cpu=not torch.cuda.is_available(), **tracking)
    if trackers and sorted(map(str, accelerator.log_with)) != sorted(trackers):
        raise MissingDependencyError(f"accelerate {accelerator.log_with} could not load every tracker of "
                                     f"--report-to {','.join(trackers)}; check that their packages import")
    return accelerator


def _saved_init_record(checkpoint) -> dict[str, Any] | None:
    """The ``peagle_training.init_from`` record of a resumed run's checkpoint (None: none there)."""
    path = Path(checkpoint) / "config.json" if checkpoint is not None else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text()).get("peagle_training", {}).get("init_from")


def _drafter(cfg: TrainConfig, kind: DrafterKind, heads, store, d2t: torch.Tensor | None, D: int,
             device, init: InitSource | None = None) -> tuple[torch.nn.Module, torch.Tensor]:
    """The drafter of the run's ``kind`` (``--method``) initialised from the verifier's heads (``torch.manual_seed(cfg.run.seed)`` first: the
    init is the only draw of the global generator), then from the ``--init-from`` drafter's weights (those
    its layout lacks keep the fresh init: :func:`peagle_train.model.warm_start.load_init_weights`), and the
    verifier's ``[D, H]`` head rows on ``device``."""
    torch.manual_seed(cfg.run.seed)
    model = kind.new_drafter(build_drafter_config(heads, store, cfg, D), cfg)
    model.init_from_verifier(heads.embed, heads.lm_head, d2t)
    if init is not None:
        load_init_weights(init, model)
    if heads.layers:  # --init-layers verifier
        copy_verifier_layers(model, heads.layers)
    model.embed_tokens.weight.requires_grad_(cfg.optim.train_embedding)
    return model, heads.lm_head[model.draft_ids].to(device)  # [D, H]


def _hparams(cfg: TrainConfig, trainer: Trainer, D: int, verifier_name: str, run: TrainRun) -> dict[str, Any]:
    """The trackers' hyper-parameters: the scalar settings and the run's derived sizes."""
    hparams = {k: v for k, v in cfg.flat().items()
               if k not in ("resume", "force") and isinstance(v, (bool, int, float, str))}
    hparams.update(max_steps=trainer.max_steps, warmup_steps=trainer.warmup, draft_vocab_size=D,
                   verifier=verifier_name, world_size=trainer.world, train_blocks=int(len(run.train_ids)),
                   val_blocks=int(len(run.val_ids)))
    return hparams


def resumed_split_rule(state: dict | None, val_fraction: float, checkpoint: str) -> int:
    """The validation split rule of the run: :data:`SPLIT_CONVERSATIONS` for a new run and for the resume of a
    run that started with it; :data:`SPLIT_BLOCKS` for the resume of a run saved before peagle split by
    conversation (its ``training_state.pt`` has no ``split``), which keeps its held-out blocks (changing them
    mid-run would move blocks between the sides) and says on stderr that they may share conversations with
    its training blocks."""
    if state is None:
        return SPLIT_CONVERSATIONS
    rule = int((state.get("data") or {}).get("split", SPLIT_BLOCKS))
    if rule == SPLIT_BLOCKS and val_fraction > 0:
        print(f"warning: {checkpoint} was started by a peagle that drew the validation split over blocks alone; the "
              "resumed run keeps that split, so its held-out blocks may share conversations (windows, mixture "
              "copies) with its training blocks and val_loss may score memorisation. A new run splits by "
              "conversation", file=sys.stderr)
    return rule


def _start_run(cfg: TrainConfig, accelerator, store, sequence: BlockSequence, val_side: np.ndarray,
               val_ids: np.ndarray, trackers, claimed: list[tuple[Path, bool]] | None = None) -> TrainRun:
    """Warn about a large validation split, prepare the output directory (main rank), write
    ``train_config.json`` and find the checkpoint to resume from."""
    main = accelerator.is_main_process
    asked = sum(validation_size(s.n_blocks, cfg.data.val_fraction) for s in getattr(store, "stores", [store]))
    note = val_split_warning(store.n_blocks, len(val_side), cfg.data.val_fraction, asked)
    if note and main:
        print(f"warning: {note}", file=sys.stderr)
    existed = Path(cfg.run.output).exists()
    resume_from = prepare_output(cfg) if main else None
    if main and not cfg.run.resume and claimed is not None:
        claimed.append((Path(cfg.run.output), existed))  # made or emptied by this run: cleared if it fails early
    accelerator.wait_for_everyone()
    if not main and cfg.run.resume:
        resume_from = latest_checkpoint(cfg.run.output)
    out = Path(cfg.run.output)
    if main:
        (out / "train_config.json").write_text(strict_json(cfg.to_dict(), str(out / "train_config.json"), indent=2))
    # evaluation finds the held-out blocks by these: val_blocks is the whole validation side (global ids,
    # extracted or not), so a block extracted after the run started is known held out
    info = {"store": cfg.data.store, "stores": store_identities(store),
            "tokenizer": store.attrs.get("tokenizer") or {},  # what the drafter's token ids mean (peagle-eval checks it)
            "seed": cfg.run.seed, "val_fraction": cfg.data.val_fraction, "method": cfg.model.method,
            "block_size": cfg.model.block_size, "num_depths": cfg.model.num_depths,
            "max_anchors": cfg.data.max_anchors, "down_sample_ratio": cfg.data.down_sample_ratio,
            "down_sample_ratio_min": cfg.data.down_sample_ratio_min, "loss": cfg.optim.loss,
            "depth_weights": list(cfg.depth_weights) if cfg.depth_weights is not None else None,
            "val_blocks": [int(i) for i in val_side],
            "split": {"rule": SPLIT_RULES[sequence.split_rule], "version": sequence.split_rule},
            "epoch_order": sequence.order_rule}
    # the segments trained on, so that peagle-eval can count a judge set's conversations found among them
    hashes = training_segment_hashes(store, val_side) if main else None
    return TrainRun(store=store, sequence=sequence, val_ids=val_ids, output=out, info=info, summary={},
                    metrics=MetricsLog(out / "metrics.jsonl", accelerator, trackers), resumed_from=resume_from,
                    training_segments=hashes)
