"""The library's module structure: no import cycles, and the front ends (the trainer, the
kvstore, the torch.distributed backend) use only the collectives' public API and their
engine (``ringtrain.collectives.engine``).

Imports are read from the source (every import statement, also those inside functions),
so a cycle hidden behind an import placed in a function is found too.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {
    "ringtrain": ROOT / "ringtrain",
    "ringtrain.collectives": ROOT / "collectives",
    "ringtrain.kernels": ROOT / "kernels",
    "ringtrain.trainer": ROOT / "trainer",
    "ringtrain.launcher": ROOT / "launcher",
    "ringtrain.kvstore": ROOT / "kvstore",
    "ringtrain.torch": ROOT / "torch_backend",
    "ringtrain.common": ROOT / "common",
}


def _modules() -> dict[str, Path]:
    """Every module of the library by dotted name (packages by their ``__init__``)."""
    modules: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str) -> set[str]:
    """The library modules that ``module`` imports (resolving ``from . import x`` to the
    submodule ``x`` where there is one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = _package_of(module).split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_module_list_is_complete() -> None:
    assert "ringtrain.collectives.engine" in MODULES
    assert "ringtrain.trainer.gradient_reducer" in MODULES
    assert len(MODULES) > 90


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "modules that import each other (directly or through others): " + \
        "; ".join(" <-> ".join(cycle) for cycle in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if m.startswith(("ringtrain.trainer",
                                                           "ringtrain.kvstore",
                                                           "ringtrain.torch"))))
def test_front_ends_use_no_private_collectives_module(module: str) -> None:
    private = sorted(target for target in GRAPH[module]
                     if target.startswith("ringtrain.collectives.")
                     and any(part.startswith("_") for part in target.split(".")[2:]))
    assert not private, f"{module} imports {private}; use ringtrain.collectives.engine"


def test_collectives_and_kernels_do_not_import_upwards() -> None:
    upward = {m: sorted(t for t in GRAPH[m] if t.startswith(("ringtrain.trainer",
                                                             "ringtrain.launcher",
                                                             "ringtrain.kvstore",
                                                             "ringtrain.torch")))
              for m in MODULES if m.startswith(("ringtrain.collectives", "ringtrain.kernels"))}
    assert not {m: t for m, t in upward.items() if t}
    kernels_up = {m: sorted(t for t in GRAPH[m] if t.startswith("ringtrain.collectives"))
                  for m in MODULES if m.startswith("ringtrain.kernels")}
    assert not {m: t for m, t in kernels_up.items() if t}


def test_the_kvstore_is_a_front_end_of_its_own() -> None:
    """kvstore -> collectives -> kernels: it imports neither the trainer nor the launcher,
    and only ringtrain's public aliases import it."""
    kvstore = [m for m in MODULES if m.startswith("ringtrain.kvstore")]
    sideways = {m: sorted(t for t in GRAPH[m]
                          if t.startswith(("ringtrain.trainer", "ringtrain.launcher")))
                for m in kvstore}
    assert not {m: t for m, t in sideways.items() if t}
    importers = sorted(m for m in MODULES if not m.startswith("ringtrain.kvstore")
                       and any(t.startswith("ringtrain.kvstore") for t in GRAPH[m])
                       and m.count(".") > 1)
    assert not importers, f"modules importing ringtrain.kvstore: {importers}"


COLLECTIVES_LAYERS = ("base", "transport", "world", "algorithms", "agreement", "memory",
                      "calls", "p2p")
"""The collectives' layers, bottom up: each imports only those below it (and itself)."""
PUBLIC_LEAVES = ("errors", "config", "logs", "timeline", "tuning", "cuda_aware", "gpu_choice")
"""Modules at the top of the collectives' folder (public import paths) that belong to
the base layer."""


def collectives_layer(module: str) -> int | None:
    """The layer of a module of the collectives (its index in ``COLLECTIVES_LAYERS``; the
    public collective modules, the engine and the benchmarks above them all), or None
    for a module outside the collectives."""
    if not module.startswith("ringtrain.collectives"):
        return None
    parts = module.split(".")[2:]
    if parts and parts[0] in COLLECTIVES_LAYERS:
        return COLLECTIVES_LAYERS.index(parts[0])
    if parts and parts[0] in PUBLIC_LEAVES:
        return 0
    return len(COLLECTIVES_LAYERS)


@pytest.mark.parametrize("module", sorted(m for m in MODULES
                                          if m.startswith("ringtrain.collectives")))
def test_the_collectives_layers_import_only_downwards(module: str) -> None:
    own = collectives_layer(module)
    upward = sorted(target for target in GRAPH[module]
                    if (collectives_layer(target) or 0) > own)
    assert not upward, (f"{module} (layer {own}) imports from layers above it: {upward}; "
                        f"the order is {' -> '.join(COLLECTIVES_LAYERS)} -> public calls")


