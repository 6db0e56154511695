"""Whether code locations lie inside an installed package, decided by its directory, not by a name in a path.

A checkout may sit in a folder named ``hf_ring`` (the repository's own name), with its virtual environment
inside it: then torchrun's command lines, torch's own frames and the tests' files all have ``hf_ring/`` in
their paths. "A traceback through hf_ring's code" therefore means a frame whose file lies inside the
package's directory (``hf_ring.__file__``'s folder, symbolic links resolved), and nothing else.

- ``package_path(filename)``: ``"hf_ring/ops/ring.py"`` for a file of the package, else ``None``;
- ``package_frames(text)``: the package's code locations that a process's output names (traceback frames,
  ``File "...", line N``, and warnings, ``path.py:N: SomeWarning: ...``), as ``"hf_ring/<path>:<line>"``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from types import ModuleType

import hf_ring

# a traceback's frame, or the location a warning names (``/x/y.py:12: UserWarning: ...``)
_LOCATION = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)|(?P<wfile>[^\s"\']+\.py):(?P<wline>\d+): \w')


@functools.cache
def package_dir(package: ModuleType = hf_ring) -> Path:
    """The directory a package was imported from, symbolic links resolved."""
    return Path(package.__file__).resolve().parent  # type: ignore[arg-type]


def package_path(filename: str, package: Path | None = None, cwd: str | Path | None = None) -> str | None:
    """``"<package>/<path inside it>"`` when ``filename`` (absolute, or relative to ``cwd``) is a file of the
    package in directory ``package`` (default: hf_ring's), else ``None`` (``<string>``-like names too)."""
    if not filename or filename.startswith("<"):
        return None
    if not Path(filename).is_absolute():
        if cwd is None:
            return None
        filename = str(Path(cwd) / filename)
    return _inside(filename, package if package is not None else package_dir())


@functools.lru_cache(maxsize=4096)
def _inside(filename: str, root: Path) -> str | None:
    try:
        p = Path(filename).resolve()
    except (OSError, RuntimeError):
        return None
    if not p.is_relative_to(root):
        return None
    return f"{root.name}/{p.relative_to(root).as_posix()}"


def package_frames(text: str, package: Path | None = None, cwd: str | Path | None = None) -> list[str]:
    """Every code location in ``text`` (traceback frames, warnings) inside the package, in order, as
    ``"<package>/<path>:<line>"``; empty when no traceback or warning went through its code."""
    found = []
    for m in _LOCATION.finditer(text):
        where = package_path(m["file"] or m["wfile"], package, cwd)
        if where is not None:
            found.append(f"{where}:{m['line'] or m['wline']}")
    return found
