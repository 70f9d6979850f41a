"""The package's shape: no import circles, one home per schedule name and for the GiB, a pure core."""

from __future__ import annotations

import ast
import pathlib
from collections import defaultdict

import pytest

from megapipe.schedules import SCHEDULE_NAMES

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "megapipe"
CORE = ("cost", "partition", "schedules", "simulate", "plan", "emit", "pack")
IMPURE = ("torch", "hydra", "omegaconf", "rich", "matplotlib", "yaml", "megapipe.monitor", "megapipe.profile.measure",
          "megapipe.files", "megapipe.plandir", "megapipe.config", "megapipe.commands", "megapipe.cli")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every megapipe module ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_no_import_circles():
    graph = {name: {dep for dep in _imports(name, path) if dep in MODULES and dep != name}
             for name, path in MODULES.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(trail[trail.index(dep):] + [dep] if dep in trail else [node, dep])
            elif dep not in state:
                visit(dep, trail + [dep])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert circles == []


def _string_constants(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings}


@pytest.mark.parametrize("name", [str(name) for name in SCHEDULE_NAMES])
def test_a_schedule_name_is_a_literal_in_at_most_two_modules_outside_schedules(name):
    where = sorted(module for module, path in MODULES.items()
                   if not module.startswith("megapipe.schedules") and name in _string_constants(path))
    assert len(where) <= 2, where


def test_one_gib_constant():
    where = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            power = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow)
                     and getattr(node.left, "value", None) in (2, 1024) and getattr(node.right, "value", None) in (30, 3))
            shift = (isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift)
                     and getattr(node.left, "value", None) == 1 and getattr(node.right, "value", None) == 30)
            if power or shift or (isinstance(node, ast.Constant) and node.value == 2**30):
                where.append(module)
    assert where == ["megapipe.units"]


def test_the_core_is_pure():
    """cost, partition, schedules, simulate, plan, emit and pack import no torch, Hydra, files or console, and print nothing."""
    offenders = defaultdict(list)
    for module, path in MODULES.items():
        if module.split(".")[1:2] not in [[part] for part in CORE]:
            continue
        for dep in _imports(module, path):
            if dep.split(".")[0] in IMPURE or dep.startswith(IMPURE):
                offenders[module].append(dep)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("print", "open"):
                offenders[module].append(f"{node.func.id}()")
    assert dict(offenders) == {}


def test_every_option_type_lives_in_options():
    where = sorted(f"{module}.{node.name}" for module, path in MODULES.items() if module != "megapipe.options"
                   for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.ClassDef) and node.name.endswith("Options"))
    assert where == []


def test_config_imports_nothing_from_plan():
    where = sorted(f"{module} -> {dep}" for module, path in MODULES.items() if module.startswith("megapipe.config")
                   for dep in _imports(module, path) if dep.startswith("megapipe.plan"))
    assert where == []


def test_the_schema_is_made_from_the_records():
    """Each setting is declared once: the Hydra schemas of the record-backed groups hold every record field,
    with the record's default unless the schema declares it null (searched) or replaces it."""
    import dataclasses

    from megapipe.config import schema
    from megapipe.options import PackOptions
    from megapipe.records import GpuSpec, LinkSpec, ModelSpec, RuntimeSpec

    for made, record in ((schema.ModelConfig, ModelSpec), (schema.GpuConfig, GpuSpec), (schema.LinkConfig, LinkSpec),
                         (schema.RuntimeConfig, RuntimeSpec), (schema.PackConfig, PackOptions)):
        names = [item.name for item in dataclasses.fields(made)]
        assert names[:len(dataclasses.fields(record))] == [item.name for item in dataclasses.fields(record)]
    source = (PACKAGE / "config" / "schema.py").read_text()
    for name in ("ModelConfig", "GpuConfig", "LinkConfig", "RuntimeConfig", "ParallelConfig", "TrainConfig",
                 "PackConfig"):
        assert f"class {name}" not in source, f"{name} is declared by hand beside its record"


def _names_defined_or_imported(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(alias.name.rpartition(".")[2] for alias in node.names)  # the name imported, aliased or not
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(target.id for target in targets if isinstance(target, ast.Name))
    return found


_GRAB_BAG = "Set" + "up"
"""The name of the record every command once took whole (spelled in parts so a search for it finds no use)."""


def test_no_grab_bag_record():
    """Commands take their own inputs and the job's Scenario; no module defines or imports the old grab-bag name."""
    where = sorted(module for module, path in MODULES.items() if _GRAB_BAG in _names_defined_or_imported(path))
    assert where == []


def _annotation_names(node: ast.expr | None) -> list[str] | None:
    """The type names of a return annotation (``A``, ``a.A``, ``A | B``, ``"A"``); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = _annotation_names(node.left), _annotation_names(node.right)
        return None if left is None or right is None else left + right
    return None


def test_every_command_prepares_its_own_inputs():
    """Each ``commands/<verb>.py`` with a ``prepare`` returns an annotated ``*Inputs`` record (or a union of them)."""
    checked, wrong = [], {}
    for path in sorted((PACKAGE / "commands").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "prepare":
                checked.append(path.stem)
                names = _annotation_names(node.returns)
                if not names or not all(name.endswith("Inputs") for name in names):
                    wrong[path.stem] = ast.unparse(node.returns) if node.returns else None
    assert wrong == {}
    assert {"plan", "simulate", "partition", "replan", "calibrate", "validate", "profile", "pack"} <= set(checked)


def test_pictures_are_made_in_one_place():
    """Every picture is built on report/canvas.py: no module uses pyplot (its global figure list) or saves a figure
    itself, so the pinned style, the DPI and the atomic write hold for all of them."""
    offenders = []
    for module, path in MODULES.items():
        if "matplotlib.pyplot" in _imports(module, path):
            offenders.append(f"{module} imports pyplot")
        if module != "megapipe.report.canvas" and ".savefig(" in path.read_text():
            offenders.append(f"{module} saves a figure")
    assert offenders == []
