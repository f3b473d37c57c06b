"""The package's layers hold: import-linter's contracts (pyproject.toml), private modules used
only inside their own package, no import loops, and rooms of a readable size."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "batchfit"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # every import counts, those inside functions too: a lazy import is still a dependency
    return grimp.build_graph("batchfit", cache_dir=None)


def test_import_linter_contracts_hold(capsys: pytest.CaptureFixture[str]) -> None:
    from importlinter import configuration
    from importlinter.application.use_cases import lint_imports

    configuration.configure()
    passed = lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None)
    assert passed, capsys.readouterr().out


def _is_private(module: str) -> bool:
    name = module.rsplit(".", 1)[-1]
    return name.startswith("_") and not name.startswith("__")


def test_private_modules_are_imported_only_inside_their_package(graph: grimp.ImportGraph) -> None:
    outside = []
    for imported in sorted(m for m in graph.modules if _is_private(m)):
        package = imported.rsplit(".", 1)[0]
        for importer in sorted(graph.find_modules_that_directly_import(imported)):
            inside = importer == package or importer.startswith(package + ".")
            if not inside:
                outside.append(f"{importer} -> {imported}")
    assert not outside, "private modules imported from outside their package:\n" + "\n".join(
        outside
    )


def _loops(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for other in imports[module]:
            if other not in order:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], order[other])
        if low[module] == order[module]:
            component = set()
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.add(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for module in sorted(imports):
        if module not in order:
            visit(module)
    return found


def test_no_import_loops(graph: grimp.ImportGraph) -> None:
    loops = [sorted(loop) for loop in _loops(graph)]
    assert not loops, f"import loops: {loops}"


_MAX_FILE_LINES = 500
_MAX_FUNCTION_LINES = 80


def test_no_file_over_500_lines_and_no_function_over_80() -> None:
    too_long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        name = path.relative_to(SRC).as_posix()
        if text.count("\n") > _MAX_FILE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > _MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {lines} lines")
    assert too_long == []
