"""The ledger (hf_ring/ledger.py): every change hf_ring makes to an object it does not own goes through
it, and ``uninstall()`` undoes every entry.

- The ledger itself: attributes of modules, classes and instances (own, inherited, absent), mapping items,
  environment variables, hooks and changes made by a call; a change made again keeps its first original;
  scoped changes undone at the end of their block, also on an exception, in front of lasting ones; a
  model's entries go with the model.
- The walk: models of every kind hf_ring changes (a Llama with the chunked loss, tiled MLPs and offload, a
  Llama with tiled decoder layers in head groups and offload of every other layer's input, a
  hybrid with routed mixers and the router loss, Gemma 3 with images, a ParallelismConfig adopted), every
  ledger entry read, ``hf_ring.uninstall()``, and every original is back (by identity), every added name
  and hook gone.
- The source: no module of the package assigns an attribute of, or registers a hook on, an object it does
  not own outside the ledger, nor writes the environment (an AST reading of every file).
"""

from __future__ import annotations

import ast
import gc
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import hf_ring
from hf_ring.ledger import LEDGER, MISSING, Ledger

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hf_ring"


class Base:
    inherited = "base"


class Owner(Base):
    own = "own"


def test_attributes_items_environment_and_hooks_are_undone() -> None:
    ledger = Ledger()
    obj, mapping = Owner(), {"a": 1}
    ledger.set_attr(Owner, "own", "x", why="t")  # a class's own attribute
    ledger.set_attr(Owner, "inherited", "y", why="t")  # inherited: deleted on undo
    ledger.set_attr(obj, "fresh", 3, why="t", scope="model")  # absent
    ledger.set_item(mapping, "a", 2, why="t", where="m['a']")
    ledger.set_item(mapping, "b", 3, why="t", where="m['b']")
    ledger.set_env("HF_RING_LEDGER_TEST", "1", why="t")
    module = torch.nn.Linear(2, 2)
    ledger.hook(module, module.register_forward_hook(lambda *a: None), why="t")
    removed = []
    ledger.made(module, lambda: removed.append(1), why="t")
    assert (Owner.own, Owner.inherited, obj.fresh, mapping) == ("x", "y", 3, {"a": 2, "b": 3})
    assert os.environ["HF_RING_LEDGER_TEST"] == "1" and len(module._forward_hooks) == 1
    assert ledger.original(Owner, "inherited") == "base" and ledger.original(Owner, "own") == "own"
    ledger.undo_all()
    assert (Owner.own, Owner.inherited, "inherited" in vars(Owner)) == ("own", "base", False)
    assert "fresh" not in vars(obj)
    assert mapping == {"a": 1} and "HF_RING_LEDGER_TEST" not in os.environ
    assert not module._forward_hooks and removed == [1] and ledger.entries() == []


def test_a_change_made_again_keeps_its_first_original_and_scopes_stand_in_front() -> None:
    ledger = Ledger()
    ns = SimpleNamespace(f="first")
    ledger.set_attr(ns, "f", "second", why="t")
    ledger.set_attr(ns, "f", "third", why="t")
    assert ledger.original(ns, "f") == "first" and len(ledger.entries()) == 1
    other = SimpleNamespace(g=1)
    with pytest.raises(RuntimeError), ledger.scoped() as scope:
        scope.set_attr(ns, "f", "scoped", why="t")
        ledger.set_attr(other, "g", 2, why="t")  # made through the ledger inside the block: lasting
        assert ns.f == "scoped" and ledger.original(ns, "f") == "first"
        raise RuntimeError("the block fails")
    assert ns.f == "third" and ledger.find(ns, "f").original == "first"  # the lasting entry is in force again
    assert other.g == 2
    ledger.undo_all()
    assert ns.f == "first" and other.g == 1


def test_a_models_entries_go_with_the_model() -> None:
    ledger = Ledger()
    model = torch.nn.Linear(2, 2)
    ledger.set_attr(model, "forward", lambda x: x, why="t", scope="model")
    ledger.hook(model, model.register_forward_pre_hook(lambda *a: None), why="t")
    assert len(ledger.entries()) == 2
    del model
    gc.collect()
    assert ledger.entries() == []


