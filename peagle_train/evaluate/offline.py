"""Offline evaluation: every drafted chain of held-out blocks against the verifier's argmax (docs/design.md §9)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_train.data.cod import CodElements, element_inputs
from peagle_train.data.loader import split_blocks
from peagle_train.data.multistore import store_identity
from peagle_train.data.segment_hashes import count_in, segment_hashes
from peagle_train.data.split import SPLIT_CONVERSATIONS
from peagle_train.evaluate.checks import check_store_fits
from peagle_train.generate.checks import check_verifier_config
from peagle_train.evaluate.config import DEFAULT_MAX_NEW_TOKENS, EvalConfig
from peagle_train.generate.render import verifier_eos_ids
from peagle_train.evaluate.replay import TurnReplay
from peagle_train.generate.speculative import checked_num_draft_tokens
from peagle_train.model.attention import element_attention
from peagle_train.model.checkpoint import TRAINING_SEGMENTS_FILE, read_training_segments
from peagle_train.train.kinds import load_drafter_of_kind
from stores.errors import StoreMismatchError
from stores.features.feature_store import FeatureStore
from runtime.model_cache import load_output_head, model_files
from runtime.verifier_match import check_store_verifier


def _argmax_chunked(x: torch.Tensor, head: torch.Tensor, rows: int = 1024, vocab: int = 8192) -> torch.Tensor:
    """``argmax(x @ head^T)`` in float32, ``[N, H], [V, H] -> [N] int64``, without a float32 copy of ``head``.

    ``head`` stays in its own dtype (the verifier's); each ``vocab`` slice of it is upcast in turn and ``rows``
    rows of ``x`` are scored against it, so at most ``rows x vocab`` logits and one upcast slice are alive. Ties
    go to the lowest id, as ``torch.argmax``.
    """
    N = x.shape[0]
    best = torch.full((N,), float("-inf"))
    arg = torch.zeros(N, dtype=torch.long)
    for v0 in range(0, head.shape[0], vocab):
        part = head[v0:v0 + vocab].float()  # [Vc, H]
        for r0 in range(0, N, rows):
            logits = x[r0:r0 + rows].float().to(part.device) @ part.T  # [rows, Vc]
            top, where = logits.max(-1)
            top, where = top.cpu(), where.cpu()
            better = top > best[r0:r0 + rows]  # strict: an earlier slice keeps a tie
            best[r0:r0 + rows] = torch.where(better, top, best[r0:r0 + rows])
            arg[r0:r0 + rows] = torch.where(better, where + v0, arg[r0:r0 + rows])
    return arg


#: the attention backend offline evaluation runs (a key of ``peagle_train.model.attention.ATTENTION_BACKENDS``):
#: split, no element×element mask
OFFLINE_ATTENTION = "split"


@torch.no_grad()
def segment_predictions(drafter, block, start: int, n: int, num_depths: int, chunk_anchors: int = 256,
                        attention_backend: str = OFFLINE_ATTENTION) -> torch.Tensor:
    """The drafter's argmax for every element ``(a, d)`` of one segment ``[start, start+n)``, all chains.

    Anchors are processed ``chunk_anchors`` at a time: one pass holds the depth-0 elements up to the
    chunk's last anchor (the context its chains may attend) and the chunk's chains, under the §8 rule
    (the ``attention_backend``; the split one needs no ``[E, E]`` mask).

    Args:
        drafter: a ``PEagleDrafter``.
        block: ``input_ids, position_ids [T] int64``, ``aux_hidden [T, L, H]`` or ``[T, L*H]``.
        start, n: the segment's first row and length.
        num_depths: K.
        chunk_anchors: anchors per drafter pass.
        attention_backend: the backend each pass builds for its elements (forward only).

    A drafter kind whose drafts are not P-EAGLE's chains brings its own ``block_predictions`` in the same layout
    (a DFlash drafter: :meth:`~peagle_train.model.dflash.DFlashDrafter.block_predictions`, the block anchored at
    ``x_{a+1}``).

    Returns:
        ``[A, K] int64`` draft-vocab ids for the ``A = max(n - 2, 0)`` anchors; -1 where the element
        does not exist (``a + d + 2 > n - 1``).
    """
    own = getattr(drafter, "block_predictions", None)
    if own is not None:
        return own(block, start, n, num_depths, chunk_anchors)
    K = num_depths
    A = max(n - 2, 0)
    pred = torch.full((A, K), -1, dtype=torch.long)
    exists = (torch.arange(A)[:, None] + torch.arange(K)[None, :] + 2) <= n - 1  # [A, K]
    device = drafter.d2t.device
    dtype = next(drafter.parameters()).dtype
    aux = block.aux_hidden.reshape(block.aux_hidden.shape[0], -1)  # [T, L*H]
    for c0 in range(0, A, chunk_anchors):
        c1 = min(c0 + chunk_anchors, A)
        parts = [torch.arange(c1)] + [torch.arange(c0, c1)[exists[c0:c1, d]] for d in range(1, K)]
        anchor = torch.cat(parts) + start  # [E] row indices, sorted by (depth, anchor)
        depth = torch.cat([torch.full((p.numel(),), d) for d, p in enumerate(parts)])  # [E]
        elements = CodElements(anchor, depth, torch.zeros_like(anchor), torch.ones(anchor.numel()))
        inputs = element_inputs(elements, block.input_ids, block.position_ids)
        attn = element_attention(attention_backend, elements.to(device))  # the §8 rule of this pass
        hidden = drafter(inputs.input_ids.to(device), aux[inputs.feature_index].to(device, dtype),
                         inputs.is_mask.to(device), inputs.position_ids.to(device), attn)  # [E, H]
        keep = (depth > 0) | (anchor - start >= c0)  # depth-0 elements before c0 were scored already
        ids = torch.cat([drafter.logits(h).argmax(-1).cpu() for h in hidden[keep].split(1024)])  # [E']
        pred[anchor[keep] - start, depth[keep]] = ids
    return pred


@dataclass
class _OfflineTotals:
    K: int
    depth_correct: torch.Tensor = None  # [K] weighted correct
    depth_weight: torch.Tensor = None  # [K] weight sums
    reached: torch.Tensor = None  # [K] anchors whose chain reached depth i
    accepted_at: torch.Tensor = None  # [K] anchors whose depth i was accepted
    accepted: int = 0
    anchors: int = 0

    def __post_init__(self) -> None:
        for name in ("depth_correct", "depth_weight", "reached", "accepted_at"):
            setattr(self, name, torch.zeros(self.K, dtype=torch.long))

    def add(self, correct: torch.Tensor, valid: torch.Tensor, ends: torch.Tensor | None = None) -> None:
        """``correct, valid, ends [A, K] bool``; valid = element exists and has weight 1; ends = its
        target is an EOS token.

        An EOS target ends the output whether it is drafted or not, so (as online, see
        ``speculative._record_step``) it and the depths after it are not scored in chains: a chain
        counts the depths accepted before it, and an anchor whose depth-0 target is an EOS is not
        counted. Per-depth accuracy still scores every valid element.
        """
        self.depth_correct += (correct & valid).sum(0)
        self.depth_weight += valid.sum(0)
        scored = valid if ends is None else valid & ~ends  # [A, K]
        counted = scored[:, 0]
        ok = (correct & scored)[counted].long()  # [A', K]
        n_acc = ok.cumprod(1).sum(1)  # [A'] accepted depths per chain
        i = torch.arange(self.K)
        self.reached += ((n_acc[:, None] >= i[None, :]) & scored[counted]).sum(0)
        self.accepted_at += (n_acc[:, None] > i[None, :]).sum(0)
        self.accepted += int(n_acc.sum())
        self.anchors += int(counted.sum())

    def report(self) -> dict[str, Any]:
        def ratios(num: torch.Tensor, den: torch.Tensor) -> list[float | None]:
            return [n / d if d else None for n, d in zip(num.tolist(), den.tolist())]

        mean_acc = self.accepted / self.anchors if self.anchors else 0.0
        return {
            "per_depth_accuracy": ratios(self.depth_correct, self.depth_weight),
            "per_depth_correct": self.depth_correct.tolist(),
            "per_depth_weight": self.depth_weight.tolist(),
            "per_position_acceptance": ratios(self.accepted_at, self.reached),
            "per_position_accepted": self.accepted_at.tolist(),
            "per_position_reached": self.reached.tolist(),
            "simulated_acceptance_length": 1.0 + mean_acc,
            "mean_accepted": mean_acc,
            "positions_scored": self.anchors,
            "num_depths": self.K,
        }


def evaluate_offline(drafter, blocks: Iterable, lm_head_weight: torch.Tensor | None, num_depths: int | None = None,
                     chunk_anchors: int = 256, progress: Callable[[int], None] | None = None,
                     eos_token_ids: Iterable[int] = (), replay: TurnReplay | None = None,
                     conversation: Callable[[int, int], int] | None = None,
                     whole: Callable[[int, int], bool | None] | None = None) -> dict[str, Any]:
    """Offline acceptance of ``drafter`` on stored blocks (see the module docstring for definitions).

    Args:
        drafter: a ``PEagleDrafter`` or a ``DFlashDrafter`` (:func:`segment_predictions`).
        blocks: objects with ``input_ids, loss_mask, position_ids [T] int64``, ``cu_seqlens [S+1]``,
            ``aux_hidden [T, L, H]`` or ``[T, L*H]`` (bf16/float) and ``final_hidden [T, H]``
            (e.g. ``FeatureStore.read_block`` results).
        lm_head_weight: ``[V, H]`` the verifier's lm_head (any float dtype; kept in it), whose float32 argmax over
            all V rows is the all-anchor target; None: no all-anchor figures (the replay needs only the stored
            tokens: the verifier's own answers).
        num_depths: K chain length scored; default the drafter's ``num_depths``.
        chunk_anchors: anchors per drafter pass; each pass runs ``T + chunk * K`` elements through the
            split attention (no element×element mask).
        progress: called with 1 after each block.
        eos_token_ids: ids that end generation; a chain stops before an element whose target is one
            of them, as online decoding does (see :meth:`_OfflineTotals.add`).
        replay: also walk every segment's assistant turns as online decoding would, with the same drafts
            (:class:`~peagle_train.evaluate.replay.TurnReplay`, filled in place).
        conversation: ``(j, k) -> key`` of the j-th block's segment k (the replay's bootstrap unit); default
            every segment its own conversation.
        whole: ``(j, k) ->`` whether that segment is a whole conversation (None: not known); default True.

    Returns:
        ``per_depth_accuracy`` (K, None where no weight), ``per_depth_correct``,
        ``per_depth_weight``, ``per_position_acceptance`` (K conditional rates),
        ``simulated_acceptance_length``, ``mean_accepted``, ``positions_scored``, ``num_depths``;
        ``{}`` when ``lm_head_weight`` is None.
    """
    K = checked_num_draft_tokens(num_depths, drafter)
    head = None if lm_head_weight is None else lm_head_weight.detach()  # [V, H], its own dtype
    draft_ids = drafter.draft_ids.cpu()  # [D] verifier id of each draft id
    totals = _OfflineTotals(K)
    eos = torch.tensor(sorted({int(e) for e in eos_token_ids}), dtype=torch.long)
    drafter.eval()
    for j, block in enumerate(blocks):
        cu = block.cu_seqlens.tolist()
        m = block.loss_mask.long()
        for k, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
            n = end - start
            if n < 3:
                continue
            seg_m = m[start:end]  # [n]
            pred = segment_predictions(drafter, block, start, n, K, chunk_anchors)  # [A, K] draft ids
            exists = pred >= 0
            drafted = torch.where(exists, draft_ids[pred.clamp_min(0)], torch.full_like(pred, -1))  # [A, K]
            if head is not None:
                _score_all_anchors(totals, block, start, seg_m, drafted, head, eos)
            if replay is not None:
                key = conversation(j, k) if conversation is not None else (j << 20) + k
                replay.add_segment(key, block.input_ids[start:end].numpy(), seg_m.numpy(), drafted.numpy(),
                                   f"block {getattr(block, 'block_id', j)} segment {k}",
                                   whole(j, k) if whole is not None else True)
        if progress is not None:
            progress(1)
    return {} if head is None else totals.report()


def _score_all_anchors(totals: _OfflineTotals, block, start: int, seg_m: torch.Tensor, drafted: torch.Tensor,
                       head: torch.Tensor, eos: torch.Tensor) -> None:
    """Add one segment's chains to ``totals``: ``seg_m [n]`` its loss mask, ``drafted [A, K]`` verifier ids (-1:
    no element), ``head [V, H]`` the verifier's lm_head, ``eos [E]`` int64."""
    n, K = seg_m.shape[0], totals.K
    exists = drafted >= 0
    # The verifier's full-vocab argmax z_r for the rows whose next token carries weight: the
    # only targets that are ever scored (an element's target row is label - 1).
    rows = torch.nonzero(seg_m[1:] == 1).flatten()  # [R] local rows r with m_{r+1} = 1
    target = torch.full((n,), -1, dtype=torch.long)
    target[rows] = _argmax_chunked(block.final_hidden[start + rows], head)  # verifier ids
    label = torch.arange(n - 2)[:, None] + torch.arange(K)[None, :] + 2  # [A, K] local x index
    label = torch.where(exists, label, torch.zeros_like(label))
    weight = exists & (seg_m[label] == 1)  # [A, K] w = m_{a+d+2}
    correct = weight & (drafted == target[label - 1])  # target of (a, d) is argmax z_{a+d+1}
    ends = exists & torch.isin(block.input_ids[start + label], eos)  # [A, K] target is an EOS
    totals.add(correct, weight, ends)


