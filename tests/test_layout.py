"""The package layout's rules, checked from the source: no import circles between echopipe's
modules, and no underscore name imported from another module (a helper two modules need is
public inside its package)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "echopipe"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, path: Path, modules: dict[str, Path]):
    """(line, imported module, imported name or None, at module level?) for echopipe imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = {id(n) for n in tree.body}
    type_checking = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        eager = id(node) in top_level
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("echopipe"):
                    yield node.lineno, alias.name, None, eager
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if not target.startswith("echopipe"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    yield node.lineno, sub, None, eager
                else:
                    yield node.lineno, target, alias.name, eager


def test_no_underscore_name_is_imported_across_modules() -> None:
    modules = _modules()
    found = []
    for module, path in modules.items():
        for line, target, name, _ in _imports(module, path, modules):
            private_module = any(
                part.startswith("_") and part not in ("__init__", "_C")
                for part in target.split(".")
            )
            if target == module or (module == "echopipe.native" and name == "_C"):
                continue  # native.py is the one door to the compiled module
            if private_module or (name and name.startswith("_") and name != "__version__"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target} {name or ''}")
    assert not found, "underscore names imported across modules:\n" + "\n".join(found)


def test_no_import_circles_at_module_level() -> None:
    """Module-level imports form no cycle (imports inside functions run later and are allowed
    to point back; ``TYPE_CHECKING`` imports never run)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target, _, eager in _imports(module, path, modules):
            if eager and target in modules and target != module:
                graph[module].add(target)
    # A package's __init__ importing its own submodules is how packages work; a submodule
    # importing its package's __init__ back is the circle to find.
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_a_circle_and_an_underscore_import(tmp_path: Path) -> None:
    """The checker itself: a planted circle and a planted private import are found."""
    source = "from .b import _helper\n"
    path = tmp_path / "a.py"
    path.write_text(source)
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve("echopipe.pkg.a", path, node) == "echopipe.pkg.b"
    assert node.names[0].name.startswith("_")


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 90  # the rule is ~80; a few lines of tolerance, not a second rule


def _too_long(root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES under root."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{path.relative_to(root)}: {lines} lines")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name}, {length}")
    return found


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]


def _shared_self(root: Path) -> list[str]:
    """Classes that expect a subclass or sibling to provide what they use: a ``raise
    NotImplementedError`` stub, or a class joining two or more of the package's own classes
    that are not abstract bases (ABC or Protocol), as mixins sharing ``self`` do."""
    trees = {p: ast.parse(p.read_text(), filename=str(p)) for p in sorted(root.rglob("*.py"))}
    classes: dict[str, list[str]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = _base_names(node)
    abstract = {name for name, bases in classes.items() if {"ABC", "Protocol"} & set(bases)}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                    found.append(f"{path.relative_to(root)}:{node.lineno}: NotImplementedError")
            if isinstance(node, ast.ClassDef):
                own = [b for b in _base_names(node) if b in classes and b not in abstract]
                if len(own) >= 2:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.name}{own}")
    return found


def test_modules_and_functions_stay_short() -> None:
    found = _too_long(PACKAGE)
    assert not found, (
        f"modules over {MAX_MODULE_LINES} lines or functions over {MAX_FUNCTION_LINES}:\n"
        + "\n".join(found)
    )


def test_no_class_leaves_its_parts_to_a_subclass_or_sibling() -> None:
    found = _shared_self(PACKAGE)
    assert not found, "stubs or mixins sharing self:\n" + "\n".join(found)


def test_the_checks_see_long_code_stubs_and_mixins(tmp_path: Path) -> None:
    """The checkers themselves: each planted defect is found, and what is allowed is not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_MODULE_LINES)
    (tmp_path / "ok.py").write_text(
        "from abc import ABC\n"
        "class Base(ABC):\n    pass\n"
        "class Error(ValueError):\n    pass\n"
        "class Typed(Error, KeyError):\n    pass\n"
        "class A:\n    pass\n"
        "class Fine(A, Base):\n    pass\n"
    )
    (tmp_path / "mixins.py").write_text(
        "class B:\n    def f(self):\n        raise NotImplementedError\nclass C(A, B):\n    pass\n"
    )
    too_long = _too_long(tmp_path)
    assert too_long == ["long.py: 491 lines", "long.py:1: f, 91"]
    shared = sorted(_shared_self(tmp_path))
    assert shared == ["mixins.py:3: NotImplementedError", "mixins.py:4: C['A', 'B']"]
