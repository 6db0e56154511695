"""A light ``import hf_ring`` that still registers the ring with transformers.

``import hf_ring`` imports neither torch nor transformers (its public names load on first use), so
``hf-ring --help``, ``train --list``, ``train --config`` and ``plan`` start without them; "ring"
reaches transformers at once when transformers is imported already, else when its import has
finished. Each order of the two imports is run in a fresh interpreter, as is every command here.
The start-up times are measured by ``benchmarks/startup.py``, not asserted.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import hf_ring  # imported first, before transformers, in the spawned ranks too

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "accelerate", "peft", "datasets")


def _python(code: str, timeout: float = 240) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


LOADED = f"import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))"


def test_import_hf_ring_and_its_cli_load_no_torch() -> None:
    assert _python(f"import hf_ring\n{LOADED}").split("\n")[0] == "[]"
    assert _python(f"import hf_ring.cli\n{LOADED}").split("\n")[0] == "[]"


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--list"], ["train", "--config", "cpu-4proc"], ["train", "--help"],
     ["plan", "llama-3.1-8b-128k"], ["plan", "Llama-3.1-8B", "--seq-len", "128K", "--json"], ["eval", "--help"],
     ["plan", "tiny-cpu-demo"], ["plan", "llama-3.1-8b-dpo-128k"], ["plan", "qwen3-8b-grpo-64k"]],  # fmt: skip
    ids=lambda a: " ".join(a),
)
def test_commands_that_answer_at_once_import_no_torch(argv: list[str]) -> None:
    """The command runs to its end (``--help`` exits 0) and leaves torch, transformers & co unloaded."""
    code = (
        "import contextlib, io, sys\nfrom hf_ring.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    try:\n        code = main({argv!r})\n    except SystemExit as e:\n        code = e.code\n"
        f"assert code in (0, None), (code, out.getvalue())\n{LOADED}"
    )
    assert _python(code).strip() == "[]"


RING_MODEL = """
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, PreTrainedModel
import hf_ring
assert "ring" in AttentionInterface._global_mapping
assert hasattr(PreTrainedModel._check_and_adjust_attn_implementation, "hf_ring_original")  # the build hook
config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)
torch.manual_seed(0)
ring = LlamaForCausalLM._from_config(config, attn_implementation="ring")
sdpa = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
sdpa.load_state_dict(ring.state_dict())
ids = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(1))
got = ring(**hf_ring.shard_batch({"input_ids": ids, "labels": ids})).loss
want = sdpa(input_ids=ids, labels=ids).loss
assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
from hf_ring.transformers.loss import CausalLMLoss
assert isinstance(ring.loss_function, CausalLMLoss)
print("ok")
"""


@pytest.mark.parametrize(
    "first",
    ["import hf_ring", "import transformers", "import hf_ring, peft", "import transformers.modeling_utils, hf_ring",
     "import hf_ring; from transformers.models.llama import modeling_llama"],  # fmt: skip
)
def test_ring_is_registered_whichever_import_comes_first(first: str) -> None:
    """After ``first``, a model built with ``attn_implementation="ring"`` trains on a sharded batch
    with the loss of SDPA, and its causal-LM loss is hf_ring's."""
    assert _python(f"{first}\n{RING_MODEL}").strip() == "ok"


def test_the_import_hook_leaves_transformers_as_it_was() -> None:
    """Once transformers is loaded, the finder is gone and transformers' module keeps its own loader."""
    code = (
        "import sys, hf_ring, importlib.machinery\n"
        "assert any(type(f).__name__ == '_RegisterAfterImport' for f in sys.meta_path)\n"
        "import transformers\n"
        "assert not any(type(f).__name__ == '_RegisterAfterImport' for f in sys.meta_path)\n"
        "assert isinstance(transformers.__spec__.loader, importlib.machinery.SourceFileLoader)\n"
        "import importlib.resources; assert importlib.resources.files('transformers').is_dir()\n"
        "print('ok')"
    )
    assert _python(code).strip() == "ok"


def _ring_registered() -> bool:
    from transformers import AttentionInterface, PreTrainedModel

    hook = PreTrainedModel._check_and_adjust_attn_implementation
    return "ring" in AttentionInterface._global_mapping and hasattr(hook, "hf_ring_original")


def test_spawned_ranks_see_ring_registered() -> None:
    """torch.multiprocessing spawn workers (testkit.spawn) import this module, hence hf_ring, first."""
    from testkit.spawn import run_ranks

    assert run_ranks(2, _ring_registered) == [True, True]


def test_public_names_resolve_lazily_and_are_listed() -> None:
    """Every name of ``__all__`` resolves (and ``dir`` lists it); the ``TYPE_CHECKING`` imports name
    exactly ``__all__``, so type checkers and editors see what the module gives at run time."""
    for name in hf_ring.__all__:
        assert getattr(hf_ring, name) is not None and name in dir(hf_ring)
    from hf_ring.trainer import RingTrainer

    assert hf_ring.RingTrainer is RingTrainer and hf_ring.parallel.__name__ == "hf_ring.parallel"
    with pytest.raises(AttributeError):
        hf_ring.no_such_name  # noqa: B018
    tree = ast.parse((ROOT / "hf_ring" / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    typed = {a.asname or a.name for n in ast.walk(block) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert typed == set(hf_ring.__all__)
    from hf_ring import evaluation

    for name in evaluation.__all__:
        assert getattr(evaluation, name) is not None


def test_planner_chunk_size_is_the_chunked_loss_rule() -> None:
    """The planner restates ``ops.cross_entropy.default_chunk_size`` (that module imports torch)."""
    from hf_ring.ops.cross_entropy import LOGITS_CHUNK_BYTES, default_chunk_size
    planner = importlib.import_module("hf_ring.planner.plan")  # the module, not the function of that name

    assert planner.LOGITS_CHUNK_BYTES == LOGITS_CHUNK_BYTES
    for vocab in (0, 1, 84, 4096, 32_000, 128_256, 151_936, 262_144, 10**7):
        assert planner._default_chunk_size(vocab) == default_chunk_size(vocab), vocab


def test_planner_backend_names_are_the_kernels() -> None:
    """``hf-ring plan --attention-backend`` (no torch) lists ``hf_ring.ops.kernels.BACKENDS``."""
    from hf_ring.ops.kernels import BACKENDS
    from hf_ring.planner.settings import ATTENTION_BACKENDS

    assert ATTENTION_BACKENDS == BACKENDS
