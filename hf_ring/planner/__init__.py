"""The memory planner: per-rank memory of long-context fine-tuning, without torch or a GPU.

    from hf_ring.planner import PlanSettings, model_shape, plan
    p = plan(model_shape("Llama-3.1-8B"), PlanSettings(seq_len=2**20, gpus=8, offload=True))
    print(p.table(), p.fits)

``models``: model shapes and a catalogue of published configs; ``settings``: ``PlanSettings``, every
input of a plan besides the model; ``terms``: the per-token activation terms and the bytes attention
sends; ``grids``: the ring, Ulysses and Ulysses x ring grids of a CP group priced per layer, and
``choose_ulysses_size`` (the rule of ``ulysses_size="auto"``); ``gpus``: GPU kinds (peaks,
bandwidths); ``timing``: a step's FLOPs and time on a GPU kind (``step_time``, kernel rates measured
or default: ``rates_for``); ``plan``: the planner (``plan``, ``smallest_cp``, ``max_seq_len``);
``table``: what ``hf-ring plan`` prints. Recipes: ``hf_ring.recipes``. ``hf-ring plan`` is the command
line (``hf_ring.cli``). Background and measurements: docs/memory.md.
"""

from .gpus import GPU_KINDS, GPUKind, gpu_kind
from .grids import GridCost, choose_ulysses_size, compare_grids, grid_cost, recommend
from .models import KNOWN_MODELS, LORA_TARGETS, MixerShape, ModelShape, known_config, model_shape
from .plan import GiB, Plan, max_seq_len, plan, smallest_cp
from .settings import PlanSettings, parse_ulysses_size, tokens
from .terms import activation_terms, attention_comm_bytes, mixer_comm_bytes, mixer_terms, ring_buffer_bytes
from .timing import Rates, StepTime, rates_for, step_flops, step_time

__all__ = [
    "GPU_KINDS",
    "GPUKind",
    "GiB",
    "GridCost",
    "KNOWN_MODELS",
    "LORA_TARGETS",
    "MixerShape",
    "ModelShape",
    "Plan",
    "PlanSettings",
    "Rates",
    "StepTime",
    "activation_terms",
    "attention_comm_bytes",
    "choose_ulysses_size",
    "compare_grids",
    "gpu_kind",
    "grid_cost",
    "known_config",
    "max_seq_len",
    "mixer_comm_bytes",
    "mixer_terms",
    "model_shape",
    "parse_ulysses_size",
    "plan",
    "rates_for",
    "recommend",
    "ring_buffer_bytes",
    "smallest_cp",
    "step_flops",
    "step_time",
    "tokens",
]
