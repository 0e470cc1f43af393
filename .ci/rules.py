#!/usr/bin/env python3
"""The house rules CI checks on the source tree (issue 21), by reading it (nothing is imported).

1. The folders show the layers (issue 29), and imports go one way, down this list:
   ``functional/`` (optimizers on tensor lists), ``core/`` (pure: partition, ownership, layout,
   plans, piece state, checks), ``comm/`` (the collectives), ``shell/`` (the stateful parts),
   ``optimizer.py`` and ``hooks.py`` (the shell's faces), ``checkpoint/`` and ``integrations/``,
   ``app/`` (CLI, demo job, planner, launcher). ``core/`` and ``functional/`` import neither
   ``zero_functional.comm`` nor ``torch.distributed``; ``app/`` reaches the shell only through
   ``optimizer`` and ``hooks``. Imports under ``if TYPE_CHECKING:`` are annotations, not
   arrows, and are not counted.
1b. No import cycles among our modules (every import, at module scope or in a function).
2. No module reads another module's private names: no ``from zero_functional.x import _y``,
   and no ``obj._name`` outside the module that defines ``_name`` on its own objects (``self``
   and ``cls`` excepted), in ``src/``, ``tests/``, ``benchmarks/`` and ``property_tests/``.
   torch's own private names (its oracle class, kernels) are not ours and are not checked.
3. One idea per module: each module of ``src/`` opens with a docstring whose first line names
   it; no module over 900 lines (a cap flags a smell, it is not a design: there is no class cap).
4. No ``shell/`` module names the facade (``ZeroRedundancyOptimizer``), ``TYPE_CHECKING``
   included: collaborators get the table, the ownership and the shard, never the optimizer.

Prints each violation as ``path:line: rule: what``; exits 1 if there is any.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "zero_functional"
LAYERS: dict[str, int] = {
    "functional": 0,
    "core": 1,
    "comm": 2,
    "shell": 3,
    "optimizer": 4,
    "hooks": 4,
    "checkpoint": 5,
    "ema": 5,
    "integrations": 5,
    "app": 6,
    "__init__": 7,  # the package's lazy re-exports: the public surface, above everything
    "__main__": 7,
}
"""Each top-level folder or module of the package, and its layer: a module imports only from
its own layer or lower ones."""
PURE_LAYERS = ("functional", "core")
MAX_MODULE = 900
FACADE = "ZeroRedundancyOptimizer"


def _files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)


def _is_pure(path: Path) -> bool:
    return path.relative_to(SRC).parts[0] in PURE_LAYERS


def _unit(module: str) -> str | None:
    """The layer unit of a dotted ``zero_functional`` module (its folder, or its own name)."""
    parts = module.split(".")
    if parts[0] != "zero_functional":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                out.update(id(n) for n in ast.walk(inner))
    return out


def _imports(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """The ``zero_functional`` modules ``path`` imports (not for annotations), with their lines."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "zero_functional":
                continue
            for alias in node.names:
                if node.module == "zero_functional" and alias.name == "__version__":
                    continue  # a constant, not an arrow to the facade
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub if sub in modules else node.module))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name in modules)
    return out


