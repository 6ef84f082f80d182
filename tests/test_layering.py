"""The package's layers, read from the source (in-process, no torch needed): imports point only downwards,
there is no import cycle, no function-local import of the package outside the CLI and ``__init__``, no file
over 500 lines, and the index of Notes in runtime/__init__.py lists every Note the code defines and cites.

Layers, lowest first; each may import only its own and lower ones:
  vocabulary  api.py, wrap.py, weight_decay.py   (and planner/, which imports nothing else of flatshard)
  runtime/    the engine
  state/      in-memory state dicts
  checkpoint/ files on disk
  front ends  fsdp.py (and later fully_shard.py); testing.py sits beside them, on the engine only
  cli.py, __init__.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flatshard"
ALLOWED_LOCAL = {"flatshard", "flatshard.cli"}  # may import the package inside functions (lazy entry points)
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def layer(module: str) -> str:
    tail = module.removeprefix("flatshard").lstrip(".")
    top = tail.split(".")[0]
    if top in ("api", "wrap", "weight_decay", "interop"):
        return "vocabulary"
    if top in ("planner", "runtime", "state", "checkpoint"):
        return top
    if top in ("cli", "__main__", ""):
        return "entry"
    if top == "testing":
        return "testing"
    return "front end"


# what each layer may import (besides itself)
MAY_IMPORT = {
    "vocabulary": {"vocabulary"},
    "planner": set(),
    "runtime": {"vocabulary", "planner"},
    "state": {"vocabulary", "planner", "runtime"},
    "checkpoint": {"vocabulary", "planner", "runtime", "state", "entry"},
    "testing": {"vocabulary", "runtime"},
    "front end": {"vocabulary", "planner", "runtime", "state", "checkpoint", "front end"},
    "entry": {"vocabulary", "planner", "runtime", "state", "checkpoint", "front end"},
}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for n in ast.walk(node))
    return out


def imports(module: str) -> list[tuple[str, bool, int]]:
    """(imported flatshard module, inside a function?, line) for every import of the package."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    local = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            if t == "flatshard" or t.startswith("flatshard."):
                while t not in MODULES:  # flatshard.x.name -> flatshard.x
                    t = t.rpartition(".")[0]
                out.append((t, id(node) in local, node.lineno))
    return out


GRAPH = {m: imports(m) for m in MODULES}


def test_no_import_cycle():
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t != m}) for m in MODULES}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                cycles.append(sorted(component))

    for m in MODULES:
        if m not in index:
            visit(m)
    assert cycles == [], f"import cycles: {cycles}"


def test_no_function_local_import_of_the_package():
    found = [
        f"{MODULES[m].relative_to(SRC.parent)}:{line} imports {t}"
        for m, edges in GRAPH.items()
        if m not in ALLOWED_LOCAL
        for t, local, line in edges
        if local
    ]
    assert found == [], (
        "function-local imports of flatshard (import at the top; a cycle means a layer is wrong):\n" + "\n".join(found)
    )


def test_imports_point_downwards():
    wrong = []
    for m, edges in GRAPH.items():
        mine = layer(m)
        for t, _, line in edges:
            theirs = layer(t)
            if theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{MODULES[m].relative_to(SRC.parent)}:{line} ({mine}) imports {t} ({theirs})")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_engine_imports_no_front_end_state_or_checkpoint():
    engine = [m for m in MODULES if layer(m) == "runtime"]
    assert len(engine) >= 15, engine
    for m in engine:
        for t, _, line in GRAPH[m]:
            assert layer(t) not in ("front end", "state", "checkpoint", "entry", "testing"), (m, t, line)


def test_the_planner_imports_no_torch():
    for m in (m for m in MODULES if layer(m) == "planner"):
        text = MODULES[m].read_text()
        assert not re.search(r"^\s*(import|from)\s+torch\b", text, re.M), m


def test_files_stay_small():
    sizes = {str(p.relative_to(SRC.parent)): len(p.read_text().splitlines()) for p in MODULES.values()}
    big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert big == {}, f"files over {MAX_LINES} lines (two ideas in one file?): {big}"


def test_the_note_index_is_complete():
    defined, cited = {}, set()
    for path in MODULES.values():
        for line in path.read_text().splitlines():
            for name in re.findall(r"\[Note: ([^\]]+)\]", line):
                cited.add(name)
                if re.match(r"^\s*(# )?\[Note: [^\]]+\]\s*$", line):  # a Note's own line: where it is written
                    defined.setdefault(name, str(path.relative_to(SRC)))
    index = MODULES["flatshard.runtime"].read_text()
    listed = dict(re.findall(r"^  (\S[^.\n]*?) \.+ (\S+)$", index, re.M))
    assert listed == defined, (
        f"the Note index in runtime/__init__.py differs from the code:\nlisted {listed}\ndefined {defined}"
    )
    undefined = sorted(cited - set(defined) - {"..."})
    assert undefined == [], f"Notes cited but never defined: {undefined}"
