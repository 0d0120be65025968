"""One command that extracts and trains (``peagle-train --extract-from PACKED --max-store-bytes SIZE``,
docs/design.md §7 "Streaming").

The extraction runs as a subprocess (``python -m cli.data_extract PACKED --output STORE --stream ...``), so
a kill of either side is a real case; its output goes to ``STORE.extract.log``, named in every error about
it. peagle_train never imports peagle_data: it starts the command, as a user would on another machine.

Before anything starts (and before any weights load): the options, the output, the store (another run's
plan), the free disk against the budget, and a budget estimated from the packed table and the verifier's
config against the smallest that can work. The exact check, on the created store, follows in
:func:`start_plan` (:func:`peagle_train.data.stream.make_plan`), which writes the plan into the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from peagle_train.data.loader import BlockSequence
from peagle_train.data.split import validation_size
from peagle_train.data.stream import make_plan, rerun_note
from peagle_train.train.config import TrainConfig
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from stores.files import is_zarr_store
from runtime.model_config import load_model_config, text_config
from stores.staging import check_replaceable
from stores.stream.plan import apparent_bytes, block_feature_bytes, fixed_bytes_estimate, format_size
from stores.stream.session import StreamSession
from stores.tables.token_tables import TokenTable, manifest_sha256

__all__ = ["Extraction", "extraction_log", "extract_command", "resolve_stream_context", "check_stream_start",
           "check_free_disk", "start_extraction", "start_plan", "wait_for_store", "world_size_from_env",
           "rank_from_env", "plan_run_identity"]

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The directory holding the ``cli`` package (put on the subprocess's PYTHONPATH)."""


def world_size_from_env() -> int:
    """Processes of this launch (``WORLD_SIZE`` of torchrun / accelerate launch; 1 alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    """This process's rank (``RANK``; 0 alone): only rank 0 starts the extraction."""
    return int(os.environ.get("RANK", "0"))


def extraction_log(store: str) -> Path:
    """Where the extraction subprocess writes its output: ``STORE.extract.log`` beside the store."""
    path = Path(store)
    return path.parent / f"{path.name}.extract.log"


def extract_command(cfg: TrainConfig) -> list[str]:
    """The ``peagle-data extract ... --stream`` command of the run (``python -m cli.data_extract``, whose
    ``__main__`` guard the engine processes vLLM spawns need)."""
    s = cfg.stream
    cmd = [sys.executable, "-m", "cli.data_extract", s.extract_from, "--output", str(cfg.data.store),
           "--verifier", cfg.model.verifier, "--context", s.context, "--engine", s.engine,
           "--storage-dtype", s.storage_dtype, "--stream", "--stream-timeout-s", str(s.stream_timeout_s)]
    if s.layers is not None:
        cmd += ["--layers", ",".join(map(str, s.layers))]
    if s.device is not None:
        cmd += ["--device", s.device]
    return cmd


def _opened_store(store: str) -> FeatureStore | None:
    """The store at ``store`` once its token arrays are written (what the extraction continues), else None."""
    if not is_zarr_store(store):
        return None
    try:
        opened = FeatureStore.open(store)
    except StoreFormatError:
        return None
    return opened if opened.attrs.get("tokens_written") else None


