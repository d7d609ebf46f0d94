"""The package's folders are its layers: what each may import, which never import torch, and no
import circle anywhere, lazy imports (inside functions) included.

The rules are the ones each folder's ``__init__.py`` docstring states.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "bicodec_shm"

# Layer -> the layers it may import. Top-level modules ``errors`` and ``_version`` are open to
# every layer; the package's ``__init__`` (the public surface) and ``__main__`` sit above all.
ALLOWED = {
    "codecs": set(),
    "protocol": {"codecs"},
    "client": {"codecs", "protocol"},
    "model": {"codecs", "protocol"},
    "server": {"codecs", "protocol", "model"},
    "integrations": {"codecs", "protocol", "client", "model", "server"},
    "deploy": {"codecs", "protocol", "client", "server"},
    "tools": {"codecs", "protocol", "client", "model", "server", "integrations", "deploy"},
}
OPEN_TO_ALL = {"errors", "_version"}
TORCH_FREE = ("codecs", "protocol", "client", "integrations")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of the package (or top-level name outside it) that ``path`` imports,
    wherever the import statement is: module level, functions, ``TYPE_CHECKING`` blocks."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from pkg import sub` names a module when pkg.sub is one.
            subs = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            found.update(subs or {target})
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "bicodec_shm":
        return None
    if len(parts) == 1:
        return "surface"
    if parts[1] in ALLOWED or parts[1] in OPEN_TO_ALL:
        return parts[1]
    return "surface" if parts[1] == "__main__" else parts[1]


def test_every_folder_is_a_known_layer_with_a_docstring_saying_what_it_owns():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(ALLOWED)
    for folder in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and "may import" in doc.lower(), f"{folder}/__init__.py says nothing of its imports"
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == {"__init__", "__main__", "errors", "_version"}, "modules on the top floor"


def test_lower_layers_never_import_higher_ones():
    known = modules()
    wrong = []
    for name, path in known.items():
        here = layer_of(name)
        if here in ("surface", *OPEN_TO_ALL):
            continue
        for target in imports_of(path, known):
            there = layer_of(target)
            if there is None or there == here or there in OPEN_TO_ALL:
                continue
            if there not in ALLOWED[here]:
                wrong.append(f"{name} imports {target} ({here} -> {there})")
    assert wrong == []


def test_the_torch_free_layers_never_import_torch_not_even_lazily():
    known = modules()
    wrong = [f"{name} imports {target}" for name, path in known.items() if layer_of(name) in TORCH_FREE
             for target in imports_of(path, known) if target.split(".")[0] == "torch"]  # fmt: skip
    assert wrong == []


def test_importing_the_client_side_and_the_supervisor_loads_no_torch():
    names = [n for n in modules() if layer_of(n) in TORCH_FREE and not n.endswith("__main__")]
    names += ["bicodec_shm", "bicodec_shm.deploy.supervisor", "bicodec_shm.deploy.processes",
              "bicodec_shm.model.registry", "bicodec_shm.tools.stats_cmd", "bicodec_shm.tools.decode_cmd"]
    code = (f"import importlib, sys\nfor n in {names!r}: importlib.import_module(n)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_lazy_imports_included():
    known = modules()
    graph = {name: {t for t in imports_of(path, known) if t in known and t != name}
             for name, path in known.items()}  # fmt: skip
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_much_past_700_lines():
    long = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 720}  # fmt: skip
    assert long == {}
