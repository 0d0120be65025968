"""Hidden-state extraction (``peagle-data extract``): run the verifier over packed blocks and fill the feature store.

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

- The features come from a verifier engine (:data:`peagle_data.extract.config.ENGINES`, ``--engine``;
  the interface is :mod:`peagle_data.extract.engine`): ``hf`` (:mod:`peagle_data.extract.hf`,
  transformers, the reference; its forward is :mod:`peagle_data.extract.hf_forward`) or ``vllm``
  (:mod:`peagle_data.extract.vllm`, the serving engine's hidden states); the store side (create,
  resume, the writer thread) is :mod:`peagle_data.extract.store`, the same for every engine, and the
  store's damage checks and repair are :mod:`stores.features.feature_repair`.
- :func:`run_extract` is a list of stages: :func:`plan_extract` runs every check that needs no weights and
  returns an :class:`ExtractPlan` (the rows, the context plan, the device, the verifier's directory), then the
  engine opens (the weights load), the store is created or resumed, the blocks run, the summary is made.
- A multimodal wrapper runs its language model: layers, layer convention and final norm are the
  language model's (recorded in the store's ``verifier`` attributes).
- Writes run on a background thread behind a bounded queue, so the next forward overlaps the
  store write; a block's ``done`` flag is written after its data.
- Under ``accelerate launch`` the not-done blocks are split round-robin between ranks; rank 0
  creates the store and every rank writes only its own blocks (one block = one chunk row).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from peagle_data.extract.config import DEFAULT_MAX_CONTEXT, ENGINES, ExtractConfig, resolve_layers
from peagle_data.extract.contexts import ContextPlan, plan_contexts
from peagle_data.extract.engine import PackedFacts, VerifierEngine, timed
from peagle_data.extract.hf_forward import check_packable
from peagle_data.extract.store import (BlockWriter, StoreAtOutput, check_resumable, check_same_plan, open_or_create,
                                        open_packed, store_at_output)
from peagle_data.extract.stream import extract_stream
from peagle_data.prepare.dedup import rows_key
from stores.errors import InputError, StoreMismatchError
from stores.features.feature_repair import repair_blocks, repair_shared, repair_windows
from stores.features.feature_schema import SEGMENTS, TOKEN_ARRAYS
from stores.features.feature_store import FeatureStore
from stores.files import is_local
from runtime.model_cache import model_files, resolve_model
from runtime.model_identity import identity_fingerprint, model_identity
from runtime.model_config import load_model_config, text_config
from stores.tables.token_rows import TokenizedRow, content_key
from stores.tables.token_tables import CONVERSATIONS, MANIFEST, TokenTable
from runtime.progress import progress as progress_bar
from runtime.verifier_match import check_token_ids, check_verifier_tokenizer
from runtime.vllm_runtime import cpu_bf16_only

__all__ = ["PACKED_COLUMNS", "ExtractPlan", "plan_extract", "run_extract"]

PACKED_COLUMNS = [*(s.name for s in TOKEN_ARRAYS), SEGMENTS.name, "n_tokens"]
"""The packed-table columns extraction reads: the store's per-token arrays, ``cu_seqlens``, ``n_tokens``."""


def _keys_column(table) -> list[str]:
    """``["segment_keys"]`` when the packed table records its segments' conversation content keys (the store
    keeps them for the validation split, docs/design.md §8), else ``["segment_ids"]`` to compute them from its
    ``conversations/`` sub-table (:func:`_attach_segment_keys`)."""
    return ["segment_keys"] if "segment_keys" in table.columns() else ["segment_ids"]


