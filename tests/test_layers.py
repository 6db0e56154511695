"""The layering of docs/architecture.md, read from the sources (AST), so that it cannot erode.

- every module of ``hf_ring`` sits on a floor (``FLOORS``) and imports only its own package and
  the floors below it (0 upward imports);
- ``hf_ring/ops``: torch and the standard library only, imports inside ``ops`` only, no process
  globals (no ``global`` statement, no thread-locals);
- ``hf_ring/parallel.py``: torch and ``ops``;
- only ``hf_ring/transformers``, ``hf_ring/trainer``, ``hf_ring/recipes`` (its runner) and
  ``hf_ring/evaluation`` import transformers, peft, datasets or trl
  (``hf_ring/data`` may use accelerate's data loader);
- no runtime module imports the test or benchmark helpers; ``testkit`` imports neither ``tests``
  nor ``benchmarks``; ``benchmarks`` does not import ``tests``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hf_ring"
STDLIB = set(sys.stdlib_module_names)
HF = {"transformers", "accelerate", "peft", "datasets", "trl"}


def imports(path: Path) -> list[tuple[int, str]]:
    """``(level, module)`` of every import in ``path``, nested ones included (level 0: absolute)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or ""))
    return out


def resolve(path: Path, level: int, module: str, root: Path = ROOT) -> str:
    """The absolute dotted name of an import in ``path``."""
    if level == 0:
        return module
    parts = list(path.relative_to(root).with_suffix("").parts)[:-level]
    return ".".join([*parts, module] if module else parts)


def absolute_imports(path: Path, root: Path = ROOT) -> set[str]:
    return {resolve(path, level, module, root) for level, module in imports(path)}


def files(where: Path) -> list[Path]:
    return sorted(where.rglob("*.py")) if where.is_dir() else [where]


@pytest.mark.parametrize("path", files(PKG / "ops"), ids=lambda p: p.name)
def test_ops_import_only_torch_and_themselves(path: Path) -> None:
    for name in absolute_imports(path):
        top = name.split(".")[0]
        if top == "hf_ring":
            assert name.startswith("hf_ring.ops"), f"{path.name} imports {name}: ops import only ops"
        else:
            assert top in STDLIB or top == "torch", f"{path.name} imports {name}: ops import only torch"


@pytest.mark.parametrize("path", files(PKG / "ops"), ids=lambda p: p.name)
def test_ops_hold_no_process_globals(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{path.name} has a `global` statement"
    assert "threading.local" not in path.read_text(), f"{path.name} keeps thread-local state"


def test_parallel_imports_only_torch_and_ops() -> None:
    for name in absolute_imports(PKG / "parallel.py"):
        top = name.split(".")[0]
        assert top in STDLIB or top == "torch" or name.startswith("hf_ring.ops"), name


def test_only_the_glue_imports_transformers() -> None:
    """transformers is imported by the glue, the trainer, the recipe runner and the evaluation only;
    accelerate also by ``data``."""
    # the recipe reader and the section resolvers stay light: the planner (hf-ring plan) uses them
    hf_users = ("transformers", "trainer", "recipes", "evaluation")
    light = {PKG / "recipes" / "__init__.py", PKG / "recipes" / "reader.py", PKG / "recipes" / "sections.py"}
    for path in files(PKG):
        if any(path.is_relative_to(PKG / name) for name in hf_users) and path not in light:
            continue
        allowed = {"accelerate"} if path.is_relative_to(PKG / "data") else set()
        for name in absolute_imports(path):
            top = name.split(".")[0]
            assert top not in HF - allowed, f"{path.relative_to(ROOT)} imports {name}"


# The floors of hf_ring, from the bottom; a module imports its own package and lower floors only.
FLOORS: dict[str, int] = {
    "ops": 0,
    "parallel": 1,
    "planner": 1,
    "transformers": 2,
    "data": 3,
    "trainer": 4,
    "evaluation": 4,
    "recipes": 5,
    "cli": 6,
    "__init__": 6,  # the package's face: re-exports (RingTrainer on first use)
    "errors": 0,  # the user errors and their report: the standard library only
    "ledger": 0,  # every change to an object hf_ring does not own: the standard library only
    "plots": 2,  # every picture: matplotlib (optional) and the planner's token formatting
}


def floor_of(name: str) -> str:
    """The floor (a key of ``FLOORS``) of a dotted module name inside hf_ring."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.mark.parametrize("path", files(PKG), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_down(path: Path) -> None:
    own = floor_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert own in FLOORS, f"{path.relative_to(ROOT)}: put its package on a floor of FLOORS (and docs/architecture.md)"
    for name in absolute_imports(path):
        if name == "hf_ring" or not name.startswith("hf_ring."):
            continue
        other = floor_of(name)
        assert other == own or FLOORS[other] < FLOORS[own], (
            f"{path.relative_to(ROOT)} (floor {own}: {FLOORS[own]}) imports {name} (floor {other}: {FLOORS[other]})"
        )


def test_floors_cover_the_package() -> None:
    tops = {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert tops == set(FLOORS), f"without a floor: {tops - set(FLOORS)}; floors without a package: {set(FLOORS) - tops}"


@pytest.mark.parametrize(
    ("where", "forbidden"),
    [("hf_ring", {"testkit", "tests", "benchmarks"}), ("testkit", {"tests", "benchmarks"}), ("benchmarks", {"tests"})],
)
def test_helpers_do_not_loop(where: str, forbidden: set[str]) -> None:
    for path in files(ROOT / where):
        for name in absolute_imports(path):
            assert name.split(".")[0] not in forbidden, f"{path.relative_to(ROOT)} imports {name}"


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    """The reader sees nested and relative imports (the cases that would slip through a grep)."""
    bad = tmp_path / "hf_ring" / "ops" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("def f():\n    from ..transformers import patches\n    import transformers\n")
    assert absolute_imports(bad, tmp_path) == {"hf_ring.transformers", "transformers"}
