"""The layering of docs/architecture.md, read from the sources (AST), so that it cannot erode.

- ``hf_ring/ops``: torch and the standard library only, imports inside ``ops`` only, no process
  globals (no ``global`` statement, no thread-locals);
- ``hf_ring/parallel.py``: torch and ``ops``;
- only ``hf_ring/transformers``, ``hf_ring/trainer.py``, ``hf_ring/training`` and ``hf_ring/evaluation``
  import transformers, peft, datasets or trl
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
    """transformers is imported by the glue, the trainers and the evaluation only; accelerate also by ``data``."""
    glue = {PKG / "trainer.py", PKG / "__init__.py"}
    # hf_ring/training: the recipe runner around RingTrainer (recipes, datasets, PEFT export, TRL)
    for path in files(PKG):
        if path.is_relative_to(PKG / "transformers") or path.is_relative_to(PKG / "training") or path in glue:
            continue
        if path.is_relative_to(PKG / "evaluation"):  # loads models, tokenizers and PEFT adapters, as the trainers do
            continue
        allowed = {"accelerate"} if path.is_relative_to(PKG / "data") else set()
        for name in absolute_imports(path):
            top = name.split(".")[0]
            assert top not in HF - allowed, f"{path.relative_to(ROOT)} imports {name}"


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
