"""The import paths of ``hf_ring.training``, kept for code written before the trainer and the
recipes got one package each: ``hf_ring.training.<name>`` is the module it moved to (the same
module object, so classes and functions are identical), with a ``DeprecationWarning``.

    hf_ring.training.trl, .arguments, .checks, .export   -> hf_ring.trainer.<name>
    hf_ring.training.recipe, .run, .data, .evaluate      -> hf_ring.recipes.<name>
    hf_ring.training.plots                               -> hf_ring.plots
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

MOVED = {
    **{name: f"hf_ring.trainer.{name}" for name in ("arguments", "checks", "export", "trl")},
    **{name: f"hf_ring.recipes.{name}" for name in ("data", "evaluate", "recipe", "run")},
    "plots": "hf_ring.plots",
}

__path__: list[str] = []  # a package with no files of its own: its submodules are the moved modules


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``hf_ring.training.<name>`` and hands back the module ``MOVED[name]``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> ModuleType:
        new = MOVED[spec.name.rpartition(".")[2]]
        warnings.warn(f"{spec.name} moved to {new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__  # the import system sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved())
