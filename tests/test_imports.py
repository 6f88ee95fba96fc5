"""The import graph of ``workbench``: no cycle among module-level imports, and the torch-free
parts stay torch-free.

The graph is read from the source (``ast``), not by importing: an edge A → B for every
``import``/``from … import`` of a ``workbench`` module in A. *Top-level* imports run when A is
imported (module body, class bodies, ``try``/``if`` blocks; ``if TYPE_CHECKING:`` blocks are
skipped, they never run); *function-level* ones run when a function of A is called. Importing
``a.b.c`` also runs the ``__init__`` of the packages ``a.b`` and ``a`` first, so an edge to
``a.b.c`` from outside package ``a.b`` adds an edge to ``a.b`` too (that is how a package
``__init__`` that imports its submodules closes cycles).

Top-level cycles must not exist: whichever module of a cycle is imported first sees a
half-initialised partner. Function-level cycles (a module importing, inside a function, a module
that imports it at top level) would run, but they hide a layer that imports upwards; none exists
but the knob registry's one (:data:`REGISTRATION_EDGE`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "workbench"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES.get(mod, Path()).name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The workbench module ``name`` names, or its nearest existing parent; None if outside."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(mod: str) -> tuple[set[str], set[str]]:
    """(top-level, function-level) workbench modules that ``mod`` imports."""
    tree = ast.parse(MODULES[mod].read_text(encoding="utf-8"))
    top: set[str] = set()
    func: set[str] = set()
    here = mod if _is_package(mod) else mod.rpartition(".")[0]

    def targets(node: ast.AST) -> set[str]:
        out: set[str] = set()
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "workbench" or a.name.startswith("workbench."):
                    r = _resolve(a.name)
                    if r:
                        out.add(r)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if not (src == "workbench" or src.startswith("workbench.")):
                return out
            for a in node.names:
                sub = f"{src}.{a.name}"
                r = sub if sub in MODULES else _resolve(src)
                if r:
                    out.add(r)
        return out

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for c in child.orelse:  # the else branch runs
                    visit_stmt(c, in_function)
                continue
            visit_stmt(child, in_function)

    def visit_stmt(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            (func if in_function else top).update(targets(child))
        visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.Lambda)))

    visit(tree, False)
    return top, func


def _with_packages(importer: str, targets: set[str]) -> set[str]:
    """``targets`` plus the packages whose ``__init__`` importing them runs (those that do not
    already contain ``importer``)."""
    out = set(targets)
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if not (importer == pkg or importer.startswith(pkg + ".")):
                out.add(pkg)
    out.discard(importer)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(top-level edges, function-level edges) of every workbench module."""
    top, func = {}, {}
    for mod in MODULES:
        t, f = _imports(mod)
        top[mod] = _with_packages(mod, t)
        func[mod] = _with_packages(mod, f) - top[mod]
    return top, func


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def test_graph_reader_sees_imports():
    top, func = import_graph()
    assert "workbench.knobs" in top["workbench.features"]
    assert "workbench.errors" in top["workbench.knobs"]
    assert "workbench.features" in func["workbench.knobs"]  # loaded lazily, in a function
    assert "workbench.features" not in top["workbench.knobs"]


def test_knobs_is_a_leaf():
    """workbench.knobs imports no feature package (policies, compression, predictor, runtime,
    sim, replay…); in a function it imports workbench.features, the one module that does."""
    top, func = import_graph()
    assert top["workbench.knobs"] <= {"workbench", "workbench.errors"}
    assert func["workbench.knobs"] <= {"workbench.features", "workbench.jsonio"}


def test_no_top_level_import_cycle():
    top, _ = import_graph()
    found = cycles(top)
    assert not found, "module-level import cycles: " + "; ".join(" ↔ ".join(c) for c in found)


#: The one function-level cycle allowed: ``workbench.knobs`` (a leaf) imports
#: ``workbench.features`` the first time the groups are needed, and features imports the knob
#: groups it registers (the registration rule of :mod:`workbench.knobs`; held by
#: :func:`test_knobs_is_a_leaf`).
REGISTRATION_EDGE = ("workbench.knobs", "workbench.features")


def test_no_function_level_import_cycle():
    """No import inside a function closes a cycle (a lower layer reaching up, e.g. telemetry →
    analysis), but the knob registry's :data:`REGISTRATION_EDGE`."""
    found = [c for c in function_level_cycles() if tuple(c[:2]) != REGISTRATION_EDGE]
    assert not found, ("function-level import cycles (importer → imported in a function, then "
                       "the way back): " + "; ".join(" → ".join(c) for c in found))