@dataclass(frozen=True)
class BlockSelection:
    """The blocks offline evaluation scores and what they are (docs/design.md §9)."""

    ids: list[int]
    split: str
    """``validation`` (the training run's held-out blocks of this very store), ``training`` (its
    training store, of which it held out none), ``other_store`` (a store it was not trained on: every
    done block), ``all`` (the checkpoint records no training store: every done block) or ``given``."""
    blocks_done: int
    blocks_total: int
    warnings: list[str]

    def report(self) -> dict[str, Any]:
        """The report fields: ``split``, ``blocks``, ``store_blocks_done``, ``store_blocks_total``, ``warnings``."""
        return {"split": self.split, "blocks": self.ids, "store_blocks_done": self.blocks_done,
                "store_blocks_total": self.blocks_total, "warnings": self.warnings}


def _training_store(store, training: dict[str, Any]) -> tuple[int | None, str | None]:
    """(global id of ``store``'s block 0 in the training run, None) when ``store`` is one of the run's
    stores (same :func:`~peagle_train.data.multistore.store_identity`, any path; for checkpoints that
    record only a ``store`` path, the same resolved path); else (None, why not)."""
    if training.get("stores"):
        ident = store_identity(store)
        for entry in training["stores"]:
            if {k: entry.get(k) for k in ident} == ident:
                return int(entry["first_block"]), None
        paths = ", ".join(e.get("path", "?") for e in training["stores"])
        return None, (f"{store.path} is not a store this drafter was trained on (it was trained on {paths}; "
                      "another packed table, shard, verifier or layer set): every done block is scored as "
                      "split 'other_store', none of them is held-out validation data")
    recorded = training.get("store")
    if isinstance(recorded, str) and Path(recorded).resolve() == Path(str(store.path)).resolve():
        return 0, None
    if recorded:
        return None, (f"{store.path} is not the store this drafter was trained on ({recorded}): every done "
                      "block is scored as split 'other_store', none of them is held-out validation data")
    return None, ("the drafter's config.json records no training store: every done block is scored as split "
                  "'all'; some may have been trained on")


