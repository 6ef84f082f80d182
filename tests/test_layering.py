"""The package's layers, read from the source (in-process, no torch needed).

The source is parsed once into a module graph, ``{module: [Edge(target, type_checking, local, line,
names)]}``; each rule is a function over such a graph that returns what breaks it, so every rule is run
twice: on the real tree, and on a small graph with one planted violation that it must report.

Layers, lowest first; each may import only its own and the lower ones it is listed with in MAY_IMPORT:
  vocabulary  api.py, wrap.py, weight_decay.py, interop.py
  planner/    the cost model (imports nothing else of flatshard, and no torch)
  runtime/    the engine: the step in runtime/, bytes between ranks in runtime/comm/ (which imports
              nothing of the engine above it), construction in runtime/build/ (imported only by the
              front ends and flatshard.testing)
  state/      in-memory state dicts      (neither state/ nor checkpoint/ reaches into the hooks)
  checkpoint/ files on disk
  testing.py  what flatshard's tests read of the engine
  front ends  fsdp.py, fsdp2/; ft.py beside them
  entry       cli.py, __main__.py, envreport.py, __init__.py
Every top-level module and package is declared in TOP_LEVEL; a new one fails until it is.
Also: no import cycle, even counting ``if TYPE_CHECKING:`` imports; no function-local import of the
package outside the lazy entry points; files stay under 500 lines (a signal; exceptions are declared);
the index of Notes in runtime/__init__.py lists every Note the code defines and cites.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Optional

SRC = Path(__file__).resolve().parents[1] / "src" / "flatshard"


class Edge(NamedTuple):
    """One import of a flatshard module by another."""

    target: str  # the flatshard module imported (a name taken from it resolves to the module)
    type_checking: bool = False  # under ``if TYPE_CHECKING:``: an annotation only, no import at run time
    local: bool = False  # inside a function
    line: int = 0
    names: tuple[str, ...] = ()  # what ``from target import ...`` takes; () when the whole module is imported


Graph = dict[str, list[Edge]]


# ---------------------------------------------------------------------------------------------------
# Reading the tree


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _import_statements(
    nodes: list[ast.AST], type_checking: bool = False, local: bool = False
) -> Iterator[tuple[ast.stmt, bool, bool]]:
    """(import statement, under ``if TYPE_CHECKING:``?, inside a function?) for every import in ``nodes``,
    in source order; expressions are not entered (no statement lives in one)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_checking, local
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_statements(node.body, True, local)
            yield from _import_statements(node.orelse, type_checking, local)
        else:
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            children = [c for c in ast.iter_child_nodes(node) if not isinstance(c, ast.expr)]
            yield from _import_statements(children, type_checking, inner)


