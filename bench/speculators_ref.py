"""speculators' own P-EAGLE and DFlash functions, loaded from the installed release for benchmarks only.

The reference is the released ``speculators`` 0.9.0 wheel, installed without its dependencies
(``pip install --no-deps "speculators==0.9.0"``, or ``PEAGLE_BENCH=1 bash scripts/setup_env.sh``).
Its package ``__init__`` imports training services (openai, datasets, hs_connectors), so the two
torch-only modules used here (``models/peagle/data.py``, ``models/peagle/attention.py``) are loaded
by file from the installed distribution; nothing of theirs is copied into this repository.

:func:`speculators_peagle` and :func:`speculators_dflash` import the package itself (its P-EAGLE or DFlash
model, config and loss, for the side-by-side training benches). Its ``__init__`` chain reaches ``speculators.train.data``, which imports
``openai``, ``datasets`` and ``hs_connectors`` at module top for its data services (vLLM clients,
Arrow datasets, hidden-state transfer); the model, its loss and its factory never call them. Those
three are the dependencies ``--no-deps`` leaves out, so they are given as empty placeholder modules
(:class:`_AbsentServices`) while speculators imports (and taken out of ``sys.modules`` after it, so
that a later ``import openai`` finds the real package or fails as it should), and any attribute of them used at run time is
an empty class, which fails loudly if speculators ever calls one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from types import ModuleType, SimpleNamespace

VERSION = "0.9.0"


def _check_installed() -> None:
    try:
        dist = importlib.metadata.distribution("speculators")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f'speculators is not installed: pip install --no-deps "speculators=={VERSION}" '
                         "(or PEAGLE_BENCH=1 bash scripts/setup_env.sh)") from None
    if dist.version != VERSION:
        raise SystemExit(f"speculators {dist.version} is installed; these benchmarks compare against {VERSION}")


class _AbsentServices(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for speculators' data-service dependencies that ``--no-deps`` leaves out."""

    ROOTS = ("openai", "datasets", "hs_connectors")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = lambda attr: type(attr, (), {})  # a placeholder class per name
        return mod

    def exec_module(self, module) -> None:
        pass


def _import_speculators(names: dict[str, str]) -> SimpleNamespace:
    """``{attribute: "module:name"}`` imported from the installed package, with speculators' data-service
    dependencies given as placeholders while it imports (see the module docstring)."""
    _check_installed()
    finder = None
    if any(importlib.util.find_spec(r) is None for r in _AbsentServices.ROOTS):
        finder = _AbsentServices()
        sys.meta_path.append(finder)
    try:
        found = {}
        for attr, where in names.items():
            module, name = where.split(":")
            found[attr] = getattr(importlib.import_module(module), name)
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
            for name in [n for n, m in sys.modules.items() if getattr(getattr(m, "__spec__", None), "loader", None) is finder]:
                del sys.modules[name]  # speculators keeps what it bound; an ``import openai`` later is the real one
    return SimpleNamespace(**found)


def speculators_peagle() -> SimpleNamespace:
    """speculators' ``PEagleDraftModel`` (with ``from_training_args``) and ``resolve_loss_config``,
    imported from the installed package (see the module docstring for the placeholder services)."""
    return _import_speculators({"PEagleDraftModel": "speculators.models.peagle:PEagleDraftModel",
                                "resolve_loss_config": "speculators.losses:resolve_loss_config"})


def speculators_dflash() -> SimpleNamespace:
    """speculators' ``DFlashDraftModel`` (with ``from_training_args``, ``get_trainer_kwargs`` and its ``forward``:
    anchor selection, block mask, drafter, loss) and ``resolve_loss_config``, imported from the installed
    package as :func:`speculators_peagle` does."""
    return _import_speculators({"DFlashDraftModel": "speculators.models.dflash:DFlashDraftModel",
                                "resolve_loss_config": "speculators.losses:resolve_loss_config"})


def _load(relpath: str, name: str) -> ModuleType:
    _check_installed()
    dist = importlib.metadata.distribution("speculators")
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