def _held_out(done, n_blocks: int, first: int, training: dict[str, Any]):
    """``[M] int64`` the training run's held-out blocks among a training store's ``done`` ones: the recorded
    global ``val_blocks`` in ``[first, first + n_blocks)`` (a run records its whole validation side,
    extracted or not, so a held-out block extracted after training is scored too; earlier runs recorded
    the done ones), or (checkpoints without them) ``split_blocks(done, seed, val_fraction)``, the split
    of those earliest runs."""

    if "val_blocks" in training:
        val = np.asarray(training["val_blocks"], dtype=np.int64) - first
        return np.intersect1d(done, val[(val >= 0) & (val < n_blocks)])
    if training.get("val_fraction"):
        return split_blocks(done, int(training.get("seed", 0)), float(training["val_fraction"]))[1]
    return done[:0]


def _split_leak_warning(store, held: np.ndarray, val_side: np.ndarray, training: dict[str, Any]) -> str | None:
    """A warning for a drafter whose validation split was drawn over blocks alone (a checkpoint without
    ``peagle_training.split`` version 2, docs/design.md §8): its held-out blocks may share conversations
    (windows, mixture copies) with its training blocks. With the store's segment keys it counts the scored
    ``held`` blocks that share one with a block outside the run's whole validation side ``val_side``."""
    if int((training.get("split") or {}).get("version", 1)) >= SPLIT_CONVERSATIONS or held.size == 0:
        return None
    why = (f"the training run drew its validation split of {store.path} over blocks alone (an earlier peagle), so "
           "its held-out blocks may share conversations (windows, mixture copies) with its training blocks")
    keys = store.segment_keys() if isinstance(store, FeatureStore) else None
    if keys is None:
        return why + "; the 'validation' scores may include memorised conversations"
    rest = np.setdiff1d(np.arange(store.n_blocks, dtype=np.int64), val_side)
    shared = np.isin(keys[held], keys[rest]).any(axis=1)
    if not shared.any():
        return None
    return (f"{why}: {int(shared.sum())} of the {held.size} held-out blocks scored share a conversation with a "
            f"training block (first: {held[shared][:5].tolist()}); their scores include memorised conversations")


