"""The package's layers, read from its imports: a package imports only packages below it, and no module imports
another of the package inside a function unless that defers a heavy optional dependency (and says so)."""
from __future__ import annotations

import ast
from pathlib import Path

import appliance

ROOT = Path(appliance.__file__).resolve().parent
# bottom to top; a package may import any package listed before it
LAYERS = ["errors", "appliance", "attention", "model_zoo", "workload", "slo", "predictor", "config", "config_flags",
          "engine", "bench", "profile", "server", "cluster", "cli", "__main__"]
DEFERRED_OK = "defers"  # the comment on the line that explains an import inside a function


def _package(module: str) -> str:
    parts = module.removesuffix(".__init__").split(".")
    return parts[1] if len(parts) > 1 else "appliance"


def _imports(path: Path) -> list[tuple[ast.ImportFrom | ast.Import, bool]]:
    """Every appliance import of a file that runs (not those for type checkers only), and whether it sits inside a
    function."""
    tree = ast.parse(path.read_text())
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    typing_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)
                   for n in ast.walk(f)}
    module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.split(".")[:-node.level] if path.name != "__init__.py" else module.split(".")
                base = ".".join(pkg + ([node.module] if node.module else []))
            names = [base] if node.module or not node.level else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if (name == "appliance" or name.startswith("appliance.")) and id(node) not in typing_only:
                out.append((node, id(node) in inner, name))
    return out


def _module_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "embedded" not in p.parts)


def test_every_package_has_a_layer():
    packages = {_package(".".join(p.relative_to(ROOT.parent).with_suffix("").parts)) for p in _module_files()}
    assert packages <= set(LAYERS), f"packages without a layer: {packages - set(LAYERS)}"


def test_no_import_runs_up_a_layer():
    upward = []
    for path in _module_files():
        own = _package(".".join(path.relative_to(ROOT.parent).with_suffix("").parts))
        for node, _, name in _imports(path):
            target = _package(name)
            if target != own and LAYERS.index(target) > LAYERS.index(own):
                upward.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {own} -> {target}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_imports_inside_functions_only_defer_heavy_dependencies():
    hidden = []
    for path in _module_files():
        lines = path.read_text().splitlines()
        for node, inside, name in _imports(path):
            if inside and DEFERRED_OK not in lines[node.lineno - 1]:
                hidden.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} {name}")
    assert not hidden, "package imports inside functions (lift them, or say what heavy dependency they defer):\n" + \
        "\n".join(hidden)


def test_no_import_cycle_between_modules():
    graph: dict[str, set[str]] = {}
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in _module_files()}
    for module, path in modules.items():
        graph[module] = {name for _, inside, name in _imports(path) if not inside and name in modules
                         and name != module}
    seen: dict[str, int] = {}  # 1: on the stack, 2: done
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        seen[m] = 1
        for n in graph[m]:
            if seen.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in seen:
                visit(n, stack + [n])
        seen[m] = 2

    for m in graph:
        if m not in seen:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
