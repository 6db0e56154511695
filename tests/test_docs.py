"""The pages a newcomer reads first are current: every module of ``hf_ring`` is in docs/architecture.md's
map of the floors (a module added without a line there fails here), and the map names no module
that is gone; every generated region of README.md and docs/*.md is what ``scripts/render_docs.py``
writes from the results files today, and the README stays a front door (at most about 200 lines)."""

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


def test_documents_equal_what_render_docs_writes() -> None:
    from benchmarks.report import update

    stale = [str(p.relative_to(ROOT)) for p in update(check=True)]
    assert not stale, (
        f"{stale} differ from what their results files render (a results file, a renderer or the planner "
        "changed): run python scripts/render_docs.py and commit the pages"
    )


def test_every_region_has_a_renderer_and_every_renderer_a_region() -> None:
    from benchmarks.report import RENDERERS, documents, regions

    used: dict[str, list[str]] = {}
    for path in documents():
        text = path.read_text()
        for name in regions(text):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
        opened = len(re.findall(r"^<!-- [\w-]+:start -->$", text, re.M))
        assert opened == len(regions(text)), f"{path.name}: a <!-- name:start --> without its <!-- name:end -->"
    unknown = sorted(set(used) - set(RENDERERS))
    assert not unknown, f"regions without a renderer in benchmarks/report.py: {unknown}"
    unused = sorted(set(RENDERERS) - set(used))
    assert not unused, f"renderers whose region no document shows: {unused}"


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail to a page in docs/"


def test_links_between_pages_lead_somewhere() -> None:
    from benchmarks.report import documents

    for path in documents():
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not link.startswith(("http://", "https://")):
                assert (path.parent / link).exists(), f"{path.relative_to(ROOT)} links to {link}, which does not exist"