def select_eval_blocks(store, drafter_config: dict[str, Any] | None = None,
                       max_blocks: int | None = None) -> BlockSelection:
    """The blocks offline evaluation scores: the training run's validation blocks of this very store.

    The training store is recognised by the identities ``peagle-train`` records in the checkpoint's
    ``config.json`` (``peagle_training.stores``, see :func:`_training_store`); its validation blocks
    are the recorded ``val_blocks`` (global ids) that fall in it, or for checkpoints without them
    ``peagle_train.data.loader.split_blocks(done blocks, seed, val_fraction)``. Any other store is scored
    whole as ``other_store``. A store with blocks not extracted yet is named incomplete in ``warnings``.

    Raises:
        StoreMismatchError: no block of the store is done.
    """
    done = np.flatnonzero(store.done_mask()).astype(np.int64)
    if done.size == 0:
        raise StoreMismatchError(f"{store.path}: no block is done; {store.repair_command()} extracts them")
    training = (drafter_config or {}).get("peagle_training") or {}
    warnings = [] if done.size == store.n_blocks else [
        f"{store.path} is an incomplete store: {done.size} of {store.n_blocks} blocks extracted; only those are scored"]
    first, why = _training_store(store, training)
    if first is None:
        warnings.append(why)
        ids, split = done, ("other_store" if training.get("stores") or training.get("store") else "all")
    else:
        ids, split = _held_out(done, store.n_blocks, first, training), "validation"
        leak = _split_leak_warning(store, ids, _held_out(np.arange(store.n_blocks, dtype=np.int64), store.n_blocks,
                                                           first, training), training)
        if leak:
            warnings.append(leak)
        if ids.size == 0:
            held = _held_out(np.arange(store.n_blocks, dtype=np.int64), store.n_blocks, first, training)
            ids, split = done, "training"
            warnings.append(
                f"the training run held out no block of {store.path}: every block scored was trained on" if held.size
                == 0 else f"none of the {held.size} block(s) the training run held out of {store.path} is extracted "
                f"(first: {held[:5].tolist()}): every block scored is a training block")
    ids = ids.tolist()
    return BlockSelection(ids[:max_blocks] if max_blocks else ids, split, int(done.size), int(store.n_blocks), warnings)


