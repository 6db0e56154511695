"""accelerate's ``ParallelismConfig(cp_size=...)`` adopted by hf_ring (``hf_ring.trainer.mesh``): the CP
size taken from it, the config taken away from accelerate, and one error naming the field for what
cannot work. (A training run through it: tests/test_dpo.py, case ``lora-sigmoid-parallelism_config``.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_ring.trainer.mesh import adopt_parallelism_config


def _pc(**sizes):
    base = dict(dp_replicate_size=1, dp_shard_size=1, tp_size=1, cp_size=1, sp_size=1, cp_backend="torch")
    return SimpleNamespace(**{**base, **sizes})


def test_cp_size_is_taken_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    args = SimpleNamespace(parallelism_config=_pc(cp_size=4, dp_shard_size=2), cp_size=1)
    assert adopt_parallelism_config(args, None) == 4
    assert args.parallelism_config is None and args.cp_size == 4
    assert adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(tp_size=1)), 2) == 2  # no CP there


def test_cp_size_is_taken_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    args = SimpleNamespace(parallelism_config=None)
    assert adopt_parallelism_config(args, None) == 2
    import os

    assert os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] == "false"  # accelerate does not build it again


@pytest.mark.parametrize(
    "sizes,field",
    [({"tp_size": 2}, "tp_size"), ({"sp_size": 2}, "sp_size"), ({"dp_replicate_size": 2}, "dp_replicate_size")],
)
def test_what_cannot_work_names_the_field(monkeypatch: pytest.MonkeyPatch, sizes: dict, field: str) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    with pytest.raises(ValueError, match=f"Set {field} to 1"):
        adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(cp_size=2, **sizes)), None)


def test_disagreeing_cp_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_PARALLELISM_CONFIG", raising=False)
    with pytest.raises(ValueError, match="cp_size=4 but TrainingArguments.parallelism_config has cp_size=2"):
        adopt_parallelism_config(SimpleNamespace(parallelism_config=_pc(cp_size=2)), 4)
