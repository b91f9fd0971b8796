"""Which part of ``launcher`` may import which (launcher/__init__.py's map), checked on the
source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import launcher

ROOT = Path(launcher.__file__).parent

#: part -> what it may import from other parts (a part, or one module of a part)
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "output": set(),
    "spec": {"errors"},
    "transport": {"spec", "errors"},
    "agent": {"transport.protocol", "transport.hostinfo", "spec.environment", "output"},
    "supervision": {"transport", "spec", "output", "errors"},
    "check_hosts": {"transport", "spec", "output", "errors"},
    "run": {"supervision", "spec", "output"},
}


def imported(path: Path) -> set[str]:
    """The ``launcher.*`` and ``collectives`` modules a file imports, without the prefix."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "launcher":
                names.update(alias.name for alias in node.names)
            else:
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {
        name.removeprefix("launcher.")
        for name in names
        if name.startswith(("launcher.", "collectives")) or name in ALLOWED
    }


def test_every_part_imports_only_what_the_map_allows() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        part = relative.parts[0]
        if part == "__init__":
            continue
        assert part in ALLOWED, f"{relative}: a part missing from the map"
        for target in imported(path):
            if target.split(".")[0] == part:
                continue
            if not any(target == ok or target.startswith(ok + ".") for ok in ALLOWED[part]):
                wrong.append(f"{relative} imports {target}")
    assert wrong == []