def _attach_segment_keys(table, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (packed rows) with ``segment_keys``: the table's column, or for a table packed before peagle
    recorded it, the keys ``pack`` would have written, from its ``conversations/`` sub-table (each
    conversation's rows, consecutive with one ``source``, keyed by :func:`rows_key` of their token ids and
    loss masks, as :func:`peagle_data.prepare.pack.run_pack` does). A table without the sub-table, or one that
    lacks a window's row, gives no keys (training then refuses a validation split of the store)."""
    if not rows or all(r.get("segment_keys") is not None for r in rows):
        return rows
    conversations = table.conversations() if "segment_ids" in rows[0] else None
    if conversations is None:
        return rows
    key_of: dict[str, int] = {}
    for _, group in itertools.groupby((TokenizedRow(**r) for r in conversations.iter_rows()), key=lambda r: r.source):
        group = list(group)
        key = content_key(rows_key(group))
        key_of.update((r.conversation_id, key) for r in group)
    cids = [[sid.rpartition("#")[0] for sid in r["segment_ids"]] for r in rows]
    if any(c not in key_of for row in cids for c in row):
        return rows
    return [{**r, "segment_keys": [key_of[c] for c in row]} for r, row in zip(rows, cids)]


def _check_device(device: str | None) -> None:
    """Raise InputError for a device this torch cannot use (before anything heavy runs)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"unknown device {device!r}; use cpu or cuda", field="--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA is not available (this torch is a CPU build or no GPU is visible); "
                         "use --device cpu", field="--device")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r} is not supported; use cpu or cuda", field="--device")


def _check_before_weights(cfg: ExtractConfig, table, rows, device: str, config, text, output: StoreAtOutput,
                          plan: ContextPlan | None = None) -> tuple[Path, dict[str, Any], list[int]]:
    """The checks that need only the verifier's ``config`` (:func:`load_model_config`; ``text``, its language model's:
    :func:`text_config`) and files, the packed table
    and the store at the output (docs/design.md §2), before the weights load; returns the verifier's directory
    (:func:`resolve_model`), its identity record (:func:`model_identity`, read once) and the aux layers
    (:func:`resolve_layers`).

    ``rows`` are this shard's packed rows (row k is packed block ``shard_index + k * num_shards``), or with
    ``plan`` (``--context full``) this shard's context blocks, whose token ids are checked after those of
    the packed blocks (``plan.training_rows``, so that a bad id is named by its packed block), and the
    plan against a resumed store's (:func:`check_same_plan`);
    ``device`` is where the verifier will run (it decides the dtype: bfloat16 on CUDA, float32 on CPU);
    ``output.resumed``, the store ``--resume`` continues (:func:`check_resumable`).

    Raises:
        InputError: a ``--layers`` index outside ``0..num_hidden_layers`` (read from the config, before
            the weights are even fetched), ``--resume`` with an option the store fixes
            (:func:`check_resumable`, the engine included), a verifier with recurrent / linear-attention
            layers (:func:`check_packable`), or one the ``--engine`` refuses (:meth:`VerifierEngine.check`).
        MissingDependencyError: the engine's package is missing.
        StoreMismatchError: the packed table was made with another tokenizer than the verifier's, or
            holds a token id that is no row of the verifier's embedding; ``--resume`` with other
            layers, another verifier or another packed table.
    """
    check_packable(config)
    made = f"the packed table {cfg.packed}"
    check_verifier_tokenizer(table.manifest.get("tokenizer") or {}, made, model_files(cfg.verifier))
    vocab = int(text.vocab_size)
    if plan is not None:
        check_token_ids(plan.training_rows, made, cfg.verifier, vocab)
        made = f"the context blocks (--context full) of {made}"
    check_token_ids(rows, made, cfg.verifier, vocab, cfg.shard_index, cfg.num_shards)
    layers = resolve_layers(cfg.layers, int(text.num_hidden_layers))
    ENGINES[cfg.engine].check(cfg, config, layers)
    directory = resolve_model(cfg.verifier)
    identity = model_identity(directory)
    if output.resumed is not None:
        # as load_verifier picks it; a --server extraction computes in the store's dtype (vllm.server_dtype)
        # (vLLM on CPU: bf16 for a verifier its CPU kernels run in bf16 only, vllm.engine_dtype)
        bf16 = device.startswith("cuda") or (cfg.engine == "vllm" and cpu_bf16_only(text))
        dtype = None if cfg.server else "bfloat16" if bf16 else "float32"
        recorded = {"name_or_path": cfg.verifier, "fingerprint": identity_fingerprint(identity), "dtype": dtype}
        check_resumable(output.resumed, cfg, recorded, layers, directory)
        if plan is not None:
            check_same_plan(output.resumed, plan, cfg.packed)
    return directory, identity, layers


@dataclass(frozen=True)
class ExtractPlan:
    """An extraction that passed every check needing no weights (:func:`plan_extract`), and what its later
    stages need (docs/design.md §2 "Checks before weights")."""

    cfg: ExtractConfig
    """The run's options as run: ``resume`` set by ``--stream`` (without ``--force``), ``max_context`` resolved
    (``--context full``: :func:`_max_context`)."""
    state: Any
    """The launch (``accelerate.PartialState``): this process's ``process_index`` among ``num_processes``."""
    table: TokenTable
    """The packed table."""
    rows: list[dict[str, Any]]
    """This shard's blocks the verifier runs (row k is block ``shard_index + k * num_shards``): the packed blocks
    (``--context window``) or the context blocks (``--context full``)."""
    contexts: ContextPlan | None
    """``--context full``: the full-context plan (:func:`plan_contexts`); None with ``--context window``."""
    device: str
    """Where the verifier runs (``cpu`` or ``cuda[:k]``; it decides the dtype: bfloat16 on CUDA, float32 on CPU)."""
    verifier_config: Any
    """The verifier's config (transformers' ``PretrainedConfig``, :func:`load_model_config`), read once."""
    verifier_dir: Path
    """The verifier's directory (:func:`resolve_model`)."""
    verifier_identity: dict[str, Any]
    """The directory's identity record (:func:`model_identity`), read once: the store records it."""
    layers: list[int]
    """The aux layers: ``--layers`` checked against the verifier's config, else the default
    (:func:`peagle_data.extract.config.resolve_layers`)."""
    output: StoreAtOutput
    """What ``--output`` holds: the store ``--resume`` continues, opened once, and whether the run replaces what is
    there (:func:`peagle_data.extract.store.store_at_output`)."""
    facts: PackedFacts
    """What the engine needs to know of the packed table before it opens."""