def _build_everything(tmp_path: Path) -> list:
    """Models of every kind hf_ring changes, with every option that changes a model."""
    from testkit.families import causal_lm_class, tiny_config
    from testkit.models import tiny_batch, tiny_model
    from testkit.vlm import tiny_model as vlm_model

    llama = tiny_model("llama", "ring")
    hf_ring.enable_chunked_loss(llama)
    hf_ring.enable_tiled_mlp(llama, 4)
    hf_ring.enable_activation_checkpointing(llama, offload=True)
    llama(**hf_ring.shard_batch(tiny_batch(1, 12))).loss.backward()
    tiled = tiny_model("llama", "ring")  # tiled decoder layers in head groups, every other layer's input offloaded
    hf_ring.enable_activation_checkpointing(tiled, offload=True)
    hf_ring.enable_head_groups(tiled, 2)
    hf_ring.enable_tiled_layers(tiled, 4, offload_every=2)
    tiled.train()
    tiled(**hf_ring.shard_batch(tiny_batch(1, 12))).loss.backward()
    jamba = causal_lm_class("jamba")._from_config(tiny_config("jamba", router_aux=True), attn_implementation="ring")
    gemma3 = vlm_model("gemma3", "ring")
    from hf_ring.trainer.mesh import adopt_parallelism_config

    config = SimpleNamespace(cp_size=2, dp_replicate_size=1, dp_shard_size=1, tp_size=1, sp_size=1, cp_backend="torch")
    args = SimpleNamespace(parallelism_config=config, cp_size=1)
    assert adopt_parallelism_config(args, None) == 2
    return [llama, tiled, jamba, gemma3, args]


def test_uninstall_puts_back_every_original(tmp_path: Path) -> None:
    """Every entry the ledger holds after building and training: its place holds the original again (by
    identity), or nothing where nothing was; the hooks are gone. Then hf_ring installs anew."""
    try:
        kept = _build_everything(tmp_path)
        entries = LEDGER.entries()
        kinds = {e.kind for e in entries}
        assert {"attribute", "mapping item", "environment variable", "hook"} <= kinds, kinds
        assert {e.scope for e in entries} >= {"process", "modeling module", "model"}
        hf_ring.uninstall()
        assert LEDGER.entries() == []
        from hf_ring.transformers.attention import HEAD_GROUPS
        from hf_ring.transformers.layers import changed

        assert changed(kept[1]) == [] and len(HEAD_GROUPS) == 0
        for e in entries:
            owner = e.owner()
            if owner is None or e.kind == "hook":
                continue
            if e.kind == "environment variable":
                assert os.environ.get(e.name, MISSING) == e.original, e.where
            elif e.kind == "mapping item":
                assert owner.get(e.name, MISSING) is e.original, e.where
            elif e.original is MISSING:
                assert e.name not in getattr(owner, "__dict__", {}), e.where
            else:
                now = getattr(owner, "__dict__", {}).get(e.name, getattr(owner, e.name, MISSING))
                assert now is e.original, e.where
        for model in kept[:4]:
            for m in model.modules():
                assert not m._forward_hooks and not m._forward_pre_hooks, type(m).__name__
                assert not any(k.startswith("_hf_ring") for k in vars(m)), type(m).__name__
    finally:
        os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
        hf_ring.register()


# --- the source ----------------------------------------------------------------------------------