def replay_max_new_tokens(store: FeatureStore, given: int | None) -> tuple[int, str]:
    """The limit a replay walks ``store``'s turns with, and where it comes from: the store's recorded
    ``max_new_tokens`` (:meth:`~stores.features.feature_store.FeatureStore.generation`, ``"store"``), else ``given``
    (``"given"``), else :data:`~peagle_train.evaluate.config.DEFAULT_MAX_NEW_TOKENS` (``"default"``).

    Raises:
        StoreMismatchError: ``given`` differs from the store's recorded limit (another limit walks other turns:
            another AL), naming both.
    """
    recorded = (store.generation() or {}).get("max_new_tokens")
    if recorded is None:
        return (int(given), "given") if given is not None else (DEFAULT_MAX_NEW_TOKENS, "default")
    if given is not None and int(given) != int(recorded):
        raise StoreMismatchError(f"{store.path}: its turns were generated with max_new_tokens {recorded}, but "
                                 f"--max-new-tokens gives {given}: a replay with another limit walks other turns and "
                                 f"gives another AL; omit --max-new-tokens (the store's {recorded} is used) or pass "
                                 f"{recorded}")
    return int(recorded), "store"


def check_complete(store: FeatureStore, allow_partial: bool) -> None:
    """Refuse an incomplete store unless ``allow_partial`` (its done blocks alone would be scored, a smaller
    set than the one asked for).

    Raises:
        StoreMismatchError: some block is not extracted, with the count and the command that finishes it.
    """
    done = int(store.done_mask().sum())
    if done < store.n_blocks and not allow_partial:
        raise StoreMismatchError(f"{store.path} is an incomplete store: {done} of {store.n_blocks} blocks extracted; "
                                 f"{store.repair_command()} finishes it, or pass --allow-partial to score the "
                                 "extracted blocks alone")