def resolve_stream_context(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--context`` set when ``--extract-from`` left it unset: ``full`` (the verifier's served
    context, ``peagle-data extract``'s default), except with ``--resume`` of a store already made, whose own
    context it keeps (a run started when this command defaulted to ``window`` continues as it started; its
    recorded settings and the store's identity are compared on resume)."""
    s = cfg.stream
    if s.extract_from is None or s.context is not None:
        return cfg
    opened = _opened_store(str(cfg.data.store)) if cfg.run.resume else None
    context = "full" if opened is None else opened.context
    return dataclasses.replace(cfg, stream=dataclasses.replace(s, context=context))


def check_free_disk(store: str, budget: int) -> None:
    """The store's file system must have room for the budget: free bytes plus what the store holds now.

    Raises:
        InputError: less room than ``budget`` (field ``--max-store-bytes``), naming both.
    """
    probe = Path(store)
    held = apparent_bytes(probe) if probe.exists() else 0
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free + held < budget:
        raise InputError(f"--max-store-bytes {budget:,}: the file system of {store} has {free:,} bytes free "
                         f"({held:,} more held by the store), less than the budget; free disk or give a smaller "
                         f"budget (at most {format_size(free + held)})", field="--max-store-bytes")


def _estimated_smallest(cfg: TrainConfig, packed: str) -> int:
    """A lower bound of the smallest budget that can work, from the packed table and the verifier's config (no
    weights): the token arrays and ``token_freq`` (:func:`stores.stream.plan.fixed_bytes_estimate`), at most
    ``--val-max-blocks`` validation blocks and one step's blocks (``reextract``) or every training block
    (``keep``); with ``--context full``, whose context blocks are planned only when the store is made, one
    block for the validation blocks and one for the run. A budget below it is refused before the extraction starts; the exact check follows on the
    created store (:func:`peagle_train.data.stream.make_plan`)."""
    table = TokenTable.open(packed)
    n, C, S = 0, int(table.manifest.get("parameters", {}).get("block_size") or 0), 1
    for r in table.iter_rows(["n_tokens", "cu_seqlens"]):
        n, C, S = n + 1, max(C, int(r["n_tokens"])), max(S, len(r["cu_seqlens"]) - 1)
    text = text_config(load_model_config(cfg.model.verifier))
    L = int(text.num_hidden_layers)
    n_aux = len(cfg.stream.layers) if cfg.stream.layers else len({min(2, L), L // 2, max(L - 3, 0)})  # EAGLE-3's default
    held_out = validation_size(n, cfg.data.val_fraction)
    fixed = fixed_bytes_estimate(n, C, S, int(text.vocab_size))
    block = block_feature_bytes(C, n_aux, int(text.hidden_size), cfg.stream.storage_dtype)
    n_val = min(cfg.data.val_max_blocks, held_out)
    per_step = cfg.optim.grad_accum * world_size_from_env()
    need = n - held_out if cfg.stream.epoch_policy == "keep" else per_step
    if cfg.stream.context == "full":  # context blocks (of at least C slots) are unknown until the store is made:
        n_val, need = min(n_val, 1), 1  # at least one for the validation blocks, one for a step
    return fixed + (n_val + need) * block


def check_stream_start(cfg: TrainConfig) -> int:
    """Checks before the extraction starts (no weights read); returns the budget in bytes.

    Raises:
        InputError: a budget that is no size, smaller than the smallest that can work (named), or larger
            than the free disk; ``--extract-from`` that is no packed table.
        OutputExistsError: ``--output`` holds files without ``--resume``/``--force``.
        StoreFormatError: the store streams for another run (its plan names another output).
        StoreMismatchError: the store was extracted from another packed table or in another storage dtype.
    """
    s = cfg.stream
    budget = s.budget_bytes
    out = Path(cfg.run.output)
    if not cfg.run.resume:
        check_replaceable(out, cfg.run.force, "pass --resume to continue it or --force to overwrite it")
    store = str(cfg.data.store)
    if is_zarr_store(store):
        other = _plan_output(store)
        if other is not None and other != str(out.resolve()):
            raise StoreFormatError(f"{store} is being streamed for the run {other} (its stream plan): give this run "
                                   "another --store, or continue that run")
    if s.extract_from is not None:
        smallest = _estimated_smallest(cfg, s.extract_from)  # (opens the table: InputError if it is none)
        _check_store_source(store, s.extract_from, s.storage_dtype, s.context)
        if budget < smallest:
            raise InputError(f"--max-store-bytes {budget:,} is too small for this run: at least {smallest:,} bytes are "
                             f"needed (--max-store-bytes {format_size(smallest)}): the token arrays, the validation "
                             "blocks kept all run and "
                             + ("every block (--epoch-policy keep)" if s.epoch_policy == "keep"
                                else "one optimizer step's blocks"), field="--max-store-bytes")
    check_free_disk(store, budget)
    return budget


def _check_store_source(store: str, packed: str, storage_dtype: str, context: str) -> None:
    """The extraction continues a store already there (``--stream`` implies ``--resume``) and refuses one made
    from another packed table, in another storage dtype or with the other ``--context``, but only in its log,
    after the trainer has loaded the weights: refuse it here, before anything starts (a half-made store, without
    its token arrays, is made again by the extraction).

    Raises:
        StoreMismatchError: naming the store, both and the way out.
    """
    opened = _opened_store(store)
    if opened is None:
        return
    source = manifest_sha256(packed)
    if opened.attrs.get("source") != source:
        raise StoreMismatchError(f"{store} was extracted from another packed table than --extract-from {packed} "
                                 f"(manifest sha256 {opened.attrs.get('source')!r}, now {source!r}: the table was "
                                 "packed again or its manifest changed); give this run another --store, or the table "
                                 "the store was made from")
    if opened.storage_dtype != storage_dtype:
        raise StoreMismatchError(f"{store} holds {opened.storage_dtype} features, --storage-dtype gives "
                                 f"{storage_dtype}; "
                                 f"pass --storage-dtype {opened.storage_dtype}, or give this run another --store")
    made = opened.context
    if made != context:
        raise StoreMismatchError(f"{store} holds --context {made} features, this run extracts --context {context}"
                                 + (" (this command's default: the served context)" if made == "window" else "")
                                 + f"; pass --context {made} to continue it, or give this run another --store")


def _plan_output(store: str) -> str | None:
    """The output directory the store's stream plan belongs to, or None (no plan, or not a store yet)."""
    try:
        opened = FeatureStore.open(store)
    except StoreFormatError:
        return None
    session = StreamSession(opened)
    plan = session.read_plan() if session.has_plan() else None
    return plan.run.get("output") if plan is not None else None


PR_SET_PDEATHSIG = 1
"""Linux prctl option: the signal a process gets when its parent exits."""


def _die_with_parent() -> None:
    """In the extraction subprocess before it starts (Linux): SIGKILL it when peagle-train exits, also by a
    kill -9, so that no orphaned extraction goes on writing the store next to the one a ``--resume`` starts."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Extraction:
    """The extraction subprocess of a one-command streaming run.

    Args:
        cfg: the run's config (``stream.extract_from`` set).
        replace_plan: remove the store's stream plan before the subprocess starts (a new run).
    """

    def __init__(self, cfg: TrainConfig, replace_plan: bool = False):
        self.cmd = extract_command(cfg)
        self.log_path = extraction_log(str(cfg.data.store))
        if replace_plan:
            _remove_plan(str(cfg.data.store))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)  # one process of its own, not a rank of the training launch
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)

    def stopped(self) -> str | None:
        """None while it runs; else how it ended (``exit code N``)."""
        rc = self.proc.poll()
        return None if rc is None else f"exit code {rc}"

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def finish(self, timeout_s: float) -> int:
        """Wait for it to exit (it ends after the run's last entry); returns its exit code.

        Raises:
            StoreFormatError: it failed, naming its log.
        """
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise StoreFormatError(f"the extraction did not exit {timeout_s:g} s after training ended; its log: "
                                   f"{self.log_path}") from None
        finally:
            self._log.close()
        if rc != 0:
            raise StoreFormatError(f"the extraction exited with code {rc}; its log: {self.log_path}\n{self.tail()}")
        return rc

    def stop(self) -> None:
        """End it (SIGTERM to its process group, then SIGKILL after 10 s)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self._log.closed:
            self._log.close()


def wait_for_store(store: str, timeout_s: float, extraction: Extraction | None = None) -> FeatureStore:
    """The store once its token arrays are written (the extraction creates it after loading the verifier),
    opened r+.

    With the run's own ``extraction``, ``timeout_s`` counts from the last change of its log (loading a large
    verifier takes long, but writes its progress there), so only an extraction silent for ``timeout_s`` is
    given up on; without one (split roles), from the call.

    Raises:
        StoreFormatError: the extraction exited first (with its log's last lines), or no store after
            ``timeout_s`` (of a silent log).
    """
    t0 = time.monotonic()
    log_size = -1
    while True:
        if is_zarr_store(store):
            try:
                opened = FeatureStore.open(store, mode="r+")
                if opened.attrs.get("tokens_written"):
                    return opened
            except StoreFormatError:
                pass
        why = extraction.stopped() if extraction is not None else None
        if why is not None:
            raise StoreFormatError(f"the extraction stopped ({why}) before it made the store {store}; its log: "
                                   f"{extraction.log_path}\n{extraction.tail()}")
        if extraction is not None:
            size = Path(extraction.log_path).stat().st_size if Path(extraction.log_path).exists() else 0
            if size != log_size:  # the extraction is still saying something: its wait starts again
                log_size, t0 = size, time.monotonic()
        if time.monotonic() - t0 > timeout_s:
            where = f"; its log: {extraction.log_path}" if extraction is not None else (
                " (start `peagle-data extract PACKED --output STORE --stream`)")
            raise StoreFormatError(f"no feature store at {store} after {timeout_s:g} s" + (
                " with nothing new in the extraction's log" if extraction is not None else "") + where)
        time.sleep(0.2)


def start_extraction(cfg: TrainConfig) -> Extraction:
    """Start the extraction subprocess of a one-command streaming run; a new run (not ``--resume``) of the
    output that the store's plan names replaces that plan first, so the extraction never follows the old one."""
    return Extraction(cfg, replace_plan=not cfg.run.resume)


def _remove_plan(store: str) -> None:
    """Remove the stream plan of the store at ``store``, when there is one."""
    if is_zarr_store(store):
        try:
            old = FeatureStore.open(store, mode="r+")
        except StoreFormatError:
            old = None
        session = StreamSession(old) if old is not None else None
        if session is not None and session.has_plan():
            session.remove_plan()


def start_plan(cfg: TrainConfig, accelerator, session: StreamSession, budget: int, sequence: BlockSequence,
                 val_side: np.ndarray, max_steps: int, state: dict | None, resume_from: Path | None) -> None:
    """The run's stream plan (:func:`peagle_train.data.stream.make_plan`, within ``budget`` bytes), written into the
    store by the main process unless the store holds the same one (a resume, or the same run again); every rank's
    ``session`` holds it.

    Raises:
        InputError: a budget too small (naming the smallest that works); ``--resume`` of a run whose plan is
            not the store's, or whose checkpoint is older than what the store has already evicted.
        StoreFormatError: the store holds another run's plan (another output).
    """
    store = session.store
    per_step = cfg.optim.grad_accum * accelerator.num_processes
    run = plan_run_identity(cfg, max_steps, per_step)
    plan = make_plan(store, sequence, val_side, max_steps=max_steps, blocks_per_step=per_step,
                     val_max_blocks=cfg.data.val_max_blocks, max_store_bytes=budget,
                     policy=cfg.stream.epoch_policy, run=run)
    saved = session.read_plan()
    if saved is not None and not saved.same_run(plan):
        if saved.run.get("output") != plan.run["output"]:
            raise StoreFormatError(f"{store.path} is being streamed for the run {saved.run.get('output')} (its stream "
                                   "plan): give this run another --store, or continue that run")
        if state is not None:
            raise InputError(f"{store.path}: its stream plan is not this run's ({saved.record()['run']} against "
                             f"{plan.run}, policy {saved.policy} against {plan.policy}); resume with the saved run's "
                             "options, or start over with --force", field="--resume")
    cursor = int((state or {}).get("data", {}).get("cursor", 0)) if state is not None else 0
    resumed = state is not None and saved is not None  # (same_run: checked above)
    consumed = session.consumed() if resumed else 0
    if resumed and consumed > cursor:
        raise InputError(f"{resume_from}: its training state is at entry {cursor} but {store.path} records {consumed} "
                         "entries consumed (a later checkpoint was removed?): blocks this run reads next may be evicted "
                         "already; resume from the latest checkpoint, or start over with --force", field="--resume")
    accelerator.wait_for_everyone()  # every rank has read the saved plan and cursor before the main one rewrites them
    session.plan = plan  # what every rank follows (the main rank writes it)
    if accelerator.is_main_process:
        if not resumed:  # a new run: the cursor starts at 0; a resume whose store has no plan: at its checkpoint's
            # (else the extraction would wait for entries before it, the trainer for after)
            session.write_plan(plan, consumed=cursor, checkpoint=resume_from if state is not None else None)
        elif saved.record() != plan.record():  # the same run with another budget: its cursor stays
            session.write_plan(plan, keep_consumed=True)
        if resumed and cursor > consumed:  # saved, but killed before its cursor was written
            session.mark_consumed(resume_from, cursor)
    accelerator.wait_for_everyone()
    unit = "context block" if plan.reads is not None else "block"
    if accelerator.is_main_process:  # one line per run, not one per rank
        print(f"stream: {plan.n_entries} entries, policy {plan.policy}, window {plan.window} entries, {unit}s of "
              f"{plan.block_bytes:,} bytes, {len(plan.val_blocks)} validation blocks, budget "
              f"{plan.max_store_bytes:,} bytes; {plan.extractions()} {unit} extractions planned", file=sys.stderr)
        note = rerun_note(session, plan, len(sequence), sequence.order_rule)
        if note:
            print(f"note: {note}", file=sys.stderr)


def plan_run_identity(cfg: TrainConfig, max_steps: int, blocks_per_step: int) -> dict[str, Any]:
    """The run identity a stream plan records: two runs of one identity read the same blocks in one order
    (``epoch_order`` only when not ``blocks``, so a plan written before the option stays the same run's)."""
    run = {"output": str(Path(cfg.run.output).resolve()), "seed": cfg.run.seed, "val_fraction": cfg.data.val_fraction,
           "val_max_blocks": cfg.data.val_max_blocks, "max_steps": int(max_steps),
           "blocks_per_step": int(blocks_per_step)}
    return run if cfg.data.epoch_order == "blocks" else {**run, "epoch_order": cfg.data.epoch_order}

