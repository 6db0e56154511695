"""Every change hf_ring makes to an object it does not own, in one place, and its undo.

hf_ring changes objects of transformers, TRL, accelerate and peft, model instances and the process
environment only through ``LEDGER`` (``tests/test_ledger.py`` reads the package's source and fails on
an assignment to a foreign object anywhere else). Each entry records where (an attribute of a module,
class or instance; a key of a mapping; an environment variable; a hook handle), what was there before,
what is there now, why, and its scope:

- ``"process"``, ``"modeling module"``, ``"model"``: lasting changes, undone by ``undo_all()``
  (``hf_ring.uninstall()``), newest first; an entry of a model instance is dropped with the model;
- changes made through ``with LEDGER.scoped() as scope: scope.set_attr(...)`` are undone when the block
  ends, also on an exception (a trainer step's view of accelerate, a recompute's checkpoint function, a
  probe's stand-ins); what other code changes through the ledger inside the block stays.

Undoing puts the original object back by identity, deletes what was not there (an inherited or absent
attribute, a new mapping key, an unset variable), and removes hooks. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTRIBUTE", "ENVIRONMENT", "HOOK", "ITEM", "LEDGER", "MISSING", "Entry", "Ledger", "Scope"]

ATTRIBUTE, ITEM, ENVIRONMENT, HOOK = "attribute", "mapping item", "environment variable", "hook"
SCOPED = "scoped"


class _Undo:
    """A handle whose ``remove()`` undoes a change made by a call."""

    def __init__(self, undo: Callable[[], Any]) -> None:
        self.remove = undo


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()  # nothing was there (an absent or inherited attribute, a new key, an unset variable)


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference where ``obj`` takes one (models, modules, classes, functions), else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _current(owner: Any, name: str) -> Any:
    """What ``owner.name`` is now, as undo puts it back: its own entry; ``MISSING`` where the name is absent or
    inherited from a class (undo deletes it); else the value another mechanism holds it in (a module's
    submodules, parameters and buffers: torch's ``__getattr__``), put back with ``setattr``."""
    own = getattr(owner, "__dict__", None)
    if own is not None and name in own:
        return own[name]
    bases = owner.__mro__[1:] if isinstance(owner, type) else type(owner).__mro__
    if any(name in vars(base) for base in bases):
        return MISSING
    return getattr(owner, name, MISSING)


def _describe(owner: Any) -> str:
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    name = getattr(owner, "__name__", None)
    if isinstance(name, str) and type(owner).__name__ == "module":
        return name
    return f"<{type(owner).__name__} at {id(owner):#x}>"


@dataclass(eq=False)
class Entry:
    """One change: its ``kind``, ``where`` (a dotted name, for people), ``why``, ``scope``; ``owner()``
    and ``name`` locate it (``owner()`` is ``None`` once a model it changed is gone); ``original`` is
    what was there (``MISSING``: nothing); ``replacement()`` what hf_ring put there; ``previous``: the
    entry a scoped change of the same place stands in front of."""

    kind: str
    where: str
    why: str
    scope: str
    name: Any
    original: Any
    owner: Callable[[], Any]
    replacement: Callable[[], Any]
    key: tuple = ()
    previous: Entry | None = None

    @property
    def alive(self) -> bool:
        return self.owner() is not None


class Ledger:
    """The record of hf_ring's changes to objects it does not own (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, Entry] = {}
        self._watched: set[tuple] = set()  # keys of instances whose death drops their entry

    # --- changing -------------------------------------------------------------------------------

    def set_attr(self, owner: Any, name: str, value: Any, *, why: str, scope: str = "process",
                 _in: Scope | None = None) -> Entry:  # fmt: skip
        """``owner.name = value``, recorded."""
        current = _current(owner, name)
        setattr(owner, name, value)
        entry = Entry(ATTRIBUTE, f"{_describe(owner)}.{name}", why, scope, name, current, _ref(owner),
                      _ref(value))  # fmt: skip
        return self._record((id(owner), ATTRIBUTE, name), entry, owner, _in)

    def set_item(self, mapping: MutableMapping, key: Any, value: Any, *, why: str, where: str,
                 scope: str = "process", _in: Scope | None = None) -> Entry:  # fmt: skip
        """``mapping[key] = value``, recorded (a registry's entry)."""
        current = mapping.get(key, MISSING)
        mapping[key] = value
        entry = Entry(ITEM, where, why, scope, key, current, _ref(mapping), _ref(value))
        return self._record((id(mapping), ITEM, key), entry, None, _in)

    def set_env(self, name: str, value: str, *, why: str, scope: str = "process", _in: Scope | None = None) -> Entry:
        """``os.environ[name] = value``, recorded."""
        current = os.environ.get(name, MISSING)
        os.environ[name] = value
        entry = Entry(ENVIRONMENT, f"os.environ[{name!r}]", why, scope, name, current, lambda: os.environ,
                      lambda: value)  # fmt: skip
        return self._record((0, ENVIRONMENT, name), entry, None, _in)

    def hook(self, owner: Any, handle: Any, *, why: str, scope: str = "model", _in: Scope | None = None) -> Entry:
        """A hook already registered on ``owner`` (a torch ``RemovableHandle``), recorded: undone by
        ``handle.remove()``."""
        entry = Entry(HOOK, f"{_describe(owner)} hook", why, scope, handle, MISSING, _ref(owner), lambda: handle)
        return self._record((id(handle), HOOK, id(owner)), entry, owner, _in)

    def made(self, owner: Any, undo: Callable[[], Any], *, why: str, scope: str = "process",
             _in: Scope | None = None) -> Entry:  # fmt: skip
        """A change made by a call on ``owner`` (a logging filter added, say), recorded with the call that
        undoes it."""
        return self.hook(owner, _Undo(undo), why=why, scope=scope, _in=_in)

    def _record(self, key: tuple, entry: Entry, owner: Any, scope: Scope | None) -> Entry:
        """Keep ``entry``: made through a ``Scope``, in front of what was recorded there (its ``original`` the value
        the block found); else in place of it, keeping the first original (a change made again)."""
        entry.key = key
        known = self._entries.get(key)
        if scope is not None:
            entry.scope, entry.previous = SCOPED, known
            scope.made.append(entry)
        elif known is not None and entry.kind != HOOK:
            entry.original, entry.previous = known.original, known.previous
        lasting = scope is None and owner is not None and key not in self._watched
        if lasting and not isinstance(owner, type) and type(owner).__name__ != "module":
            try:  # a model's entries go with the model
                weakref.finalize(owner, self._forget, key)
                self._watched.add(key)
            except TypeError:
                pass
        self._entries[key] = entry
        return entry

    def _forget(self, key: tuple) -> None:
        self._entries.pop(key, None)
        self._watched.discard(key)

    # --- reading --------------------------------------------------------------------------------

    def entries(self, scope: str | None = None) -> list[Entry]:
        """The changes in effect, oldest first (of one ``scope`` if given), of live owners."""
        return [e for e in self._entries.values() if e.alive and (scope is None or e.scope == scope)]

    def find(self, owner: Any, name: str) -> Entry | None:
        """The entry of ``owner.name``, if hf_ring changed it."""
        return self._entries.get((id(owner), ATTRIBUTE, name))

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner.name`` is without hf_ring (``None`` when it has nothing)."""
        entry = self.find(owner, name)
        while entry is not None and entry.previous is not None:
            entry = entry.previous
        if entry is None:
            return getattr(owner, name, None)
        if entry.original is not MISSING:
            return entry.original
        bases = owner.__mro__[1:] if isinstance(owner, type) else type(owner).__mro__
        return next((vars(b)[name] for b in bases if name in vars(b)), None)

    # --- undoing --------------------------------------------------------------------------------

    def undo(self, entry: Entry) -> None:
        """Put back what ``entry`` replaced (nothing if its owner is gone)."""
        if self._entries.get(entry.key) is entry:
            if entry.previous is not None:
                self._entries[entry.key] = entry.previous
            else:
                del self._entries[entry.key]
        owner = entry.owner()
        if owner is None:
            return
        if entry.kind == HOOK:
            entry.name.remove()
        elif entry.kind == ENVIRONMENT:
            if entry.original is MISSING:
                os.environ.pop(entry.name, None)
            else:
                os.environ[entry.name] = entry.original
        elif entry.kind == ITEM:
            if entry.original is MISSING:
                owner.pop(entry.name, None)
            else:
                owner[entry.name] = entry.original
        elif entry.original is MISSING:
            if entry.name in getattr(owner, "__dict__", {}):
                delattr(owner, entry.name)
        else:
            setattr(owner, entry.name, entry.original)

    def undo_all(self, where: Callable[[Entry], bool] | None = None) -> None:
        """Undo every lasting entry (or those ``where`` selects), newest first."""
        for entry in reversed(list(self._entries.values())):
            if entry.scope != SCOPED and (where is None or where(entry)):
                self.undo(entry)

    def undo_owner(self, owner: Any) -> None:
        """Undo every change made to ``owner`` (a model given back as it was)."""
        self.undo_all(lambda e: e.owner() is owner)

    @contextlib.contextmanager
    def scoped(self) -> Iterator[Scope]:
        """A ``Scope``: the changes made through it are undone when the block ends, newest first, also on an
        exception. Changes made inside the block through the ledger itself stay (they are lasting)."""
        scope = Scope(self)
        try:
            yield scope
        finally:
            scope.undo()


class Scope:
    """Temporary changes (``Ledger.scoped``): the ledger's ``set_attr``, ``set_item``, ``set_env``, ``hook`` and
    ``made``, undone together when the block that made the scope ends."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.made: list[Entry] = []

    def set_attr(self, owner: Any, name: str, value: Any, *, why: str) -> Entry:
        return self.ledger.set_attr(owner, name, value, why=why, _in=self)

    def set_item(self, mapping: MutableMapping, key: Any, value: Any, *, why: str, where: str) -> Entry:
        return self.ledger.set_item(mapping, key, value, why=why, where=where, _in=self)

    def set_env(self, name: str, value: str, *, why: str) -> Entry:
        return self.ledger.set_env(name, value, why=why, _in=self)

    def hook(self, owner: Any, handle: Any, *, why: str) -> Entry:
        return self.ledger.hook(owner, handle, why=why, _in=self)

    def change(self, owner: Any, undo: Callable[[], Any], *, why: str) -> Entry:
        return self.ledger.made(owner, undo, why=why, _in=self)

    def undo(self) -> None:
        for entry in reversed(self.made):
            self.ledger.undo(entry)
        self.made.clear()


LEDGER = Ledger()