# (file, target or the name it is an attribute of) -> why the assignment is not a change to a foreign object
OWN = {
    ("hf_ring/ops/offload.py", "t"): "the op's own record of a transfer (_Transfer)",
    ("hf_ring/evaluation/generate.py", "prefill"): "the prefill batch's RingContext, hf_ring's own",
    ("hf_ring/evaluation/generate.py", "cache"): "hf_ring's own sharded KV cache (decode.ShardedCache)",
    ("hf_ring/transformers/decode.py", "cache"): "hf_ring's own sharded KV cache (ShardedCache)",
    ("hf_ring/__init__.py", "spec.loader"): "the loader of hf_ring's own lazily loaded module",
    ("hf_ring/__init__.py", "m.__loader__"): "hf_ring's own lazily loaded module",
    ("hf_ring/cli.py", "read.__name__"): "hf_ring's own function",
    ("hf_ring/recipes/recipe.py", "parser.error"): "the argument parser the recipe reader made",
    ("hf_ring/recipes/run.py", "args.train_sampling_strategy"): "the arguments the recipe parser made",
    ("hf_ring/recipes/run.py", "args.remove_unused_columns"): "the arguments the recipe parser made",
    ("hf_ring/trainer/mesh.py", "args.cp_size"): "RingTrainingArguments' own field",
    ("hf_ring/transformers/install.py", "new.hf_ring_original"): "hf_ring's own wrapper",
    ("hf_ring/transformers/multimodal.py", "out.pooler_output"): "the output this adapter returns, made for this call",
    ("hf_ring/transformers/multimodal.py", "out.last_hidden_state"): "the output this adapter returns",
    ("hf_ring/transformers/multimodal.py", "out.deepstack_features"): "the output this adapter returns",
}
HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
         "register_full_backward_pre_hook")  # fmt: skip


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_ledger_call(node: ast.AST, scopes: set[str]) -> bool:
    """A call of the ledger's, or of a scope of it (``with LEDGER.scoped() as scope``)."""
    is_method = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    return is_method and _root(node.func) in {"LEDGER", *scopes}


def foreign_changes(path: Path, rel: str) -> list[str]:
    """Assignments to (or deletions of) attributes of objects other than ``self``/``cls`` and the autograd
    context, ``setattr``/``delattr`` on them, environment writes, and hook registrations that no
    ``LEDGER.hook`` call receives, in one source file."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    withs = [item for node in ast.walk(tree) if isinstance(node, ast.With) for item in node.items]
    scopes = {w.optional_vars.id for w in withs
              if isinstance(w.optional_vars, ast.Name) and "LEDGER.scoped" in ast.unparse(w.context_expr)}  # fmt: skip

    def enclosing_function(node: ast.AST) -> str:
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node.name
        return ""

    def inside_ledger_call(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if _is_ledger_call(node, scopes):
                return True
        return False

    found = []

    def attribute(target: ast.Attribute, line: int) -> None:
        root, text = _root(target), ast.unparse(target)
        if root in ("self", "cls") or (rel, text) in OWN or (rel, root) in OWN:
            return
        if root in ("ctx", "fctx") and enclosing_function(target) in ("forward", "backward", "setup_context"):
            return  # an autograd Function's own context
        found.append(f"{rel}:{line}: {text}")

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                    attribute(sub, node.lineno)
                if isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store) and "environ" in ast.unparse(sub):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(sub)} (the environment)")
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("setattr", "delattr") and node.args and _root(node.args[0]) not in ("self", "cls"):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:60]}")
            if name in ("putenv", "unsetenv") or (
                isinstance(func, ast.Attribute) and "environ" in ast.unparse(func.value)
                and name in ("setdefault", "update", "pop", "clear")
            ):  # fmt: skip
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:60]} (the environment)")
            if name in HOOKS and not rel.startswith("hf_ring/ops/") and not inside_ledger_call(node):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(func)} (a hook outside LEDGER.hook)")
    return found


def test_no_change_to_a_foreign_object_outside_the_ledger() -> None:
    """The ops may register hooks on the module they are handed (``OffloadActivations``): the glue that hands it
    records their handles in the ledger."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != "hf_ring/ledger.py":
            found += foreign_changes(path, rel)
    assert not found, "change these through hf_ring.ledger.LEDGER:\n" + "\n".join(found)


def test_the_source_rule_catches_a_change(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os\n"
        "def f(model, head):\n"
        "    model.forward = None\n"
        "    setattr(model, 'x', 1)\n"
        "    os.environ['A'] = '1'\n"
        "    head.register_forward_pre_hook(print)\n"
        "    LEDGER.hook(head, head.register_forward_hook(print), why='fine')\n"
    )
    found = foreign_changes(bad, "hf_ring/bad.py")
    assert len(found) == 4, found
    assert sys.modules["hf_ring.ledger"].__file__.endswith("ledger.py")
