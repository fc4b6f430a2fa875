"""The project's import graph: no two modules import each other, and model code never sees the engine config.

Imports are read with ``ast`` from the source, so function-level imports and imports under
``if TYPE_CHECKING:`` count too: a cycle hidden in either still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "engine", "decoders")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its source (``from a import b`` counts ``a.b`` if a module)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in modules and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_graph_reader_sees_function_level_and_type_checking_imports(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from engine.config import EngineConfig\n"
        "def later():\n    from engine import runner\n    import engine.plan\n"
    )
    modules = {**project_modules(), "probe": source}
    assert imports_of("probe", source, modules) >= {"engine.config", "engine.runner", "engine.plan"}


def test_no_two_modules_import_each_other():
    graph = import_graph()
    assert len(graph) > 40  # the reader found the project
    mutual = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})
    assert mutual == []


def test_the_import_graph_has_no_cycle_at_all():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_model_code_never_imports_the_engine_config():
    graph = import_graph()
    offenders = sorted(name for name, targets in graph.items() if name.startswith("engine.models") and "engine.config" in targets)
    assert offenders == []


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_routes_only_declare_and_the_transports_sit_below_the_back_ends():
    """Routes are imported only by the app factories (and each other); the transports, which a single server and
    a front end share, import neither those back ends nor anything above them."""
    graph = import_graph()
    factories = {"app.main", "app.cluster.server"}
    route_importers = sorted(name for name, targets in graph.items()
                             if name not in factories and not _within(name, "app.routes")
                             and any(_within(target, "app.routes") for target in targets))
    assert route_importers == []
    above = ("app.routes", "app.deps", "app.main", "app.local_sessions", "app.cluster", "app.cli")
    upward = sorted((name, target) for name, targets in graph.items() if _within(name, "app.transport")
                    for target in targets if any(_within(target, package) for package in above))
    assert upward == []


def test_the_command_line_is_imported_by_nothing():
    """``app/cli.py`` parses flags and runs a command; what others share of a process (the uvicorn server, the log
    format) has its own module, so a Ray worker or a test of them never loads the command line."""
    graph = import_graph()
    assert sorted(name for name, targets in graph.items() if "app.cli" in targets) == []


def test_the_decoders_sit_below_the_engine():
    """The engine builds and runs the decoders; the decoders import nothing of the engine (what both need, CUDA
    graph capture, lives in ``decoders/graph_capture.py``)."""
    graph = import_graph()
    upward = sorted((name, target) for name, targets in graph.items() if _within(name, "decoders")
                    for target in targets if _within(target, "engine"))
    assert upward == []
