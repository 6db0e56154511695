"""Former name of ``hf_ring.planner.grids`` (imported by ``planner.plan``): the grids' old names.

Not part of the API: import ``GridCost``, ``compare_grids``, ``grid_cost``, ``recommend`` and
``choose_ulysses_size`` from ``hf_ring.planner``.
"""

from .grids import GridCost as LayoutCost
from .grids import choose_ulysses_size, recommend
from .grids import compare_grids as compare_layouts

__all__ = ["LayoutCost", "choose_ulysses_size", "compare_layouts", "recommend"]
