"""Every causal-LM family of the installed transformers at CP=2: exact or refused on every path (a
training step with labels, a prefill without labels, the training step with the chunked loss);
hybrid families (routed token mixers), sliding-window / chunked families, and families with attention
sinks or soft-capping also exact at CP=4, and every MoE family with its router load-balancing loss on
exact at CP=4 (or refused for another reason).

One test per family and variant (``testkit.families``): the three paths on 2 gloo ranks against
one process (``testkit.sweep.check_family``). WRONG (runs, differs) and BROKEN (another exception)
on any path are failures; the ones known today are strict xfails in ``KNOWN`` below: delete an entry when its
fix lands (the test then passes, and a strict xfail that passes fails). ``skipped`` results (the
single-process reference cannot run, or a variant changes nothing in that family) skip.

docs/models.md's table is ``render_table`` of the committed ``docs/models.json``
(``python scripts/sweep_models.py --update-docs`` regenerates both; tests/test_docs.py holds it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.families import families, skipped, variants
from testkit.mixers import hybrid
from testkit.sweep import check_family
from testkit.sweep_table import PATHS, path_record

# family or "family:variant" -> why it is WRONG or BROKEN today (docs/models.json has the numbers)
KNOWN: dict[str, str] = {}

ROOT = Path(__file__).resolve().parent.parent
N = 61  # tokens: not a multiple of 2 * CP, so shard_batch pads
CASES = [(family, variant) for family in families() for variant in (None, *variants(family))]


def _key(family: str, variant: str | None) -> str:
    return family if variant is None else f"{family}:{variant}"


def _statuses(record: dict) -> dict[str, str]:
    return {path: path_record(record, path)["status"] for path in PATHS}


def _details(record: dict) -> str:
    return "; ".join(f"{path}: {path_record(record, path).get('detail', '')}" for path in PATHS)


def _exact_or_refused(record: dict) -> None:
    """Every path that ran is exact or refused."""
    statuses = _statuses(record)
    assert set(statuses.values()) <= {"exact", "refused", "skipped"}, f"{statuses}: {_details(record)}"


def _exact(record: dict) -> None:
    statuses = _statuses(record)
    assert set(statuses.values()) == {"exact"}, f"{statuses}: {_details(record)}"


def _param(family: str, variant: str | None):
    key = _key(family, variant)
    marks = [pytest.mark.xfail(strict=True, reason=KNOWN[key])] if key in KNOWN else []
    return pytest.param(family, variant, id=key, marks=marks)


@pytest.mark.parametrize(("family", "variant"), [_param(f, v) for f, v in CASES])
def test_ring_is_exact_or_refused(family: str, variant: str | None) -> None:
    r = check_family(family, variant, n=N, cp=2)
    if all(s == "skipped" for s in _statuses(r).values()):
        pytest.skip(r["detail"])
    _exact_or_refused(r)
    if variant == "router_aux":
        assert "load-balancing" not in r["detail"], r["detail"]  # summed over the CP group, never refused


ROUTER_AUX = [family for family in families() if "router_aux" in variants(family)]


@pytest.mark.parametrize("family", ROUTER_AUX)
def test_router_loss_is_exact_at_cp4(family: str) -> None:
    """Every MoE family with its router load-balancing loss on at CP = 4: exact, or refused for
    something else (sinks, a mask used outside attention, a mixer without a context-parallel form)."""
    r = check_family(family, "router_aux", n=N, cp=4)
    if all(s == "skipped" for s in _statuses(r).values()):
        pytest.skip(r["detail"])
    _exact_or_refused(r)
    assert "load-balancing" not in r["detail"], r["detail"]


TEMPERATURE = [family for family in families() if "temperature" in variants(family)]


@pytest.mark.parametrize("family", TEMPERATURE)
def test_temperature_is_exact_at_cp4(family: str) -> None:
    """Llama 4's NoPE query temperature (``floor_scale=4``) from global positions at CP = 4."""
    _exact(check_family(family, "temperature", n=N, cp=4))


HYBRIDS = [family for family in families() if hybrid(family)]