def parse_imports(source: str, module: str, is_package: bool, known: set[str]) -> list[Edge]:
    """Every import of a flatshard module in ``source`` (the text of ``module``), resolved against the
    modules that exist (``known``): ``from flatshard.x import y`` is an edge to flatshard.x.y when that is
    a module, else to flatshard.x taking the name y."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node, type_checking, local in _import_statements(ast.parse(source).body):
        found: list[tuple[str, tuple[str, ...]]] = []
        if isinstance(node, ast.Import):
            found = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                child = f"{base}.{a.name}"
                found.append((child, ()) if child in known else (base, (a.name,)))
        for target, names in found:
            if target != "flatshard" and not target.startswith("flatshard."):
                continue
            while target not in known:  # flatshard.x.name -> flatshard.x
                target = target.rpartition(".")[0]
            out.append(Edge(target, type_checking, local, node.lineno, names))
    return out


GRAPH: Graph = {m: parse_imports(p.read_text(), m, p.name == "__init__.py", set(MODULES)) for m, p in MODULES.items()}


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(SRC.parent)}:{line}" if module in MODULES else f"{module}:{line}"


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# ---------------------------------------------------------------------------------------------------
# The layers

# Every top-level module and package of flatshard, and its layer ("" is flatshard/__init__.py).
TOP_LEVEL = {
    "api": "vocabulary",
    "wrap": "vocabulary",
    "weight_decay": "vocabulary",
    "interop": "vocabulary",  # PyTorch FSDP's enums and configs, recognised
    "planner": "planner",
    "runtime": "runtime",
    "state": "state",
    "checkpoint": "checkpoint",
    "testing": "testing",
    "fsdp": "front end",
    "fsdp2": "front end",
    "ft": "front end",  # replica groups on torchft, over a model a front end wrapped
    "cli": "entry",
    "__main__": "entry",
    "envreport": "entry",  # ``flatshard env``, beside cli.py
    "": "entry",
}

# what each layer may import (besides itself)
MAY_IMPORT = {
    "vocabulary": {"vocabulary"},
    "planner": set(),
    "runtime": {"vocabulary", "planner"},
    "state": {"vocabulary", "planner", "runtime"},
    "checkpoint": {"vocabulary", "planner", "runtime", "state", "entry"},  # entry: flatshard.__version__
    "testing": {"vocabulary", "runtime"},
    "front end": {"vocabulary", "planner", "runtime", "state", "checkpoint", "front end"},
    "entry": {"vocabulary", "planner", "runtime", "state", "checkpoint", "front end"},
}

ENGINE, COMM, BUILD = "flatshard.runtime", "flatshard.runtime.comm", "flatshard.runtime.build"
BUILD_USERS = ("flatshard.fsdp", "flatshard.fsdp2", "flatshard.testing")  # and build/ itself
# What state/ and checkpoint/ may take from the step's scheduling modules: the hooks nothing (the
# profiler label is runtime/instrument.py's, Phase runtime/consistency.py's), the schedule the run
# context a model view records into (the class, and run_context, which reads it off a unit).
STATE_MAY_TAKE = {"flatshard.runtime.hooks": set(), "flatshard.runtime.schedule": {"RunContext", "run_context"}}
ALLOWED_LOCAL = {"flatshard", "flatshard.cli"}  # may import the package inside functions (lazy entry points)


def layer(module: str) -> Optional[str]:
    """The layer of a flatshard module, or None when its top-level module is not declared in TOP_LEVEL."""
    return TOP_LEVEL.get(module.removeprefix("flatshard").lstrip(".").split(".")[0])


def undeclared(modules) -> list[str]:
    return [
        f"{m}: a top-level module nobody classified; declare its layer in TOP_LEVEL in tests/test_layering.py"
        for m in modules
        if layer(m) is None
    ]


def against_the_layers(graph: Graph) -> list[str]:
    wrong = []
    for m, edges in graph.items():
        mine = layer(m)
        for e in edges:
            theirs = layer(e.target)
            if theirs != mine and theirs not in MAY_IMPORT.get(mine, set()):
                wrong.append(f"{where(m, e.line)} ({mine}) imports {e.target} ({theirs})")
    return wrong


def engine_imports_above(graph: Graph) -> list[str]:
    above = ("front end", "state", "checkpoint", "entry", "testing")
    return [
        f"{where(m, e.line)} imports {e.target} ({layer(e.target)})"
        for m, edges in graph.items()
        if layer(m) == "runtime"
        for e in edges
        if layer(e.target) in above
    ]


def comm_imports_the_engine(graph: Graph) -> list[str]:
    """runtime/comm/ knows tensors and groups, never units: nothing of the engine outside comm/."""
    return [
        f"{where(m, e.line)} imports {e.target}: runtime/comm/ imports only comm/ and the vocabulary"
        for m, edges in graph.items()
        if inside(m, COMM)
        for e in edges
        if inside(e.target, ENGINE) and not inside(e.target, COMM)
    ]


def build_importers(graph: Graph) -> list[str]:
    """Construction runs once per wrap: only the front ends and flatshard.testing call it."""
    return [
        f"{where(m, e.line)} imports {e.target}: runtime/build/ is imported only by {', '.join(BUILD_USERS)}"
        for m, edges in graph.items()
        if not inside(m, BUILD) and not any(inside(m, user) for user in BUILD_USERS)
        for e in edges
        if inside(e.target, BUILD)
    ]


def state_reaches_into_the_step(graph: Graph) -> list[str]:
    wrong = []
    for m, edges in graph.items():
        if not (inside(m, "flatshard.state") or inside(m, "flatshard.checkpoint")):
            continue
        for e in edges:
            allowed = STATE_MAY_TAKE.get(e.target)
            if allowed is not None and (not e.names or not set(e.names) <= allowed):
                took = ", ".join(e.names) or "the whole module"
                may = ", ".join(sorted(allowed)) or "nothing"
                wrong.append(
                    f"{where(m, e.line)} takes {took} from {e.target} (state/ and checkpoint/ may take: {may})"
                )
    return wrong


def function_local_imports(graph: Graph) -> list[str]:
    return [
        f"{where(m, e.line)} imports {e.target}"
        for m, edges in graph.items()
        if m not in ALLOWED_LOCAL
        for e in edges
        if e.local
    ]


def import_cycles(graph: Graph, *, annotations: bool) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module), with
    ``if TYPE_CHECKING:`` imports counted as edges when ``annotations``."""
    edges = {
        m: sorted(
            {e.target for e in es if e.target != m and e.target in graph and (annotations or not e.type_checking)}
        )
        for m, es in graph.items()
    }
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

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(cycles)


