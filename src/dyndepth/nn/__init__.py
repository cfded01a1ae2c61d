"""Layers and samplers for random and data-dependent depth, built on the ``dyndepth`` loops.

- Depth sampling: :func:`sample_depth`, :func:`sample_nk`, :func:`survival_schedule`.
- Stochastic depth: :func:`drop_path`, :func:`stochastic_residual`, :func:`layer_drop`.
- Recurrent depth (Deep Thinking, Huginn): :func:`recurrent_depth`.
- Learned halting (ACT, PonderNet): :func:`halting`, :func:`ponder_loss`.
"""

from ._drop import drop_path as drop_path
from ._drop import layer_drop as layer_drop
from ._drop import stochastic_residual as stochastic_residual
from ._halting import HaltingResult as HaltingResult
from ._halting import halting as halting
from ._halting import ponder_loss as ponder_loss
from ._recurrent import recurrent_depth as recurrent_depth
from ._sampling import sample_depth as sample_depth
from ._sampling import sample_nk as sample_nk
from ._sampling import survival_schedule as survival_schedule

__all__ = [
    "HaltingResult",
    "drop_path",
    "halting",
    "layer_drop",
    "ponder_loss",
    "recurrent_depth",
    "sample_depth",
    "sample_nk",
    "stochastic_residual",
    "survival_schedule",
]
