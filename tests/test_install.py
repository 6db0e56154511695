"""Every change hf_ring makes to transformers (hf_ring/transformers/install.py): one table, installed
for the modeling module of the model being built, undone exactly.

Import: ``import hf_ring`` imports no modeling module, and building a Llama imports no other one.
Build: a tiny Llama, a hybrid with an MoE router loss (Jamba: mixer kernels, an adapter on a class
method, the router loss and its caller), an MoE (Mixtral) and a pure-Mamba model (adapters on
inherited and own ``forward``s); Falcon and XLM refused while they are built. Uninstall: every name
of every touched module and class is the very object it was before, the registries hold no
"ring", models lose their loss and hooks; installing again works. docs/architecture.md shows the table.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import hf_ring
from hf_ring.ledger import MISSING
from hf_ring.transformers import install
from hf_ring.transformers.guard import watched
from hf_ring.transformers.loss import CausalLMLoss
from testkit.families import causal_lm_class, tiny_config
from testkit.models import tiny_batch, tiny_model

ROOT = Path(__file__).resolve().parent.parent
BUILT = ("llama", "jamba", "mixtral", "mamba")


def _python(code: str, timeout: float = 600) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


MODELING = "sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m)"


def test_import_and_a_llama_import_no_other_modeling_module() -> None:
    code = (
        "import sys, torch, transformers, accelerate, peft\n"
        f"before = {MODELING}\n"
        "import hf_ring\n"
        f"assert {MODELING} == before, 'import hf_ring imported a modeling module'\n"
        "from transformers.models.llama import configuration_llama, modeling_llama\n"
        "config = configuration_llama.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48,\n"
        "    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)\n"
        "model = modeling_llama.LlamaForCausalLM._from_config(config, attn_implementation='ring')\n"
        f"new = set({MODELING}) - set(before)\n"
        "assert new == {'transformers.models.llama.modeling_llama'}, new\n"
        "print('ok')\n"
    )
    assert _python(code).strip().endswith("ok")


def _modules() -> list[ModuleType]:
    return [sys.modules[causal_lm_class(t).__module__] for t in BUILT]


def _snapshot() -> dict[Any, dict[str, Any]]:
    """Every name of the built models' modeling modules and of their classes, of ``PreTrainedModel``,
    and of the registries: the objects themselves."""
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import AttentionMaskInterface

    owners: list[Any] = [PreTrainedModel]
    for module in _modules():
        owners.append(module)
        owners += [c for c in vars(module).values() if isinstance(c, type) and c.__module__ == module.__name__]
    out: dict[Any, dict[str, Any]] = {owner: dict(vars(owner)) for owner in owners}
    for mapping in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping, LOSS_MAPPING):
        out[id(mapping)] = dict(mapping)
    return out


def _changed(before: dict[Any, dict[str, Any]], after: dict[Any, dict[str, Any]]) -> list[str]:
    """The names bound to another object (or added, or removed), but for the values transformers
    caches on a model class the first time one is built (``_can_set_..._cached_value``)."""
    diffs = []
    for owner, names in before.items():
        now = after[owner]
        where = getattr(owner, "__name__", owner)
        keys = {n for n in names.keys() | now.keys() if not n.endswith("_cached_value")}
        diffs += [f"{where}.{n}" for n in keys if names.get(n, None) is not now.get(n, None)]
    return sorted(diffs)


def _build(model_type: str, attn: str = "ring") -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_config(model_type, router_aux=model_type in ("jamba", "mixtral"))
    return causal_lm_class(model_type)._from_config(config, attn_implementation=attn)


@pytest.fixture
def pristine() -> Iterator[dict[Any, dict[str, Any]]]:
    """transformers without hf_ring (the built families' modules imported), then hf_ring again."""
    for t in BUILT:
        causal_lm_class(t)
    hf_ring.uninstall()
    try:
        yield _snapshot()
    finally:
        hf_ring.register()


def test_build_then_uninstall_restores_transformers_exactly(pristine: dict) -> None:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    assert install.installed() == [] and "ring" not in AttentionInterface._global_mapping
    hf_ring.register()
    assert [a.why for a in install.installed()] == [install.ATTENTION.why, install.MASK.why, install.BUILD_HOOK.why]
    models = {t: _build(t) for t in BUILT}
    sdpa = tiny_model("llama", "sdpa")
    applied = install.installed()
    rows = {row.why for row in install.changes()}
    assert all(a.why in rows for a in applied if a.scope in (install.PROCESS, install.MODULE)), applied
    targets = {a.where for a in applied}
    jamba = "transformers.models.jamba.modeling_jamba"
    assert {f"{jamba}.causal_conv1d_fn", f"{jamba}.mamba_selective_scan", f"{jamba}.JambaModel.forward",
            f"{jamba}.load_balancing_loss_func", f"{jamba}.JambaForCausalLM.forward"} <= targets  # fmt: skip
    mixtral = "transformers.models.mixtral.modeling_mixtral"
    assert {f"{mixtral}.load_balancing_loss_func", f"{mixtral}.MixtralForCausalLM.forward"} <= targets
    assert not any(t.startswith("transformers.models.llama.") for t in targets)  # Llama: nothing in its module
    for a in applied:  # each keeps what it replaced, which is what transformers had
        if a.scope == install.MODULE:
            owner = a.owner()
            assert a.original is pristine[owner].get(a.name, getattr(owner, a.name, None)) or a.original is MISSING
            assert getattr(owner, a.name) is a.replacement()
            assert a.replacement().hf_ring_original is getattr(owner, a.name).hf_ring_original
    for model in (*models.values(), sdpa):
        assert isinstance(model.loss_function, CausalLMLoss) and watched(model)
    for t, refused in (("falcon", "falcon computes attention itself"), ("xlm", "xlm computes attention and")):
        with pytest.raises(hf_ring.RingNotSupported, match=refused):
            _build(t)

    hf_ring.uninstall()
    assert install.installed() == []
    assert _changed(pristine, _snapshot()) == []
    assert "ring" not in AttentionInterface._global_mapping and "ring" not in AttentionMaskInterface._global_mapping
    assert not hasattr(PreTrainedModel._check_and_adjust_attn_implementation, "hf_ring_original")
    for model in (*models.values(), sdpa):
        assert "_loss_function" not in model.__dict__ and not watched(model)
        assert not model._forward_hooks and not model._forward_pre_hooks
        assert not any(m._forward_pre_hooks for m in model.modules())

    hf_ring.register()  # installs anew: the same ring loss as sdpa on one rank
    ring, sdpa = tiny_model("llama", "ring"), tiny_model("llama", "sdpa")
    sdpa.load_state_dict(ring.state_dict())
    batch = tiny_batch(2, 13)
    want = sdpa(**batch).loss
    assert torch.allclose(ring(**hf_ring.shard_batch(batch)).loss, want, rtol=1e-5)
    jamba_model = _build("jamba")
    assert jamba_model.loss_function is not None
    assert hasattr(sys.modules[jamba].causal_conv1d_fn, "hf_ring_original")


def test_a_model_switched_to_the_ring_runs_it() -> None:
    """``set_attn_implementation("ring")`` runs the build hook too: the switched model runs the ring
    and computes the one-process loss on a sharded batch."""
    ring, sdpa = tiny_model("llama", "sdpa"), tiny_model("llama", "sdpa")
    sdpa.load_state_dict(ring.state_dict())
    ring.set_attn_implementation("ring")
    batch = tiny_batch(2, 13)
    kwargs = hf_ring.shard_batch(batch)
    got = ring(**kwargs).loss
    assert torch.allclose(got, sdpa(**batch).loss, rtol=1e-5)
    assert kwargs["ring_context"].cross_rank_calls.attention == 2  # one per layer: the ring ran


def test_uninstall_before_transformers_is_imported_registers_nothing() -> None:
    code = (
        "import sys, hf_ring\n"
        "hf_ring.uninstall()\n"
        "assert not any(getattr(f, 'hf_ring_registers', False) for f in sys.meta_path)\n"
        "from transformers import AttentionInterface\n"
        "assert 'ring' not in AttentionInterface._global_mapping\n"
        "hf_ring.register()\n"
        "assert 'ring' in AttentionInterface._global_mapping\n"
        "print('ok')\n"
    )
    assert _python(code).strip().endswith("ok")


def test_copies_of_a_model_get_their_own_loss() -> None:
    import copy

    model = tiny_model("llama", "ring")
    twin = copy.deepcopy(model)
    assert isinstance(twin.loss_function, CausalLMLoss) and twin.loss_function.model() is twin


def test_the_table_in_docs_is_the_table() -> None:
    """docs/architecture.md shows ``install.markdown()`` (``python -m hf_ring.transformers.install``)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert install.markdown() in doc, "docs/architecture.md: paste `python -m hf_ring.transformers.install`"
    for row in install.changes():  # and every row of the table is there, each mixer row in its module's line
        name = ".".join(row.target.split(".")[-2 if row.kind == install.METHOD else -1 :])
        assert f"`{row.target}`" in doc or f"`{name}`" in doc, row
