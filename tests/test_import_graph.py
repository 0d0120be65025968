"""The import graph of the library (docs/design.md §2): one-way imports, enforced.

Over every module of ``cli``, ``peagle_data``, ``peagle_train``, ``runtime`` and ``stores`` (read as source, nothing
is imported):
- no import cycle between modules, counting every import of our modules (module top, inside a
  function, under ``TYPE_CHECKING``);
- no private name (``_name``) imported from another module;
- our own modules are imported at module top, never inside a function (only heavy optional
  third-party dependencies, such as vLLM or matplotlib, are imported lazily);
- the package arrows: ``cli -> {peagle_data, peagle_train} -> runtime -> stores``; ``peagle_train`` never imports
  ``peagle_data``; nothing imports ``cli``;
- a package's ``__init__.py`` re-exports nothing.

``python tests/test_import_graph.py`` prints the figures (cycles, private imports, imports inside
functions, modules per folder).
"""

from __future__ import annotations

import ast
import collections
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("cli", "peagle_data", "peagle_train", "runtime", "stores")
ALLOWED_ARROWS = {
    "cli": {"cli", "peagle_data", "peagle_train", "runtime", "stores"},
    "peagle_data": {"peagle_data", "runtime", "stores"},
    "peagle_train": {"peagle_train", "runtime", "stores"},
    "runtime": {"runtime", "stores"},
    "stores": {"stores"},
}
FORBIDDEN_FOLDER_ARROWS = {"peagle_train.generate": ("peagle_train.evaluate",)}
"""Inside a package, folders that must not import another: decoding and the Python API never import evaluation
(evaluation imports decoding)."""


@dataclass(frozen=True)
class Import:
    """One import of our code: ``source`` imports ``target`` (a module) at ``line``."""

    source: str
    target: str
    names: tuple[str, ...]
    line: int
    in_function: bool
    type_checking: bool


@dataclass
class Graph:
    """The modules of a tree (dotted name -> path) and every import of ours between them."""

    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)

    def edges(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = collections.defaultdict(set)
        for imp in self.imports:
            if imp.target != imp.source:
                out[imp.source].add(imp.target)
        return out


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports_of(node: ast.AST):
    """Yield ``(import node, inside a function, under TYPE_CHECKING)`` for every import below ``node``."""
    def visit(parent, in_function, type_checking):
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function, type_checking
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            is_tc = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            yield from visit(child, in_function or is_function, type_checking or is_tc)
    yield from visit(node, False, False)


def read_graph(root: Path, packages=PACKAGES) -> Graph:
    """The import graph of ``packages`` under ``root``; relative imports are resolved."""
    modules = {_module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    is_package = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph = Graph(modules)
    for name, path in modules.items():
        for node, in_function, type_checking in _imports_of(ast.parse(path.read_text(), str(path))):
            pairs = []
            if isinstance(node, ast.Import):
                pairs = [(a.name, ()) for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    here = name.split(".") if name in is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([base] if base else []))
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    pairs.append((sub, ()) if sub in modules else (base, (alias.name,)))
            for target, names in pairs:
                if target.split(".")[0] not in packages:
                    continue
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                graph.imports.append(Import(name, target, names, node.lineno, in_function, type_checking))
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), sorted."""
    edges, index, low, stack, on_stack, found = graph.edges(), {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph.modules) + 100))
    try:
        for v in sorted(graph.modules):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def private_imports(graph: Graph) -> list[str]:
    return [f"{i.source}:{i.line} imports {n} from {i.target}"
            for i in graph.imports if i.target != i.source for n in i.names if n.startswith("_")]


def imports_in_functions(graph: Graph) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target} inside a function" for i in graph.imports if i.in_function]


def wrong_arrows(graph: Graph) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target}" for i in graph.imports
            if i.target.split(".")[0] not in ALLOWED_ARROWS[i.source.split(".")[0]]]


def wrong_folder_arrows(graph: Graph) -> list[str]:
    return [f"{i.source}:{i.line} imports {i.target}" for i in graph.imports
            for folder, banned in FORBIDDEN_FOLDER_ARROWS.items()
            if i.source.startswith(folder + ".") and i.target.startswith(tuple(b + "." for b in banned))]


def reexports(graph: Graph) -> list[str]:
    """``__init__.py`` files that import our modules without defining anything themselves."""
    out = []
    for name, path in graph.modules.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defines = any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body)
        ours = [i for i in graph.imports if i.source == name]
        if ours and not defines:
            out.append(f"{path}: re-exports {sorted({i.target for i in ours})}")
    return out


def modules_per_folder(root: Path, graph: Graph) -> dict[str, int]:
    return dict(sorted(collections.Counter(
        str(p.parent.relative_to(root)) for p in graph.modules.values() if p.name != "__init__.py").items()))


REPO = Path(__file__).resolve().parents[1]


def test_no_import_cycle():
    assert cycles(read_graph(REPO)) == []


def test_no_private_name_imported_across_modules():
    assert private_imports(read_graph(REPO)) == []


def test_our_modules_are_imported_at_module_top():
    assert imports_in_functions(read_graph(REPO)) == []


def test_package_arrows_point_down():
    assert wrong_arrows(read_graph(REPO)) == []


def test_decoding_never_imports_evaluation():
    assert wrong_folder_arrows(read_graph(REPO)) == []


def test_no_reexport_facades():
    assert reexports(read_graph(REPO)) == []


def test_the_checks_find_what_they_forbid(tmp_path):
    """The checker on a small tree with one of each fault: it reports exactly those."""
    files = {
        "stores/__init__.py": "from stores.a import thing\n",
        "stores/a.py": "from stores.b import helper\nthing = 1\n",
        "stores/b.py": "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                       "if TYPE_CHECKING:\n    from stores.a import thing\n"
                       "def helper():\n    from .c import _hidden\n    return _hidden\n",
        "stores/c.py": "_hidden = 2\n",
        "stores/d.py": "import peagle_data\n",
        "peagle_data/__init__.py": '"""docstring only"""\n',
        "peagle_data/x.py": "from stores.c import _hidden as h\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = read_graph(tmp_path, packages=("peagle_data", "stores"))
    assert cycles(graph) == [["stores.a", "stores.b"]]
    assert sorted(private_imports(graph)) == ["peagle_data.x:1 imports _hidden from stores.c",
                                              "stores.b:6 imports _hidden from stores.c"]
    assert imports_in_functions(graph) == ["stores.b:6 imports stores.c inside a function"]
    assert wrong_arrows(graph) == ["stores.d:1 imports peagle_data"]
    assert reexports(graph) == [f"{tmp_path / 'stores/__init__.py'}: re-exports ['stores.a']"]


if __name__ == "__main__":
    g = read_graph(REPO)
    print(f"modules: {len(g.modules)}")
    for title, items in (("import cycles", cycles(g)), ("private cross-module imports", private_imports(g)),
                         ("imports of our modules inside functions", imports_in_functions(g)),
                         ("arrows against the package order", wrong_arrows(g)),
                         ("arrows against the folder order", wrong_folder_arrows(g)), ("re-export facades", reexports(g))):
        print(f"{title}: {len(items)}")
        for item in items:
            print(f"  {item}")
    print("modules per folder:")
    for folder, n in modules_per_folder(REPO, g).items():
        print(f"  {folder}: {n}")