def test_every_collectives_module_sits_in_a_layer() -> None:
    """The folder holds the layers' packages, the public leaves, the public collective
    modules (one per collective or family) and the engine: no other module at its top."""
    top = sorted(m.rpartition(".")[2] for m in MODULES
                 if m.count(".") == 2 and m.startswith("ringtrain.collectives."))
    public_calls = {"_allgather", "_allreduce", "_alltoall", "_broadcast", "_join", "_objects",
                    "_point_to_point", "_reducescatter", "engine", "bench", "warm_up"}
    assert set(top) <= set(COLLECTIVES_LAYERS) | set(PUBLIC_LEAVES) | public_calls, top


def test_the_torch_backend_is_a_front_end_of_its_own() -> None:
    """torch backend -> collectives -> kernels: it imports neither the trainer, the
    kvstore nor the launcher, and nothing in the library imports it."""
    backend = [m for m in MODULES if m.startswith("ringtrain.torch")]
    sideways = {m: sorted(t for t in GRAPH[m] if t.startswith(
                    ("ringtrain.trainer", "ringtrain.launcher", "ringtrain.kvstore")))
                for m in backend}
    assert not {m: t for m, t in sideways.items() if t}
    importers = sorted(m for m in MODULES if not m.startswith("ringtrain.torch")
                       and any(t.startswith("ringtrain.torch") for t in GRAPH[m]))
    assert not importers, f"modules importing ringtrain.torch: {importers}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(module: str) -> None:
    """Catches a name imported from a module that no longer defines it, which the
    import graph above cannot see."""
    importlib.import_module(module)


def test_the_shared_leaves_import_nothing_of_ringtrain_but_each_other() -> None:
    """common/ is the bottom of every layer: the launcher and the collectives read it, it
    reads neither."""
    leaves = [m for m in MODULES if m.startswith("ringtrain.common")]
    upward = {m: sorted(t for t in GRAPH[m] if not t.startswith("ringtrain.common"))
              for m in leaves}
    assert leaves and not {m: t for m, t in upward.items() if t}


def test_the_ringtrain_folder_is_only_the_facade() -> None:
    """Each module of ringtrain/ only gathers public names of the layers: it defines no
    function or class of its own (``__getattr__`` and ``__dir__`` of the package aside)."""
    facade = [m for m, path in MODULES.items() if path.parent == PACKAGE_DIRS["ringtrain"]]
    defined = {m: [node.name for node in ast.parse(MODULES[m].read_text()).body
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                   and node.name not in ("__getattr__", "__dir__")]
               for m in facade}
    assert len(facade) > 5 and not {m: names for m, names in defined.items() if names}


COLLECTIVES_OF_ONE_SHAPE = ("allreduce", "broadcast", "allgather", "alltoall", "reducescatter")
"""The collectives planned and run on the same layers (``calls/``), each in two modules."""


@pytest.mark.parametrize("collective", COLLECTIVES_OF_ONE_SHAPE)
def test_every_collective_has_one_shape(collective: str) -> None:
    """A plan module (the plan class, the function that makes or finds a plan, and the
    lookup of the fast path) and a run module declaring the collective's call forms."""
    plan = importlib.import_module(f"ringtrain.collectives.calls._{collective}_plan")
    run = importlib.import_module(f"ringtrain.collectives.calls._{collective}_run")
    forms = importlib.import_module("ringtrain.collectives.calls._forms")
    assert isinstance(getattr(plan, f"{collective.capitalize()}Plan"), type)
    assert callable(getattr(plan, f"{collective}_plan"))
    kept = getattr(plan, f"kept_{collective}_plan")
    assert isinstance(run.FORMS, forms.CallForms) and run.FORMS.collective == collective
    assert run.FORMS._kept is kept


@pytest.mark.parametrize("collective", COLLECTIVES_OF_ONE_SHAPE)
def test_a_public_collective_module_holds_its_signatures_only(collective: str) -> None:
    """Its functions each hand their arguments to the call forms in one statement, and it
    imports its run module and the types of its signature: a handful of private modules
    in few layers."""
    module = f"ringtrain.collectives._{collective}"
    tree = ast.parse(MODULES[module].read_text())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions and not [node for node in tree.body if isinstance(node, ast.ClassDef)]
    for function in functions:
        body = [node for node in function.body
                if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]
        assert not function.name.startswith("_"), function.name
        assert len(body) == 1 and isinstance(body[0], ast.Return), function.name
    private = sorted(target for target in GRAPH[module]
                     if target.startswith("ringtrain.collectives.")
                     and any(part.startswith("_") for part in target.split(".")[2:]))
    assert f"ringtrain.collectives.calls._{collective}_run" in private
    assert len(private) <= 4, private
    assert len({collectives_layer(target) for target in private}) <= 3, private
