"""``peagle-data tokenize`` and ``pack``: the runs, their configs, and the stages between: which
conversations a run reads (sources, mixtures, shards), deduplication, windows, packing, counts."""