def plan_extract(cfg: ExtractConfig, log: Callable[[str], None] = print) -> ExtractPlan:
    """Every check of ``peagle-data extract`` that needs no weights, in the order a user meets them (docs/design.md
    §2): the device, the launch, the packed table, the output, the full-context plan (``--context full``), the
    verifier's config and tokenizer against the table (:func:`_check_before_weights`), the engine's process model.
    Reads the options, the table's manifest and rows, the verifier's config and files (never its weights) and a
    resumed store's attributes; writes nothing.

    Raises:
        see :func:`run_extract` (every error it names as coming before the weights load).
    """
    from accelerate import PartialState

    _check_device(cfg.device)
    if cfg.stream and not cfg.force:  # a streaming extraction creates the store, or continues it
        cfg = dataclasses.replace(cfg, resume=True)
    state = PartialState(cpu=cfg.device == "cpu")
    if cfg.stream and state.num_processes > 1:
        raise InputError("--stream runs in one process per store (it follows the run's plan entry by entry): drop "
                         "accelerate launch", field="--stream")
    table = open_packed(cfg.packed)
    output = store_at_output(cfg)  # --force replaces only a store of peagle's (before any work)
    plan = None
    conversations = _conversations(cfg, table) if cfg.context == "full" else None  # before the verifier is read
    config = load_model_config(cfg.verifier)
    text = text_config(config)  # a multimodal wrapper's language model
    if conversations is not None:
        cfg = dataclasses.replace(cfg, max_context=_max_context(cfg, text))
        plan = _plan(cfg, table, conversations, output)
        rows = plan.rows  # the verifier runs the context blocks
        log(f"full context: {plan.counts['conversations']:,} conversations in {plan.counts['contexts']:,} contexts "
            f"({plan.counts['conversations_split']:,} longer than --max-context {cfg.max_context}, split), "
            f"{plan.counts['tokens_extracted']:,} tokens in {len(rows):,} context blocks of {plan.context_size}")
    else:
        rows = _attach_segment_keys(table, list(table.iter_rows(PACKED_COLUMNS + _keys_column(table))))
    rows = rows[cfg.shard_index::cfg.num_shards]  # this shard's blocks (all of them unsharded)
    device = cfg.device or (str(state.device) if state.device.type == "cuda" else "cpu")
    directory, identity, layers = _check_before_weights(cfg, table, rows, device, config, text, output, plan)
    if not ENGINES[cfg.engine].multi_process and state.num_processes > 1:
        raise InputError(f"--engine {cfg.engine} runs in one process (its parallelism is vLLM's): drop accelerate "
                         "launch, or give each process its own --shard-index", field="--engine")
    facts = PackedFacts(longest_segment=max((int(np.diff(r["cu_seqlens"]).max()) for r in rows), default=1),
                        tokenizer=(table.manifest.get("tokenizer") or {}).get("name_or_path"),
                        offset_segment=_offset_segment(rows, cfg.shard_index, cfg.num_shards),
                        group_tokens=None if plan is None else int(
                            table.manifest.get("parameters", {}).get("block_size") or plan.context_size),
                        resumed_dtype=output.resumed_dtype)
    return ExtractPlan(cfg=cfg, state=state, table=table, rows=rows, contexts=plan, device=device,
                       verifier_config=config, verifier_dir=directory, verifier_identity=identity, layers=layers,
                       output=output, facts=facts)


