"""No function over 100 lines in product code (the project's rule; docs/design.md §2).

A function's lines run from its ``def`` to its last line, docstring and nested functions included (read as
source with :mod:`ast`, nothing imported). ``python tests/test_function_length.py [N]`` lists the functions
over N lines (default 100), longest first.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "peagle_data", "peagle_train", "runtime", "stores")
LIMIT = 100


def function_lengths(root: Path = REPO, packages=PACKAGES) -> dict[str, int]:
    """``"path:line name"`` -> lines of every function (methods and nested functions too) of ``packages``."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{path.relative_to(root)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def test_no_product_function_is_over_100_lines():
    lengths = function_lengths()
    assert len(lengths) > 500  # the walk found the packages
    assert {k: n for k, n in lengths.items() if n > LIMIT} == {}


def test_the_count_sees_a_long_function(tmp_path):
    (tmp_path / "stores").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "stores" / "m.py").write_text(f"def long():\n{body}\n\n\ndef short():\n    pass\n")
    assert function_lengths(tmp_path, ("stores",)) == {"stores/m.py:1 long": LIMIT + 1, f"stores/m.py:{LIMIT + 4} short": 2}


if __name__ == "__main__":
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else LIMIT
    over = sorted(((n, k) for k, n in function_lengths().items() if n > limit), reverse=True)
    for n, k in over:
        print(f"{n:5d} {k}")
    print(f"{len(over)} functions over {limit} lines", file=sys.stderr)