def contamination(store: FeatureStore, ids: Sequence[int], drafter_dir: str | Path) -> dict[str, Any]:
    """How many segments of ``store``'s blocks ``ids`` the drafter was trained on: their token hashes
    (:func:`~peagle_train.data.segment_hashes.segment_hashes`; a judge store's segments are whole conversations)
    found among those its checkpoint records (:data:`~peagle_train.model.checkpoint.TRAINING_SEGMENTS_FILE`).

    Returns:
        ``{"segments", "in_training", "training_segments"}``, or ``{"skipped": why}`` when the checkpoint records
        no training segments.
    """
    recorded = read_training_segments(drafter_dir)
    if recorded is None:
        return {"skipped": f"{drafter_dir} records no training segments ({TRAINING_SEGMENTS_FILE}, written by "
                           "peagle-train): whether the drafter was trained on these conversations is not known"}
    tokens = [store.read_tokens(int(i)) for i in ids]
    hashes = np.concatenate([segment_hashes(t["input_ids"], t["cu_seqlens"]) for t in tokens] or
                            [np.zeros(0, np.uint64)])
    return {"segments": int(hashes.size), "in_training": count_in(hashes, recorded),
            "training_segments": int(recorded.size)}


def contamination_line(found: dict[str, Any], drafter_dir: str | Path) -> str:
    """The stderr line of a :func:`contamination` result: a warning when some segment was trained on."""
    if "skipped" in found:
        return f"contamination: not known: {found['skipped']}"
    if found["in_training"]:
        return (f"warning: contamination: {found['in_training']} of the {found['segments']} segments scored (whole "
                f"conversations in a judge store) are among those {drafter_dir} was trained on")
    return (f"contamination: none of the {found['segments']} segments scored is among the "
            f"{found['training_segments']} {drafter_dir} was trained on")


def judge_problems(report: dict[str, Any], allow_contaminated: bool = False,
                   allow_refused_turns: bool = False) -> list[str]:
    """Why a :func:`run_offline_eval` report cannot stand as a judge figure (``bench/judge_replay.py``,
    ``bench/bench_losses.py``'s replay): no walkable turn; turns not walked (the AL would be of the others alone)
    unless ``allow_refused_turns``; conversations the drafter was trained on unless ``allow_contaminated``."""
    replay, problems = report.get("replay") or {}, []
    if "skipped" in replay:
        problems.append(replay["skipped"])
    refused = replay.get("refused_turns") or {}
    if refused and not allow_refused_turns and "skipped" not in replay:
        first = list((replay.get("refused_examples") or {}).values())[:1]
        problems.append(f"{sum(refused.values())} assistant turn(s) not walked ({refused}; first: {first}): the AL "
                        "would be of the other turns alone")
    c = report.get("contamination") or {}
    if c.get("in_training") and not allow_contaminated:
        problems.append(f"{c['in_training']} of its {c['segments']} conversations are among the segments the drafter "
                        "was trained on: its AL there is of memorised data, not of held-out data")
    return problems