def describe_cycle(graph: Graph, members: list[str]) -> str:
    inner = [
        f"  {where(m, e.line)} -> {e.target}{'  (TYPE_CHECKING)' if e.type_checking else ''}"
        for m in members
        for e in graph[m]
        if e.target in members and e.target != m
    ]
    return " <-> ".join(members) + "\n" + "\n".join(sorted(set(inner)))


# ---------------------------------------------------------------------------------------------------
# File size

MAX_LINES = 500
# {path under src/: (its own cap, why this file is one idea past MAX_LINES)}
LONGER_FILES: dict[str, tuple[int, str]] = {}


def oversized(sizes: dict[str, int], exceptions: dict[str, tuple[int, str]]) -> list[str]:
    out = []
    for name, n in sorted(sizes.items()):
        cap = exceptions.get(name, (MAX_LINES, ""))[0]
        if n > cap:
            out.append(f"{name}: {n} lines (cap {cap})")
    for name in sorted(exceptions):
        if sizes.get(name, 0) <= MAX_LINES:
            out.append(f"{name}: back under {MAX_LINES} lines (or gone); remove its entry from LONGER_FILES")
    return out


SIZE_ADVICE = (
    f"files over {MAX_LINES} lines: look for the second idea in each. Split where a component or a concept "
    "ends, never by moving a class's methods into free functions that take the instance; or, for one idea "
    "that is longer, add {path: (cap, reason)} to LONGER_FILES"
)


# ---------------------------------------------------------------------------------------------------
# The real tree


def test_every_top_level_module_has_a_layer():
    found = undeclared(MODULES)
    assert found == [], "\n".join(found)


def test_imports_point_downwards():
    wrong = against_the_layers(GRAPH)
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_engine_imports_no_front_end_state_or_checkpoint():
    assert len([m for m in MODULES if layer(m) == "runtime"]) >= 15
    wrong = engine_imports_above(GRAPH)
    assert wrong == [], "the engine imports above it:\n" + "\n".join(wrong)


def test_comm_imports_nothing_of_the_engine_above_it():
    assert len([m for m in MODULES if inside(m, COMM)]) >= 5
    wrong = comm_imports_the_engine(GRAPH)
    assert wrong == [], "\n".join(wrong)


def test_only_the_front_ends_and_testing_import_build():
    assert any(inside(e.target, BUILD) for user in BUILD_USERS for e in GRAPH[user])
    wrong = build_importers(GRAPH)
    assert wrong == [], "\n".join(wrong)


def test_state_and_checkpoint_do_not_reach_into_the_hooks():
    wrong = state_reaches_into_the_step(GRAPH)
    assert wrong == [], "\n".join(wrong)


def test_no_function_local_import_of_the_package():
    found = function_local_imports(GRAPH)
    assert found == [], (
        "function-local imports of flatshard (import at the top; a cycle means a layer is wrong):\n" + "\n".join(found)
    )