@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrids_are_exact_at_cp4(family: str) -> None:
    """Families with routed token mixers (Gated DeltaNet, KDA, Mamba, Mamba2, short convolutions, ...) at
    CP = 4: chunks of 8 tokens, shorter than nothing but the state and convolution halos cross them all."""
    _exact(check_family(family, None, n=N, cp=4))


# Families whose `sliding` variant slides (or chunks, llama4_text) over fewer tokens than the sequence
# (gpt_oss, mimo_v2_flash and granite_swa with attention sinks, gemma2 with soft-capping on those layers)
WINDOWED = ["mistral", "ministral", "qwen2", "qwen2_moe", "gemma3_text", "gemma4_text", "olmo3", "cohere2",
            "exaone4", "llama4_text", "gpt_oss", "mimo_v2_flash", "granite_swa", "gemma2"]  # fmt: skip


@pytest.mark.parametrize("family", WINDOWED)
def test_windows_are_exact_at_cp4(family: str) -> None:
    """A window of 15 tokens over 61 at CP = 4: zigzag chunks of 8, so the windowed layers take the
    ring (the window spans chunks); at CP = 2 (chunks of 16) the sweep above takes the border route."""
    _exact(check_family(family, "sliding", n=N, cp=4))


# soft-capping (gemma2, vaultgemma) and attention sinks (the others): inside the ring at CP = 4 too
SINKS_SOFTCAP = [
    f
    for f in ("gemma2", "vaultgemma", "gpt_oss", "mimo_v2_flash", "granite_swa", "granitemoe_swa", "flint")
    if f in families()
]


@pytest.mark.parametrize("family", SINKS_SOFTCAP)
def test_sinks_and_softcap_are_exact_at_cp4(family: str) -> None:
    _exact(check_family(family, None, n=N, cp=4))


def test_known_entries_are_swept() -> None:
    cases = {_key(f, v) for f, v in CASES}
    assert not set(KNOWN) - cases, f"KNOWN entries that the sweep does not run: {sorted(set(KNOWN) - cases)}"


def test_every_causal_lm_type_is_swept_or_skipped_with_a_reason() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    swept, skips = set(families()), skipped()
    assert not swept & set(skips)
    assert swept | set(skips) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert all(skips.values())


def test_models_json_covers_the_sweep() -> None:
    records = json.loads((ROOT / "docs" / "models.json").read_text())
    have = {_key(r["family"], r.get("variant")) for r in records}
    missing = {_key(f, v) for f, v in CASES} - have
    assert not missing, f"docs/models.json lacks {sorted(missing)}: run python scripts/sweep_models.py"
    no_paths = [_key(r["family"], r.get("variant")) for r in records if r["status"] != "skipped" and "chunked" not in r]
    assert not no_paths, f"records without the unlabelled and chunked paths: {no_paths[:5]} (rerun the sweep)"
    bad = [_key(r["family"], r.get("variant")) for r in records if {"wrong", "broken"} & set(_statuses(r).values())]
    assert not bad, f"WRONG or BROKEN records in docs/models.json: {bad}"


def test_a_value_error_is_hf_rings_own_by_its_files_directory(tmp_path: Path) -> None:
    """``classify`` calls a ValueError raised in hf_ring's package a refusal and one raised in torch's a break,
    by the frame's file inside each package's directory: a checkout in a folder named ``hf_ring`` (its
    environment inside it) has ``hf_ring`` in every path, torch's too."""
    import hf_ring
    from testkit.frames import package_dir
    from testkit.sweep_rank import classify

    def raised_in(filename: str) -> BaseException:
        scope: dict = {}
        exec(compile("def check():\n    raise ValueError('shapes differ')\n", filename, "exec"), scope)
        try:
            scope["check"]()
        except ValueError as e:
            return e
        raise AssertionError("no exception")

    torch_in_checkout = tmp_path / "hf_ring" / ".venv" / "lib" / "torch" / "nn" / "functional.py"
    assert classify(raised_in(str(torch_in_checkout)))[0] == "broken"
    status, detail = classify(raised_in(str(package_dir(hf_ring) / "ops" / "checks.py")))
    assert status == "refused" and detail.endswith("(at hf_ring/ops/checks.py:2)"), detail