def test_telemetry_imports_no_analysis():
    """The store is written and read without the metrics: ``ds.moe`` registers from
    ``workbench.analysis`` (``workbench.open_run`` is served from there), and no telemetry
    module imports analysis, at top level or in a function."""
    top, func = import_graph()
    for mod in MODULES:
        if mod == "workbench.telemetry" or mod.startswith("workbench.telemetry."):
            up = {m for m in top[mod] | func[mod]
                  if m == "workbench.analysis" or m.startswith("workbench.analysis.")}
            assert not up, f"{mod} imports {sorted(up)}"


def test_open_run_registers_the_accessor():
    """``import workbench; workbench.open_run(p).moe`` works: the lazy attribute is served from
    workbench.analysis, which registers ``ds.moe``; telemetry's reader alone does not."""
    code = ("import sys, workbench, xarray as xr\n"
            "import workbench.telemetry.store\n"
            "assert 'workbench.analysis' not in sys.modules\n"
            "assert not hasattr(xr.Dataset(), 'moe')\n"
            "f = workbench.open_run\n"
            "assert f is workbench.telemetry.store.open_run\n"
            "assert hasattr(xr.Dataset(), 'moe')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def function_level_cycles() -> list[list[str]]:
    """For every function-level edge A → B that closes a cycle: [A, B, …, A], the shortest way
    back from B to A over every edge."""
    top, func = import_graph()
    both = {m: top[m] | func[m] for m in top}
    out = []
    for a in sorted(func):
        for b in sorted(func[a]):
            path = _shortest_path(both, b, a)
            if path:
                out.append([a, *path])
    return out


def _shortest_path(graph: dict[str, set[str]], src: str, dst: str) -> list[str] | None:
    prev: dict[str, str | None] = {src: None}
    queue = [src]
    for v in queue:
        if v == dst:
            path = [v]
            while prev[path[-1]] is not None:
                path.append(prev[path[-1]])
            return path[::-1]
        for w in sorted(graph.get(v, ())):
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return None


def private_imports() -> list[str]:
    """Every ``from workbench… import _name`` (a private name taken from another module)."""
    out = []
    for mod, path in MODULES.items():
        here = mod if _is_package(mod) else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = node.module or ""
            if node.level:
                base = here.split(".")
                src = ".".join(base[:len(base) - (node.level - 1)] + ([src] if src else []))
            if src == "workbench" or src.startswith("workbench."):
                out += [f"{mod}:{node.lineno} from {src} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_is_imported_across_modules():
    """A name another module needs is public (and documented as such); a private one stays in
    its module."""
    found = private_imports()
    assert not found, "private names imported: " + "; ".join(found)


HOOK_CALLS = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook"}


def test_only_the_hooks_module_puts_hooks_on_a_model():
    """``workbench.models.hooks`` is the one place a hook goes on a model (its docstring lists
    the features that use it); the embedded model's own trainer and evaluator
    (``models/embedded/v2``) keep theirs."""
    found = []
    for mod, path in MODULES.items():
        if mod == "workbench.models.hooks" or mod.startswith("workbench.models.embedded.v2"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in HOOK_CALLS:
                found.append(f"{mod}:{node.lineno} {node.attr}")
    assert not found, "hooks registered outside workbench.models.hooks: " + "; ".join(found)


def _imports_torch(code: str) -> bool:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\n"
                          "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1] == "TORCH"


def test_knobs_import_no_torch():
    assert not _imports_torch("import workbench.knobs")
    # every group (the feature modules workbench.features imports) is torch-free too
    assert not _imports_torch("from workbench.knobs import Knobs\nk = Knobs()\n"
                              "assert 'compression' in k.groups and 'predictor' in k.groups\n"
                              "k.check_against(num_layers=8, top_k=4, expert_bytes=100)")


def test_sim_imports_no_torch():
    sim = [m for m in MODULES if m == "workbench.sim" or m.startswith("workbench.sim.")]
    assert sim
    assert not _imports_torch("\n".join(f"import {m}" for m in sim))


def test_replay_imports_no_torch():
    """Replay runs the simulation core over traces: no model, so no torch (the dashboard's
    replay card and the CLI's ``workbench replay`` start without it)."""
    assert not _imports_torch("import workbench.replay, workbench.replay.engine, "
                              "workbench.replay.flat, workbench.telemetry.metadata")
