"""dyndepth: random and data-dependent depth for JAX.

Loops whose forward and backward cost follow the depth actually run, under ``jit``, ``vmap`` and
``grad``, with a documented per-step key schedule.
"""

from importlib.metadata import PackageNotFoundError, version

from . import nn as nn
from ._budget import set_stored_carry_budget as set_stored_carry_budget
from ._budget import stored_carry_budget_scope as stored_carry_budget_scope
from ._calibrate import measure_iteration_cost as measure_iteration_cost
from ._cost import IterationCost as IterationCost
from ._cost import set_iteration_cost as set_iteration_cost
from ._keys import step_key as step_key
from ._loop import repeat as repeat
from ._loop import repeat_batched as repeat_batched
from ._loop import scan as scan
from ._loop import while_loop as while_loop

try:
    __version__ = version("dyndepth")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "IterationCost",
    "measure_iteration_cost",
    "repeat",
    "repeat_batched",
    "scan",
    "set_iteration_cost",
    "set_stored_carry_budget",
    "step_key",
    "stored_carry_budget_scope",
    "while_loop",
]