def test_no_import_cycle():
    cycles = import_cycles(GRAPH, annotations=False)
    assert cycles == [], "import cycles:\n" + "\n".join(describe_cycle(GRAPH, c) for c in cycles)


def test_no_import_cycle_counting_type_checking_imports():
    """An import under ``if TYPE_CHECKING:`` that closes a circle is still a circle: the modules cannot be
    read, or their annotations resolved (``typing.get_type_hints``), one without the others."""
    cycles = import_cycles(GRAPH, annotations=True)
    assert cycles == [], "import cycles, counting TYPE_CHECKING imports:\n" + "\n".join(
        describe_cycle(GRAPH, c) for c in cycles
    )


def test_the_planner_imports_no_torch():
    for m in (m for m in MODULES if layer(m) == "planner"):
        text = MODULES[m].read_text()
        assert not re.search(r"^\s*(import|from)\s+torch\b", text, re.M), m


def test_files_stay_small():
    sizes = {str(p.relative_to(SRC.parent)): len(p.read_text().splitlines()) for p in MODULES.values()}
    big = oversized(sizes, LONGER_FILES)
    assert big == [], SIZE_ADVICE + ":\n" + "\n".join(big)


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


# ---------------------------------------------------------------------------------------------------
# Each rule on a planted violation

CLEAN: Graph = {
    "flatshard.api": [],
    "flatshard.runtime.comm.collectives": [Edge("flatshard.api", line=3)],
    "flatshard.runtime.unit": [Edge("flatshard.runtime.comm.collectives", line=4)],
    "flatshard.runtime.hooks": [Edge("flatshard.runtime.unit", line=5)],
    "flatshard.runtime.schedule": [Edge("flatshard.runtime.unit", type_checking=True, line=6)],
    "flatshard.runtime.build.units": [Edge("flatshard.runtime.unit", line=7)],
    "flatshard.state.module": [Edge("flatshard.runtime.schedule", line=8, names=("RunContext",))],
    "flatshard.fsdp": [Edge("flatshard.runtime.build.units", line=9), Edge("flatshard.runtime.hooks", line=9)],
}


def planted(module: str, edge: Edge) -> Graph:
    graph = {m: list(es) for m, es in CLEAN.items()}
    graph.setdefault(module, []).append(edge)
    graph.setdefault(edge.target, [])
    return graph


def reported_at(problems: list[str]) -> list[str]:
    return [p.split(" ")[0] for p in problems]


def test_the_clean_graph_passes_every_rule():
    for check in (
        against_the_layers,
        engine_imports_above,
        comm_imports_the_engine,
        build_importers,
        state_reaches_into_the_step,
        function_local_imports,
    ):
        assert check(CLEAN) == [], check.__name__
    assert import_cycles(CLEAN, annotations=True) == []


def test_parse_imports_marks_type_checking_and_local_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from flatshard.runtime import gather\n"
        "from .schedule import RunContext, ScheduleConfig\n"
        "if TYPE_CHECKING:\n"
        "    from flatshard.runtime.unit import Unit\n"
        "def f():\n"
        "    import flatshard.runtime.hooks\n"
    )
    known = {"flatshard.runtime", "flatshard.runtime.gather", "flatshard.runtime.schedule"}
    known |= {"flatshard.runtime.unit", "flatshard.runtime.hooks"}
    assert parse_imports(source, "flatshard.runtime.exposure", False, known) == [
        Edge("flatshard.runtime.gather", False, False, 2, ()),
        Edge("flatshard.runtime.schedule", False, False, 3, ("RunContext",)),
        Edge("flatshard.runtime.schedule", False, False, 3, ("ScheduleConfig",)),
        Edge("flatshard.runtime.unit", True, False, 5, ("Unit",)),
        Edge("flatshard.runtime.hooks", False, True, 7, ()),
    ]