def run_offline_eval(drafter_dir: str | Path, store: str | Path, max_blocks: int | None = None,
                     blocks: Sequence[int] | None = None, verifier_name: str | None = None,
                     num_depths: int | None = None, chunk_anchors: int = 256,
                     progress_factory: Callable[[int], Any] | None = None,
                     log: Callable[[str], None] = lambda m: None, max_new_tokens: int | None = None,
                     seed: int = 0, allow_partial: bool = False, all_anchor: bool = False) -> dict[str, Any]:
    """Offline evaluation of a drafter checkpoint on a feature store (docs/design.md §9): the replayed
    acceptance (``replay``, the primary figure on a judge store) and, when asked, the all-anchor diagnostic. The
    replay reads the store, the drafter and the verifier's tokenizer and generation config (its EOS ids), never the
    verifier's weights; ``all_anchor`` reads its output head alone (:func:`runtime.model_cache.load_output_head`).

    Args:
        drafter_dir: a drafter checkpoint directory.
        store: a feature store path.
        max_blocks: score at most this many of the selected blocks.
        blocks: score exactly these block ids (default: :func:`select_eval_blocks`).
        verifier_name: the store's verifier MODEL (its EOS ids; with ``all_anchor`` its output head builds the
            targets); default the store's ``verifier.name_or_path``.
        num_depths: chain length K; default the drafter's.
        chunk_anchors, progress_factory: see :func:`evaluate_offline` / :func:`run_online_eval`.
        log: called with each warning of the block selection (another store, an incomplete one).
        max_new_tokens: the most tokens per turn the store's continuations were generated with (the replay walks
            a turn only where decoding with this limit stops where the turn ends); None: the store's recorded
            limit, else :data:`~peagle_train.evaluate.config.DEFAULT_MAX_NEW_TOKENS` (:func:`replay_max_new_tokens`).
        seed: the replay's bootstrap seed.
        allow_partial: score an incomplete store's extracted blocks (default: refused, :func:`check_complete`).
        all_anchor: also score every chain of every supervised position against the verifier's argmax
            (``--all-anchor``; the figures of :func:`evaluate_offline`, a diagnostic, and the only figure on a
            store whose turns are not the verifier's own answers, such as a training store's held-out blocks).

    Returns:
        ``all_anchor`` (bool), with it the :func:`evaluate_offline` report (its ``simulated_acceptance_length``
        is the all-anchor mean, a diagnostic), ``replay`` (:meth:`~peagle_train.evaluate.replay.TurnReplay.report`),
        plus :meth:`BlockSelection.report` (``split``, ``blocks``, ``store_blocks_done``, ``store_blocks_total``,
        ``warnings``), ``store``, ``drafter``, ``verifier``, ``max_new_tokens`` and ``max_new_tokens_from``
        (``store``, ``given`` or ``default``), ``contamination`` (:func:`contamination`).

    Raises:
        StoreFormatError: not a feature store or not a drafter checkpoint.
        StoreMismatchError: the store's layers / sizes do not fit the drafter; no done block; the
            verifier is not the store's (:func:`runtime.verifier_match.check_store_verifier`: its content
            fingerprint, which reads 1 MB at both ends of each weight file, and its tokenizer); an incomplete
            store without ``allow_partial``; ``max_new_tokens`` other than the store's recorded limit.
    """
    EvalConfig(max_blocks=max_blocks, chunk_anchors=chunk_anchors, num_draft_tokens=num_depths,
               max_new_tokens=max_new_tokens)
    drafter = load_drafter_of_kind(drafter_dir).eval()
    fs = FeatureStore.open(store)
    check_store_fits(fs, drafter)
    check_complete(fs, allow_partial)
    max_new_tokens, limit_from = replay_max_new_tokens(fs, max_new_tokens)
    chosen, contaminated = choose_blocks(fs, drafter_dir, blocks, max_blocks, log)
    name = verifier_name or fs.attrs.get("verifier", {}).get("name_or_path")
    if not name:
        raise StoreMismatchError(f"{store}: the store names no verifier; pass verifier_name")
    check_verifier_config(name, drafter)  # config alone
    # the store's turns are this verifier's answers (hashes its files, loads nothing)
    check_store_verifier(fs, model_files(name))
    return score_store(drafter, fs, name, chosen, contaminated, max_new_tokens, limit_from, drafter_dir=drafter_dir,
                       store=store, num_depths=num_depths, chunk_anchors=chunk_anchors,
                       progress_factory=progress_factory, log=log, seed=seed, all_anchor=all_anchor)


