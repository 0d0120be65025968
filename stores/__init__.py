"""Every on-disk format of peagle: token tables, the feature store and its streaming files, staged outputs and
their locks, merges (docs/design.md §2).

This package imports nothing else of peagle; ``peagle_data`` writes through it and ``peagle_train``
reads through it. The error types every package raises are in :mod:`stores.errors`.
"""