def check_layers(files: list[Path]) -> list[str]:
    """Rule 1 and 1b: imports go down the layers, ``app/`` skips the shell, no cycles."""
    problems: list[str] = []
    names = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        rel = path.relative_to(ROOT)
        unit = _unit(name)
        assert unit is not None
        if unit not in LAYERS:
            problems.append(f"{rel}: layers: {unit!r} is in no layer (add it to LAYERS)")
            continue
        graph[name] = set()
        for line, target in _imports(path, set(names)):
            if target == name or target not in names:
                continue
            graph[name].add(target)
            to = _unit(target)
            if to == "__init__" and target == "zero_functional" and unit == "__main__":
                continue
            if to is not None and to in LAYERS and LAYERS[to] > LAYERS[unit]:
                problems.append(f"{rel}:{line}: layers: {unit} imports {target}, a layer above it")
            if unit == "app" and to == "shell":
                problems.append(
                    f"{rel}:{line}: layers: app/ imports {target}; it reaches the shell only "
                    "through zero_functional.optimizer and zero_functional.hooks"
                )
    problems.extend(_cycles(graph))
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle (a strongly connected set of modules), once."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
                found.append(f"src: import cycle: {' <-> '.join(sorted(component))}")

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private_attributes(files: list[Path]) -> dict[str, set[Path]]:
    """Each private name our source defines on its objects, and the modules that define it."""
    out: dict[str, set[Path]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.append(node.attr)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.append(item.name)
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    out.setdefault(name, set()).add(path)
    return out


def facade_lines(tree: ast.AST) -> list[int]:
    """The lines where code (not prose) names the facade: an import of it or of its module, a
    name, an attribute, an annotation (quoted or not)."""
    lines: list[int] = []
    for node in ast.walk(tree):
        named = False
        if isinstance(node, ast.ImportFrom):
            named = node.module == "zero_functional.optimizer" or any(
                a.name == FACADE for a in node.names
            )
        elif isinstance(node, ast.Name):
            named = node.id == FACADE
        elif isinstance(node, ast.Attribute):
            named = node.attr == FACADE
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.arg):
            annotations.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            annotations.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            annotations.append(node.annotation)
        for a in annotations:
            if a is not None and any(
                isinstance(n, ast.Constant) and isinstance(n.value, str) and FACADE in n.value
                for n in ast.walk(a)
            ):
                named = True
        if named:
            lines.append(getattr(node, "lineno", 0))
    return lines


def check() -> list[str]:
    problems: list[str] = []
    src_files = _files("src")
    problems.extend(check_layers(src_files))
    private = _private_attributes(src_files)
    for path in _files("src", "tests", "benchmarks", "property_tests"):
        text = path.read_text()
        tree = ast.parse(text)
        rel = path.relative_to(ROOT)
        in_src = SRC in path.parents
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("zero_functional"):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            problems.append(
                                f"{rel}:{node.lineno}: private import: {alias.name} from "
                                f"{node.module}"
                            )
                if in_src and _is_pure(path):
                    if (
                        node.module.startswith("torch.distributed")
                        or node.module in ("zero_functional.comm",)
                        or (
                            node.module == "zero_functional"
                            and any(a.name == "comm" for a in node.names)
                        )
                    ):
                        problems.append(f"{rel}:{node.lineno}: pure module imports {node.module}")
            elif isinstance(node, ast.Import) and in_src and _is_pure(path):
                for alias in node.names:
                    if (
                        alias.name.startswith("torch.distributed")
                        or alias.name == "zero_functional.comm"
                    ):
                        problems.append(f"{rel}:{node.lineno}: pure module imports {alias.name}")
            elif isinstance(node, ast.Attribute) and node.attr in private:
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls", "super"):
                    continue
                if (
                    isinstance(owner, ast.Call)
                    and isinstance(owner.func, ast.Name)
                    and owner.func.id == "super"
                ):
                    continue
                if path in private[node.attr]:
                    continue  # the defining module reads its own objects' fields
                problems.append(f"{rel}:{node.lineno}: reads another module's private {node.attr}")
        if in_src:
            lines = len(text.splitlines())
            if lines > MAX_MODULE:
                problems.append(f"{rel}: module has {lines} lines (at most {MAX_MODULE})")
            doc = ast.get_docstring(tree)
            if not doc or not doc.strip().splitlines()[0].strip():
                problems.append(f"{rel}: module: no docstring whose first line names its idea")
            if path.relative_to(SRC).parts[0] == "shell":
                problems.extend(f"{rel}:{line}: shell names the facade" for line in facade_lines(tree))
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(p)
    print(f"rules: {len(problems)} violation(s)" if problems else "rules: all hold")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