def run_extract(cfg: ExtractConfig, progress: bool = True, log: Callable[[str], None] = print,
                config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the verifier over every not-done block of a packed table and write the store.

    Under a launch of N processes (``accelerate launch --multi_gpu --num_processes N``; on CPU too,
    where ``--cpu`` alone would start a single process) each rank takes every N-th not-done block. With
    ``resume`` every done block is checked first (:func:`repair_blocks`) and damaged ones are
    extracted again, so ``complete`` is true only for a store that ``verify_store`` accepts. A block
    whose hidden states are not finite is left not done and listed in ``nonfinite_blocks``.
    ``config``, the command's resolved options (``--print-config``), is recorded in the store's
    ``config`` attribute, so that ``--config`` can repeat the run.

    Stages: :func:`plan_extract` (every check that needs no weights), the engine opened (the weights load,
    or vLLM starts), the store created or resumed on every rank (:func:`_open_store`), the blocks run and
    written (:func:`_run_blocks`), the summary (:func:`_summarise`).

    Returns:
        A summary: ``store``, this process's ``rank`` among ``world_size``, ``context`` (a full-context store's
        counts: conversations, contexts, tokens extracted, ``max_context``, ...; None with ``--context window``);
        the training blocks (the packed blocks the drafter trains on) ``training_blocks``, ``training_blocks_done``
        (None for a full-context shard store: its training blocks read other shards' contexts) and
        ``training_blocks_done_this_run`` (this rank; None for a full-context shard), ``training_tokens``; the
        context blocks the verifier ran (``--context full``; all None with ``--context window``, where the
        verifier runs the training blocks themselves) ``context_blocks``, ``context_blocks_done``,
        ``context_blocks_done_this_run`` (this rank); ``verifier_tokens_this_run`` (tokens of the blocks the
        verifier ran, this rank), ``layers``, ``storage_dtype``, ``repaired_blocks``, ``nonfinite_blocks``
        (ids of the blocks the verifier runs), ``complete``, ``stored_bytes``; ``timings``, this process's seconds
        (wall, ``time.perf_counter``): ``engine_open_s`` (weights load, vLLM's start or the server checks),
        ``store_open_s`` (create, or resume and check), ``blocks_s`` (the blocks, up to the last write), within it
        ``engine_s`` (waiting on the engine's features; ``--stream``: and on the trainer) and ``writer_wait_s``
        (held by a full writer queue and the last writes); ``store_write_s`` (the writer thread: features with
        their crc32c and done flags, overlapping ``engine_s``); and the engine's own phases
        (:meth:`VerifierEngine.timings`).

    Raises:
        InputError: the packed path is not a packed table, or (``--context full``, the default) one without
            its conversations sub-table (before the verifier is read), a layer index is out of range, or
            the ``--engine`` refuses the verifier or an option (before weights load).
        MissingDependencyError: ``--engine vllm`` without vLLM installed.
        OutputExistsError: the store exists without ``resume``/``force``.
        DiskSpaceError: the disk is short (without ``force``).
        StoreMismatchError: a packed table made with another tokenizer than the verifier's (fingerprint or
            vocab size) or holding a token id past the verifier's embedding (before any weights load);
            resuming with another verifier, other layers or another packed table.
    """
    plan = plan_extract(cfg, log)
    t_open = time.perf_counter()
    engine = ENGINES[plan.cfg.engine].open(plan.cfg, plan.verifier_dir, plan.layers, log, plan.device, plan.facts,
                                           plan.verifier_identity)
    seconds = {"engine_open_s": time.perf_counter() - t_open}
    try:
        work = _open_store(plan, engine, log, config, seconds)
        ran = _run_blocks(plan, engine, work, progress, log, seconds)
        seconds.update(engine.timings())
    finally:
        engine.close()
    summary = _summarise(plan, work, ran, seconds, log)
    # a rank that exits with its gloo/NCCL group alive can abort in the group's threads (SIGABRT,
    # "terminate called without an active exception") and fail the launch
    plan.state.destroy_process_group()
    return summary


@dataclass
class _Work:
    """The store of a run, opened on every rank (:func:`_open_store`), and this rank's blocks to run."""

    root: FeatureStore
    """The store (a full-context store: its training blocks, views of ``store``'s)."""
    store: FeatureStore
    """The blocks the verifier runs: ``root.contexts`` of a full-context store, else ``root``."""
    repaired: dict[int, str]
    todo: list[int]
    """This rank's not-done blocks of ``store`` (at most ``--max-blocks``)."""
    training_before: int | None
    """A whole full-context store's training blocks done before the run (None: not counted)."""



def _open_store(plan: ExtractPlan, engine: VerifierEngine, log: Callable[[str], None], config: dict[str, Any] | None,
                seconds: dict[str, float]) -> _Work:
    """The store created or resumed on every rank (:func:`_store_on_every_rank`; with ``--resume`` its blocks
    checked and repaired) and this rank's share of its not-done blocks; adds ``store_open_s`` to ``seconds``."""
    cfg, state = plan.cfg, plan.state
    t_store = time.perf_counter()
    root, repaired = _store_on_every_rank(plan, engine, log, config)
    seconds["store_open_s"] = time.perf_counter() - t_store
    store = root.verifier_blocks  # the blocks the verifier runs
    todo = store.missing_blocks()
    views = root.has_views and not root.attrs.get("shard")  # training blocks done as views
    training_before = int(root.done_mask().sum()) if views else None
    state.wait_for_everyone()  # every rank reads the same list before any rank writes
    todo = todo[state.process_index::state.num_processes]
    if cfg.max_blocks is not None:
        todo = todo[: cfg.max_blocks]
    return _Work(root=root, store=store, repaired=repaired, todo=todo, training_before=training_before)


@dataclass(frozen=True)
class _Ran:
    """What this rank's blocks stage did (:func:`_run_blocks`)."""

    tokens: int
    """Tokens of the blocks the verifier ran."""
    nonfinite: list[int]
    """Blocks left not done for NaN/Inf hidden states."""
    blocks: int
    """Blocks the verifier ran (``--stream``: the extractions)."""
    stream: dict[str, Any] | None
    """``--stream``: the stream's counts (:func:`extract_stream`); None otherwise."""


def _run_blocks(plan: ExtractPlan, engine: VerifierEngine, work: _Work, progress: bool, log: Callable[[str], None],
                seconds: dict[str, float]) -> _Ran:
    """Run the verifier over this rank's blocks and write them: ``work.todo`` (:func:`_extract_blocks`), or with
    ``--stream`` the entries of the training run's plan as it reaches them (:func:`extract_stream`); adds
    ``blocks_s`` and the stage's own timings to ``seconds``."""
    cfg, state = plan.cfg, plan.state
    label = f"extract[{state.process_index}]" if state.num_processes > 1 else "extract"
    t_blocks = time.perf_counter()
    if cfg.stream:
        tokens, nonfinite, stream = extract_stream(engine, work.root, plan.rows, cfg.stream_timeout_s, label, progress,
                                                   log, cfg.writer_queue, seconds)
        blocks = stream["extractions"]
    else:
        tokens, nonfinite = _extract_blocks(engine, work.store, plan.rows, work.todo, cfg, label, progress, seconds)
        blocks, stream = len(work.todo), None
    seconds["blocks_s"] = time.perf_counter() - t_blocks
    return _Ran(tokens=tokens, nonfinite=nonfinite, blocks=blocks, stream=stream)


def _summarise(plan: ExtractPlan, work: _Work, ran: _Ran, seconds: dict[str, float],
               log: Callable[[str], None]) -> dict[str, Any]:
    """The run's summary (:func:`run_extract`), once every rank is done: :func:`_summary`, the timings, a streaming
    run's counts, and a full-context store's block counts (its training blocks are views of the context blocks
    the verifier ran)."""
    cfg, state, root, store = plan.cfg, plan.state, work.root, work.store
    if ran.nonfinite:
        log(f"{cfg.output}: blocks {ran.nonfinite} have NaN or Inf hidden states (verifier overflow?); "
            "they are left not done")
    state.wait_for_everyone()
    summary = _summary(cfg, state, store, ran.blocks, ran.tokens, plan.layers, work.repaired, ran.nonfinite)
    summary["timings"] = {k: round(v, 3) for k, v in seconds.items()}
    if ran.stream is not None:
        summary["stream"] = {k: v for k, v in ran.stream.items() if k != "plan"}
    if root.has_views:  # the verifier ran context blocks; the training blocks are views of them
        training_done = int(root.done_mask().sum()) if work.training_before is not None else None
        summary.update(context=root.attrs.get("context"), training_blocks=root.n_blocks,
                       training_blocks_done=training_done,
                       training_blocks_done_this_run=None if training_done is None
                       else training_done - work.training_before,
                       training_tokens=root.n_tokens, context_blocks=store.n_blocks,
                       context_blocks_done=int(store.done_mask().sum()), context_blocks_done_this_run=ran.blocks,
                       stored_bytes=root.summary()["stored_bytes"] if not root.attrs.get("shard") else None)
    return summary


def _offset_segment(rows, shard_index: int = 0, num_shards: int = 1) -> tuple[int, int] | None:
    """``(block, segment)`` of the first segment whose position ids are not ``0..n-1``, else None;
    ``block`` is the packed table's block index (``rows`` are shard ``shard_index`` of ``num_shards``:
    row k is packed block ``shard_index + k * num_shards``)."""
    for k_row, r in enumerate(rows):
        i = shard_index + k_row * num_shards
        cu, pos = np.asarray(r["cu_seqlens"]), np.asarray(r["position_ids"])
        for k, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
            if not np.array_equal(pos[lo:hi], np.arange(hi - lo)):
                return i, k
    return None


def _summary(cfg: ExtractConfig, state, store: FeatureStore, blocks_run: int, tokens: int, layers: list[int],
             repaired: dict[int, str], nonfinite: list[int]) -> dict[str, Any]:
    """The summary of a store whose blocks the verifier runs itself (``--context window``: the training blocks;
    :func:`run_extract` rewrites the block counts of a full-context store)."""
    return {
        "store": str(cfg.output),
        "rank": state.process_index,
        "world_size": state.num_processes,
        "context": None,
        "training_blocks": store.n_blocks,
        "training_blocks_done": int(store.done_mask().sum()),
        "training_blocks_done_this_run": blocks_run,
        "training_tokens": store.n_tokens,
        "context_blocks": None,
        "context_blocks_done": None,
        "context_blocks_done_this_run": None,
        "verifier_tokens_this_run": tokens,
        "layers": layers,
        "storage_dtype": store.storage_dtype,
        "repaired_blocks": {int(i): reason for i, reason in sorted(repaired.items())},
        "nonfinite_blocks": nonfinite,
        "complete": store.is_complete(),
        "stored_bytes": store.summary()["stored_bytes"],
    }


def _store_on_every_rank(extract: ExtractPlan, engine: VerifierEngine, log: Callable[[str], None],
                         config: dict[str, Any] | None) -> tuple[FeatureStore, dict]:
    """The store, created or resumed by the main process and then opened by the others; with
    ``resume``, each rank's share of the blocks checked and repaired (a full-context store's context
    blocks; its training blocks' arrays by the main process). Returns ``(store, {block: reason})``."""
    cfg, state = extract.cfg, extract.state
    rows, plan = extract.rows, extract.contexts
    if state.is_main_process:
        root = open_or_create(cfg, rows, extract.table, engine.desc, extract.layers, log, engine.record,
                              extract.output, plan, extract.verifier_dir)
        if config is not None:
            root.update_attrs(config=config)
        if cfg.resume:
            if plan is not None:
                repair_windows(root, plan.training_rows, plan.views, log)
                repair_shared(root, plan.training_rows, log)
            repair_shared(root.contexts if plan is not None else root, rows, log)
            _record_segment_keys(root, plan.training_rows if plan is not None else rows, log)
    state.wait_for_everyone()
    if not state.is_main_process:
        root = FeatureStore.open(cfg.output, mode="r+")
    store = root.verifier_blocks
    repaired = repair_blocks(store, rows, state.process_index, state.num_processes, log) if cfg.resume else {}
    state.wait_for_everyone()
    return root, repaired


def _record_segment_keys(root: FeatureStore, rows, log: Callable[[str], None]) -> None:
    """On ``--resume`` of a store made before peagle recorded ``segment_keys``: write them from the packed rows
    when these have them (docs/design.md §7), so that training can split it by conversation (§8)."""
    if root.segment_keys() is None and rows and all(r.get("segment_keys") is not None for r in rows):
        root.write_segment_keys([r["segment_keys"] for r in rows])
        log(f"{root.path}: recorded each segment's conversation content key (segment_keys) from the packed table")


def _max_context(cfg: ExtractConfig, text) -> int:
    """``--max-context``, else the verifier's ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_CONTEXT`
    (read from its language model's config ``text``, before the weights), less the positions the ``--engine`` needs
    after a request (:attr:`VerifierEngine.positions_after_prompt`: vLLM's one generated token).

    Raises:
        InputError: a ``--max-context`` past that.
    """
    limit = getattr(text, "max_position_embeddings", None)
    room = ENGINES[cfg.engine].positions_after_prompt
    if cfg.max_context is None:
        return min(int(limit) - room, DEFAULT_MAX_CONTEXT) if limit else DEFAULT_MAX_CONTEXT
    if limit and cfg.max_context > int(limit) - room:
        why = (f"--engine {cfg.engine} generates {room} token(s) after each context within them: give at most "
               f"{int(limit) - room}" if room else "it computes no positions beyond them")
        raise InputError(f"--max-context {cfg.max_context}: the verifier's max_position_embeddings is {limit}, and "
                         f"{why}", field="--max-context")
    return int(cfg.max_context)


def _conversations(cfg: ExtractConfig, table):
    """The packed table's ``conversations/`` sub-table, which ``--context full`` (the default) runs whole.

    Raises:
        InputError: a table without it, without the columns that say where its windows come from, or
            without the sub-table's digest in its manifest (packed by an older peagle, or written by
            hand); names both fixes: pack it again, or ``--context window``.
        StoreMismatchError: a conversations sub-table other than the manifest records.
    """
    conversations = table.conversations()  # checked against the digest the packed manifest records
    missing = [c for c in ("segment_ids", "segment_prefix_lens", "segment_starts") if c not in table.columns()]
    if conversations is None or missing:
        what = "no conversations/ sub-table" if conversations is None else f"no column {', '.join(missing)}"
        raise InputError(f"{cfg.packed} has {what} (packed by an older peagle, or written by hand), and the default "
                         "--context full runs the conversations kept there: pack it again with `peagle-data pack` "
                         "(which keeps the conversations and where each window comes from), or extract it with "
                         "--context window (each packed block as it is, a format-1 store)", field="--context")
    if CONVERSATIONS not in table.manifest:
        raise InputError(f"{cfg.packed}/{MANIFEST} records no digest of its conversations sub-table (packed by an "
                         "older peagle), so an edited sub-table could give windows another history than theirs: pack "
                         "it again with `peagle-data pack`, or extract it with --context window", field="--context")
    return conversations


def _plan(cfg: ExtractConfig, table, conversations, output: StoreAtOutput) -> ContextPlan:
    """The full-context plan of the packed table (:func:`plan_contexts`), from its blocks and its
    ``conversations`` sub-table (:func:`_conversations`).

    Raises:
        StoreMismatchError: one conversation id in two rows of the sub-table.
    """
    by_id: dict[str, dict] = {}
    for r in conversations.iter_rows(["conversation_id", "source", "input_ids", "loss_mask", "system_len"]):
        first = by_id.setdefault(r["conversation_id"], r)
        if first is not r:  # which of the two a window was cut from is unknown
            raise StoreMismatchError(f"{conversations.directory}: conversation id {r['conversation_id']!r} is in two "
                                     f"rows (sources {first['source']}, {r['source']}), so its windows' conversation is "
                                     "unknown. An input id that equals another conversation's per-turn (ID@k) or "
                                     "mixture-copy (ID*k) id in a sharded pack does this: give those input rows other "
                                     "ids, or pack unsharded (pack renames it ~k), and pack the table again")
    where = ["segment_ids", "segment_prefix_lens", "segment_starts"]
    training = _attach_segment_keys(table, list(table.iter_rows(
        PACKED_COLUMNS + where + [c for c in _keys_column(table) if c not in where])))
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    return plan_contexts(training, by_id, int(cfg.max_context), block_size, str(cfg.packed), _packing(cfg, output))


def _packing(cfg: ExtractConfig, output: StoreAtOutput) -> str:
    """How the plan packs contexts (:data:`peagle_data.extract.contexts.PACKINGS`): a resumed local store's (recorded
    as ``packing`` in its ``context`` counts; none: ``best_fit``; ``output.store``, finished or not), else
    ``--context-packing``, else ``training_blocks`` with ``--stream`` and ``best_fit`` without.

    Raises:
        InputError: a ``--context-packing`` other than the resumed store's.
    """
    made = output.store.attrs.get("context") if output.store is not None and is_local(cfg.output) else None
    if isinstance(made, dict):
        packing = str(made.get("packing", "best_fit"))
        if cfg.context_packing not in (None, packing):
            raise InputError(f"--context-packing: the store's {packing}, given {cfg.context_packing}; a resume "
                             "keeps the store's (drop the option, or start over with --force)",
                             field="--context-packing")
        return packing
    return cfg.context_packing or ("training_blocks" if cfg.stream else "best_fit")


def _extract_blocks(engine: VerifierEngine, store: FeatureStore, rows, todo: list[int], cfg: ExtractConfig,
                    label: str, progress: bool, seconds: dict[str, float]) -> tuple[int, list[int]]:
    """Run ``engine`` over blocks ``todo`` and write them (writer thread); adds to ``seconds`` ``engine_s`` (waiting
    on the engine's features), ``store_write_s`` and ``writer_wait_s`` (:class:`BlockWriter`'s ``write_s``,
    ``put_s``).

    Returns:
        ``(tokens extracted, sorted blocks left not done for NaN/Inf hidden states)``.
    """
    writer = BlockWriter(store, cfg.writer_queue)
    tokens = 0
    bar = progress_bar(todo, desc=label, unit="block", disable=not progress)
    try:
        for i, aux, final in timed(engine.features((i, rows[i]) for i in bar), seconds, "engine_s"):
            writer.put(i, aux, final)
            tokens += int(rows[i]["n_tokens"])
            bar.set_postfix(tokens=f"{tokens:,}")  # a string: tqdm prints numbers as 2e+4
    finally:
        writer.close()
        seconds.update(store_write_s=writer.write_s, writer_wait_s=writer.put_s)
    return tokens, sorted(writer.nonfinite)