def choose_blocks(fs: FeatureStore, drafter_dir: str | Path, blocks: Sequence[int] | None, max_blocks: int | None,
                  log: Callable[[str], None]) -> tuple[BlockSelection, dict[str, Any]]:
    """The blocks an offline run scores (``blocks``, else :func:`select_eval_blocks`), each selection warning and
    the contamination line logged; ``(selection, contamination(...))``."""
    if blocks is None:
        chosen = select_eval_blocks(fs, json.loads((Path(drafter_dir) / "config.json").read_text()), max_blocks)
    else:
        done = int(fs.done_mask().sum())
        chosen = BlockSelection(list(blocks)[:max_blocks] if max_blocks else list(blocks), "given", done,
                                fs.n_blocks, [])
    for note in chosen.warnings:
        log(f"warning: {note}")
    contaminated = contamination(fs, chosen.ids, drafter_dir)
    log(contamination_line(contaminated, drafter_dir))
    return chosen, contaminated


def score_store(drafter, fs: FeatureStore, name: str, chosen: BlockSelection, contaminated: dict[str, Any],
                max_new_tokens: int, limit_from: str, *, drafter_dir: str | Path, store: str | Path,
                num_depths: int | None = None, chunk_anchors: int = 256,
                progress_factory: Callable[[int], Any] | None = None, log: Callable[[str], None] = lambda m: None,
                seed: int = 0, all_anchor: bool = False) -> dict[str, Any]:
    """The report of :func:`run_offline_eval` on the checked store ``fs`` and verifier MODEL ``name``: the
    ``chosen`` blocks scored by the loaded ``drafter``, replayed with ``max_new_tokens`` (recorded as from
    ``limit_from``); reads the verifier's tokenizer and generation config, with ``all_anchor`` its output head."""
    ids = chosen.ids
    lm_head = load_output_head(name) if all_anchor else None  # [V, H] the verifier's dtype
    eos = verifier_eos_ids(name)
    replay = TurnReplay(checked_num_draft_tokens(num_depths, drafter), max_new_tokens, frozenset(eos), seed)
    keys = fs.segment_keys()
    conversation = None if keys is None else (lambda j, k: int(keys[ids[j], k]))
    wholes: dict[int, Any] = {}

    def whole(j: int, k: int) -> bool | None:  # the store's record of block ids[j]'s segments, read once per block
        if j not in wholes:
            wholes[j] = fs.whole_conversations(ids[j], fs.read_tokens(ids[j])["cu_seqlens"])
        return None if wholes[j] is None else bool(wholes[j][k])

    bar = progress_factory(len(ids)) if progress_factory else None
    try:
        report = evaluate_offline(drafter, (fs.read_block(i) for i in ids), lm_head, num_depths,
                                  chunk_anchors, progress=bar.update if bar is not None else None,
                                  eos_token_ids=eos, replay=replay, conversation=conversation, whole=whole)
    finally:
        if bar is not None:
            bar.close()
    replayed = replay.report()
    if replay.unchecked:
        log(f"warning: replay: {fs.path} is a --context window store, which does not record whether its {replay.unchecked} "
            "segment(s) are whole conversations: the replay is exact only where each is one (judge sets: "
            "scripts/judge_set.py, extract --context full)")
    if replay.refused:
        log(f"warning: replay: {sum(replay.refused.values())} assistant turn(s) not walked, as online decoding would "
            f"not produce them: {replay.refused}; first: {list(replay.first_refusal.values())[0]}")
    return {"drafter": str(drafter_dir), "store": str(store), "verifier": str(name), **chosen.report(), **report,
            "all_anchor": all_anchor, "replay": replayed, "max_new_tokens": max_new_tokens,
            "max_new_tokens_from": limit_from, "contamination": contaminated}
