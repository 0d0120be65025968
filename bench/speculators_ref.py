"""speculators' own P-EAGLE functions, loaded from the installed release for benchmarks only.

The reference is the released ``speculators`` 0.9.0 wheel, installed without its dependencies
(``pip install --no-deps "speculators==0.9.0"``, or ``PEAGLE_BENCH=1 bash scripts/setup_env.sh``).
Its package ``__init__`` imports training services (openai, datasets, hs_connectors), so the two
torch-only modules used here (``models/peagle/data.py``, ``models/peagle/attention.py``) are loaded
by file from the installed distribution; nothing of theirs is copied into this repository.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from types import ModuleType

VERSION = "0.9.0"


def _load(relpath: str, name: str) -> ModuleType:
    try:
        dist = importlib.metadata.distribution("speculators")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f'speculators is not installed: pip install --no-deps "speculators=={VERSION}" '
                         "(or PEAGLE_BENCH=1 bash scripts/setup_env.sh)") from None
    if dist.version != VERSION:
        raise SystemExit(f"speculators {dist.version} is installed; these benchmarks compare against {VERSION}")
    spec = importlib.util.spec_from_file_location(name, dist.locate_file(f"speculators/{relpath}"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def generate_cod_sample_indices():
    """speculators' ``generate_cod_sample_indices(seq_length, loss_mask, num_depths, ...)``."""
    return _load("models/peagle/data.py", "_speculators_peagle_data").generate_cod_sample_indices


def create_peagle_mask_mod():
    """speculators' ``create_peagle_mask_mod(anchor_pos, depth, document_ids, sliding_window)``."""
    return _load("models/peagle/attention.py", "_speculators_peagle_attention").create_peagle_mask_mod
