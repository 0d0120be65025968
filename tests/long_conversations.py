"""Multi-turn conversations longer than one window, packed by the real ``peagle-data pack``: the input of
the full-context extraction tests (``extract --context full``) of the engines, training and evaluation.

With the SmolLM2 tokenizer and ``--max-seq-len 64``, the six conversations have 48, 91, 136, 184, 235
and 290 tokens (system prompt 10): 31 windows of at most 64 tokens, so every conversation but the
first is longer than any window, and the last is longer than ``--max-context 256`` (split in two).
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cli.data import main as data_main


def long_conversations(n: int = 6) -> list[dict]:
    """``n`` conversations of ``1 + i`` user/assistant turns (i = 0..n-1) after one system message."""
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "You are terse."}]
        for t in range(1 + i):
            messages += [{"role": "user", "content": f"Count from {i + t} to {i + t + 9}."},
                         {"role": "assistant", "content": " ".join(str(k) for k in range(i + t, i + t + 10))}]
        out.append({"id": f"long{i}", "messages": messages})
    return out


def pack_long(out: Path, tokenizer: Path, max_seq_len: int = 64, block_size: int = 128, n: int = 6) -> Path:
    """``peagle-data pack`` of :func:`long_conversations` into ``out`` (with its ``conversations`` sub-table)."""
    data = out.parent / f"{out.name}.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in long_conversations(n)))
    result = CliRunner().invoke(data_main, ["pack", str(data), "--tokenizer", str(tokenizer), "--output", str(out),
                                            "--max-seq-len", str(max_seq_len), "--block-size", str(block_size)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out
