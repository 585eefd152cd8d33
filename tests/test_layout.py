"""The packages import in one direction, and nothing that runs imports the training pipeline.

Layers, left to right: verifiers, drafters, schedulers, hybrid, experiments. A module may import its own layer
and the layers to its left, never one to its right (function-level imports included: an import moved into a
function to dodge a cycle is still a dependency). `drafters.training` (the drafter training pipeline) is
imported by no run-time module (verifiers, drafters outside it, schedulers, hybrid); experiments and tests may.
The modules' import-time imports form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("verifiers", "drafters", "schedulers", "hybrid", "experiments")
RUN_TIME = ("verifiers", "drafters", "schedulers", "hybrid")
TRAINING = "drafters.training"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {module_name(path): path for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))}


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(module: str) -> list[tuple[int, str, bool]]:
    """(line, imported module, whether it runs when `module` is imported) for every import in `module`'s file.

    `from package import name` names the submodule package.name when there is one, else the package."""
    path = FILES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST, at_import: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and is_type_checking(child.test):
                for statement in child.body:
                    visit(ast.Module(body=[statement], type_ignores=[]), False)
                for statement in child.orelse:
                    visit(ast.Module(body=[statement], type_ignores=[]), at_import)
            elif isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, at_import) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: resolved against this module's package
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(anchor + ([child.module] if child.module else []))
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append((child.lineno, sub if sub in FILES else base, at_import))
            else:
                visit(child, at_import)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), True)
    return list(dict.fromkeys(found))  # `from a import b, c` names `a` once


IMPORTS = {module: imports(module) for module in FILES}


def where(module: str, line: int) -> str:
    return f"{FILES[module].relative_to(ROOT)}:{line}"


def test_every_layer_is_scanned():
    for layer in LAYERS:
        assert any(m == layer or m.startswith(layer + ".") for m in FILES), f"no modules found for {layer}"
    assert any(target == "verifiers.verifier" for _, target, _ in IMPORTS["hybrid.engine"])


def test_no_module_imports_a_layer_to_its_right():
    wrong = []
    for module, found in IMPORTS.items():
        own = LAYERS.index(module.split(".")[0])
        for line, target, _ in found:
            top = target.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > own:
                wrong.append(f"{where(module, line)}: {module} imports {target} ({top} is right of {LAYERS[own]})")
    assert not wrong, "imports against the layer order " + " -> ".join(LAYERS) + ":\n" + "\n".join(wrong)


def test_nothing_at_run_time_imports_the_training_package():
    wrong = []
    for module, found in IMPORTS.items():
        if module.split(".")[0] not in RUN_TIME or module == TRAINING or module.startswith(TRAINING + "."):
            continue
        for line, target, _ in found:
            if target == TRAINING or target.startswith(TRAINING + "."):
                wrong.append(f"{where(module, line)}: run-time module {module} imports {target}")
    assert not wrong, f"only {TRAINING} itself, experiments and tests may import {TRAINING}:\n" + "\n".join(wrong)


def test_import_time_imports_have_no_cycle():
    graph = {
        module: sorted({target for _, target, at_import in found if at_import and target in FILES} - {module})
        for module, found in IMPORTS.items()
    }
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def cycle_from(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in graph[module]:
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state and (found := cycle_from(target, path)):
                return found
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := cycle_from(module, [])):
            lines = [
                f"{where(a, next(line for line, t, now in IMPORTS[a] if t == b and now))}: {a} imports {b}"
                for a, b in zip(cycle, cycle[1:])
            ]
            raise AssertionError("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(lines))
