"""The maps a newcomer reads first are current: every module of ``hf_ring`` is in docs/architecture.md's
map of the floors (a module added without a line there fails here), and the map names no module
that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hf_ring"


def mapped_modules(text: str) -> set[str]:
    """The modules (paths under ``hf_ring/``) that the code block under "## The floors" names: a
    package line ``hf_ring/ops/`` stands for its ``__init__.py``, and the first column of the lines
    indented under it names its modules (``mixers/`` a subpackage, its modules indented further)."""
    block = text.split("## The floors", 1)[1].split("```", 2)[1]
    found: set[str] = set()
    package: str | None = None
    sub: str | None = None
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        if indent == 0:
            package = sub = None
            m = re.match(r"hf_ring/(\S+)", first)
            if m and m.group(1).endswith("/"):
                package = m.group(1)
                found.add(package + "__init__.py")
            elif m:
                found.add(m.group(1))
            continue
        if package is None:
            continue
        if indent <= 4:
            sub = None
        for name in re.findall(r"[\w*]+/|[\w]+\.py", first):
            if name.endswith("/"):
                sub = package + name
                found.add(sub + "__init__.py")
            else:
                found.add((sub if sub and indent > 4 else package) + name)
    return found


def test_every_module_is_in_the_architecture_map() -> None:
    found = mapped_modules((ROOT / "docs" / "architecture.md").read_text())
    modules = {str(p.relative_to(PKG)) for p in PKG.rglob("*.py")}
    missing = sorted(modules - found)
    assert not missing, (
        f"docs/architecture.md's map of the floors does not name {missing}: add a line for each under its "
        "package (what it is, in a few words)"
    )
    gone = sorted(f for f in found - modules if not f.endswith("__init__.py"))
    assert not gone, f"docs/architecture.md's map names modules that do not exist: {gone}"


def test_the_map_parser_reads_packages_and_subpackages() -> None:
    text = """## The floors

```
hf_ring/cli.py                    the command line
hf_ring/ops/                      torch only:
    kernels_cpu.py, kernels_cuda.py,  kernels
      kernels_flash.py
    mixers/                         token mixers:
      conv.py, runs.py                convolution
    tail.py                         replay (see ring.py)
testkit/                          helpers
```
"""
    assert mapped_modules(text) == {
        "cli.py", "ops/__init__.py", "ops/kernels_cpu.py", "ops/kernels_cuda.py", "ops/kernels_flash.py",
        "ops/mixers/__init__.py", "ops/mixers/conv.py", "ops/mixers/runs.py", "ops/tail.py",
    }  # fmt: skip
