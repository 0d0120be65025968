"""The conversation stream of ``tokenize``/``pack``: plain INPUTs or a mixture file, optionally one shard.

Order of the steps, per source: read (a source's ``limit`` counts rows read) -> sample by weight
(:mod:`peagle_data.prepare.mixtures`) -> deduplicate (across all sources; copy k of a row duplicates only
copy k of an earlier one, so a row is never rejected as the duplicate of a copy its weight did not
draw) -> keep this shard's items (:mod:`peagle_data.prepare.shards`) -> render and tokenize. Every step
before the shard filter runs the same in every shard, so shards draw the same rows and duplicates
as the unsharded run.

Per-source counts (:attr:`peagle_data.prepare.counts.Counts.sources`, by source name): ``read`` (rows read from the source's files),
``duplicates``, ``sampled_out`` (conversations a weight below 1 drew 0 times), ``copies`` (extra
copies a weight above 1 drew), ``other_shards`` (items left to other shards), ``rejected`` (every
reject: reader, duplicate, template, filter, and in ``pack`` the window stage) and ``used``, with
``read - sampled_out + copies - other_shards == used + rejected``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Iterator, Sequence

from peagle_data.prepare.counts import Counts
from peagle_data.prepare.dedup import Deduplicator
from peagle_data.prepare.mixtures import Mixture, is_mixture_file, load_mixture, sample_items
from peagle_data.readers.inputs import UniqueIds, resolve_inputs
from stores.errors import InputError
from stores.tables.token_rows import TokenizedRow

__all__ = ["mixture_of", "input_files", "iter_source_groups", "source_rejected", "source_bump"]

def mixture_of(inputs: Sequence[str | os.PathLike]) -> Mixture | None:
    """The mixture when INPUT is one mixture file; None for plain inputs.

    Raises:
        InputError: a mixture file among other INPUTs, or an invalid mixture file.
    """
    flags = [is_mixture_file(i) for i in inputs]
    if not any(flags):
        return None
    if len(inputs) != 1:
        raise InputError("a mixture file must be the only INPUT (list every source in it)")
    return load_mixture(inputs[0])


def input_files(inputs: Sequence[str | os.PathLike], mixture: Mixture | None) -> list[str]:
    """The conversation files a run reads (checks every source's paths before any output is touched)."""
    if mixture is None:
        return [str(f) for f in resolve_inputs(inputs)]
    return [str(f) for s in mixture.sources for f in resolve_inputs(list(s.inputs))]


def iter_source_groups(iter_tokenized: Callable[..., Iterator[list[TokenizedRow]]], inputs, mixture, tokenizer,
                       cfg, rejects, counts: Counts,
                       shard: Callable | None = None) -> Iterator[list[TokenizedRow]]:
    """Tokenized conversation groups of plain INPUTs or of every mixture source in order.

    Args:
        iter_tokenized: :func:`peagle_data.prepare.tokenizing.iter_tokenized` (passed in: that module imports this one).
        mixture: from :func:`mixture_of`; None for plain inputs.
        cfg: the run's TokenizeConfig; a source's ``limit``, ``chat_template`` and ``format`` replace its own.
        shard: a filter of reader items keeping this shard's (:func:`peagle_data.prepare.shards.shard_filter`), or None.

    Yields:
        Row groups as :func:`iter_tokenized`; mixture rows carry ``dataset`` (the source's name).
    """
    if mixture is None:
        yield from iter_tokenized(inputs, tokenizer, cfg, rejects, counts, select=_select(None, shard, counts))
        return
    if cfg.limit is not None:
        raise InputError("--limit does not apply to a mixture file; give each source a 'limit'")
    dedup = Deduplicator() if cfg.dedup else None
    ids = UniqueIds()  # one id space for every source: a window's id names one conversation of the table
    counts.sources = {}
    for src in mixture.sources:
        src_cfg = dataclasses.replace(cfg, limit=src.limit, chat_template=src.chat_template or cfg.chat_template,
                                      format=src.format or cfg.format)
        c = Counts()
        sample = lambda items, src=src, c=c: sample_items(items, mixture.seed, src.name, src.weight, c)  # noqa: E731
        used = 0
        for group in iter_tokenized(list(src.inputs), tokenizer, src_cfg, rejects, c, dedup=dedup, sample=sample,
                                    select=_select(None, shard, c), ids=ids):
            used += 1
            for row in group:
                row.dataset = src.name
            yield group
        counts.add(c)  # every counter of the source's run adds to the run's
        counts.sources[src.name] = {"read": c.read + (c.sampled_out or 0) - (c.copies or 0) + (c.other_shards or 0),
                                    "used": used, "rejected": c.rejected, "duplicates": c.duplicates or 0,
                                    "sampled_out": c.sampled_out or 0, "copies": c.copies or 0,
                                    "other_shards": c.other_shards or 0}


def _select(sample, shard, counts):
    if sample is None and shard is None:
        return None

    def select(items):
        if sample is not None:
            items = sample(items)
        if shard is not None:
            items = shard(items, counts)
        return items
    return select


def source_rejected(counts: Counts, group: list[TokenizedRow]) -> None:
    """A conversation of a mixture source rejected after tokenization (``pack``'s window stage)."""
    name = group[0].dataset
    if name is not None and name in (counts.sources or {}):
        counts.sources[name]["used"] -= 1
        counts.sources[name]["rejected"] += 1


def source_bump(counts: Counts, group: list[TokenizedRow], **increments: int) -> None:
    """Add to the per-source counts of a tokenize output's conversation (``pack`` of a mixture's
    tokenize output: its rows carry ``dataset``); nothing for rows without a source."""
    name = group[0].dataset
    if name is None:
        return
    c = counts.source(name)
    for key, n in increments.items():
        c[key] = c.get(key, 0) + n