def test_an_undeclared_top_level_module_is_reported():
    found = undeclared(["flatshard.api", "flatshard.newthing", "flatshard.newpkg.sub"])
    assert [f.split(":")[0] for f in found] == ["flatshard.newthing", "flatshard.newpkg.sub"]
    assert "TOP_LEVEL in tests/test_layering.py" in found[0]


def test_an_upward_import_is_reported():
    graph = planted("flatshard.runtime.unit", Edge("flatshard.state.module", line=40))
    at = where("flatshard.runtime.unit", 40)
    assert against_the_layers(graph) == [f"{at} (runtime) imports flatshard.state.module (state)"]
    assert engine_imports_above(graph) == [f"{at} imports flatshard.state.module (state)"]


def test_comm_importing_the_engine_is_reported():
    graph = planted("flatshard.runtime.comm.collectives", Edge("flatshard.runtime.consistency", line=12))
    assert reported_at(comm_imports_the_engine(graph)) == [where("flatshard.runtime.comm.collectives", 12)]
    graph = planted("flatshard.runtime.comm.mesh", Edge("flatshard.runtime", line=2))  # the package itself
    assert reported_at(comm_imports_the_engine(graph)) == [where("flatshard.runtime.comm.mesh", 2)]


def test_the_step_importing_build_is_reported():
    for importer in ("flatshard.runtime.hooks", "flatshard.state.module", "flatshard.checkpoint.save", "flatshard.ft"):
        graph = planted(importer, Edge("flatshard.runtime.build.placement", line=21))
        assert reported_at(build_importers(graph)) == [where(importer, 21)], importer


def test_state_taking_hooks_or_more_of_the_schedule_is_reported():
    for edge in (
        Edge("flatshard.runtime.hooks", line=30, names=("label",)),
        Edge("flatshard.runtime.hooks", line=30),
        Edge("flatshard.runtime.schedule", line=30, names=("Phase",)),
        Edge("flatshard.runtime.schedule", line=30),  # from flatshard.runtime import schedule
    ):
        graph = planted("flatshard.checkpoint.load", edge)
        assert reported_at(state_reaches_into_the_step(graph)) == [where("flatshard.checkpoint.load", 30)], edge


def test_a_function_local_import_is_reported():
    graph = planted("flatshard.fsdp", Edge("flatshard.state.optim", local=True, line=99))
    assert function_local_imports(graph) == [f"{where('flatshard.fsdp', 99)} imports flatshard.state.optim"]


def test_a_cycle_closed_by_a_type_checking_import_is_reported():
    graph = planted("flatshard.runtime.unit", Edge("flatshard.runtime.schedule", line=50))
    assert import_cycles(graph, annotations=False) == []
    assert import_cycles(graph, annotations=True) == [["flatshard.runtime.schedule", "flatshard.runtime.unit"]]
    text = describe_cycle(graph, ["flatshard.runtime.schedule", "flatshard.runtime.unit"])
    assert f"{where('flatshard.runtime.schedule', 6)} -> flatshard.runtime.unit  (TYPE_CHECKING)" in text
    graph = planted("flatshard.runtime.comm.collectives", Edge("flatshard.runtime.hooks", line=1))
    assert import_cycles(graph, annotations=False) == [
        ["flatshard.runtime.comm.collectives", "flatshard.runtime.hooks", "flatshard.runtime.unit"]
    ]


def test_a_long_file_is_reported_unless_declared():
    sizes = {"flatshard/a.py": 120, "flatshard/b.py": 620}
    assert oversized(sizes, {}) == ["flatshard/b.py: 620 lines (cap 500)"]
    assert oversized(sizes, {"flatshard/b.py": (700, "one class, one idea")}) == []
    assert oversized(sizes, {"flatshard/b.py": (600, "one class, one idea")}) == ["flatshard/b.py: 620 lines (cap 600)"]
    assert oversized(sizes, {"flatshard/a.py": (700, "was long"), "flatshard/b.py": (700, "one idea")}) == [
        "flatshard/a.py: back under 500 lines (or gone); remove its entry from LONGER_FILES"
    ]
    assert "never by moving a class's methods into free functions that take the instance" in SIZE_ADVICE
