"""The import layers of the whole project, checked on the source (``make lint`` runs this).

Every import counts, imports inside functions included; ``if TYPE_CHECKING:`` blocks do not.
The rules:

* Packages: ``hvdrun -> launcher -> rendezvous`` and ``collectives -> rendezvous``; nothing
  imports back up (docs/architecture.md).
* No import cycle between modules, and no private name (``_x``) taken from another module.
* Inside ``launcher``, ``collectives`` and the PyTorch frontend ``collectives.torch``, each part
  imports only what the maps below allow (their package docstrings explain the maps); no
  frontend imports another.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hvdrun", "rendezvous", "launcher", "collectives")
GENERATED = ("_pb2.py", "_pb2_grpc.py")

#: package -> the project packages it may import
PACKAGE_RULES = {
    "hvdrun": {"launcher", "rendezvous"},
    "launcher": {"rendezvous"},
    "collectives": {"rendezvous"},
    "rendezvous": set(),
}

#: launcher: part -> what it may import from other parts (a part, or one module of a part)
LAUNCHER = {
    "errors": set(),
    "output": set(),
    "spec": {"errors"},
    "transport": {"spec", "errors"},
    "agent": {
        "transport.protocol",
        "transport.hostinfo",
        "transport.reachability",
        "spec.environment",
        "output",
    },
    "supervision": {"transport", "spec", "output", "errors"},
    "check_hosts": {"transport", "spec", "output", "errors"},
    "run": {"supervision", "spec", "output"},
}

#: collectives: parts from the bottom up; a part imports only parts of its own layer or below
#: (cycles within a layer are caught by the cycle check).
COLLECTIVES = [
    {"errors", "common", "adasum"},  # leaves: exceptions, ReduceOp/ProcessSet, Adasum's math
    {"engine"},  # the one engine: negotiation, fusion, execution, cache, autotune, timeline
    {"runtime"},  # joining the job: state, bootstrap, groups, other launchers
    {"ops"},  # the framework-neutral submission layer (argument checks, requests)
    {"process_sets"},  # registering process sets (a negotiated op)
    {"job", "objects"},  # the job API every frontend shares: init, join, barrier, objects
    {"elastic"},  # elastic states and run, shared by every frontend
    {"run_task"},  # python -m collectives.run_task: one rank of hvdrun.run(fn)
    FRONTENDS := {"torch", "tensorflow", "keras", "ray", "spark"},  # frontends, side by side
]

#: collectives.torch (the PyTorch frontend): its parts from the bottom up.
TORCH = [
    {"compression"},
    {"autograd"},
    {"mpi_ops", "functions"},  # Horovod's op API
    {"optim", "sync_batch_norm"},
    {"optimizer"},
    {"elastic", "info"},  # elastic training; python -m collectives.torch.info
]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith(GENERATED):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if MODULES[module].name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The project module that ``name`` (a module or a name in one) belongs to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, skipping the bodies of ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
            if name == "TYPE_CHECKING":
                for other in node.orelse:
                    yield other
                    yield from _nodes(other)
                continue
        yield node
        yield from _nodes(node)


def imports(module: str) -> list[tuple[str, str | None]]:
    """(imported project module, imported name or None) for every import of ``module``."""
    found: list[tuple[str, str | None]] = []
    for node in _nodes(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                owner = _owner(alias.name)
                if owner is not None:
                    found.append((owner, None))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None))
                elif (owner := _owner(base)) is not None:
                    found.append((owner, alias.name))
    return [(target, name) for target, name in found if target != module]


GRAPH = {module: {target for target, _ in imports(module)} for module in MODULES}


def test_packages_import_only_downward() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        package = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != package and other not in PACKAGE_RULES[package]:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_import_cycles() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert cycles == []


def test_no_private_names_across_modules() -> None:
    wrong = [
        f"{module} imports {name} from {target}"
        for module in MODULES
        for target, name in imports(module)
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert wrong == []


def _part(module: str, package: str) -> str | None:
    rest = module.removeprefix(package + ".")
    return rest.split(".")[0] if rest != module else None


def test_launcher_parts_import_only_what_the_map_allows() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        part = _part(module, "launcher")
        if part is None:
            continue
        assert part in LAUNCHER, f"{module}: a part missing from the map"
        for target in targets:
            other = target.removeprefix("launcher.")
            if target == other or other.split(".")[0] == part or other == "launcher":
                continue
            if not any(other == ok or other.startswith(ok + ".") for ok in LAUNCHER[part]):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def _layers_import_only_downward(package: str, layers: list[set[str]]) -> list[str]:
    layer_of = {part: level for level, parts in enumerate(layers) for part in parts}
    wrong = []
    for module, targets in GRAPH.items():
        part = _part(module, package)
        if part is None:
            continue
        assert part in layer_of, f"{module}: a part missing from the layers of {package}"
        for target in targets:
            other = _part(target, package)
            if other is not None and layer_of[other] > layer_of[part]:
                wrong.append(f"{module} ({part}) imports {target} ({other}, a higher layer)")
    return wrong


def test_collectives_layers_import_only_downward() -> None:
    # frontends -> ops -> runtime -> engine -> leaves (and rendezvous, see PACKAGE_RULES)
    assert _layers_import_only_downward("collectives", COLLECTIVES) == []


#: Frontends built on another, as in Horovod (horovod.keras on horovod.tensorflow): Keras on
#: its TensorFlow backend reaches the engine through the TensorFlow frontend.
BUILT_ON = {"keras": {"tensorflow"}}
#: The only places a frontend names one built on it: Horovod's own names for the same API.
ALIASES = {
    ("collectives.tensorflow.keras", "collectives.keras"),  # horovod.tensorflow.keras
    ("collectives.tensorflow.keras.callbacks", "collectives.keras.callbacks"),
    ("collectives.tensorflow.keras.elastic", "collectives.keras.elastic"),
    ("collectives.tensorflow.sync_batch_norm", "collectives.keras.sync_batch_norm"),
    # horovod.tensorflow.DistributedOptimizer takes Keras optimizers too
    ("collectives.tensorflow.optimizer", "collectives.keras.optimizer"),
    # horovod.tensorflow.SyncBatchNormalization is a Keras layer
    ("collectives.tensorflow", "collectives.keras.sync_batch_norm"),
}


def test_no_frontend_imports_another() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        part = _part(module, "collectives")
        if part not in FRONTENDS:
            continue
        for target in targets:
            other = _part(target, "collectives")
            if other not in FRONTENDS or other == part or other in BUILT_ON.get(part, ()):
                continue
            if (module, target) not in ALIASES:
                wrong.append(f"{module} ({part}) imports {target} (the {other} frontend)")
    assert wrong == []


def test_torch_frontend_layers_import_only_downward() -> None:
    assert _layers_import_only_downward("collectives.torch", TORCH) == []


def test_the_checks_see_lazy_imports() -> None:
    # runtime.registration imports the rendezvous client inside a function, on purpose.
    assert "rendezvous.client" in GRAPH["collectives.runtime.registration"]
