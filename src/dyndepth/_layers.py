"""The one seam between the layers of :mod:`dyndepth.nn` and the core.

A layer is built from the public loops (re-exported here with the one private variant a layer
needs, :func:`dyndepth._loop.scan_stacked`) and from what is listed below; ``dyndepth.nn``
imports nothing else from the core, so a layer's dependencies on internals are all in view here.

- the argument checks of the loops (each error names the argument and its value);
- :class:`dyndepth._keys.KeySchedule`: a key's data and the key of step ``i``, for a layer that
  closes over a key;
- :func:`dyndepth._sharding.zeros`: a buffer typed like a value (with its sharding on an Explicit
  mesh), to be written inside a step;
- :func:`stopped`: a function called inside a step with every value it closes over behind
  ``stop_gradient``;
- :func:`dyndepth._trace.call_step`: the user's function called as the loops call a step (a
  keyword-only ``key`` as a keyword; a signature that takes neither form, an error naming the
  arguments that decide the call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from . import _vma
from ._checks import bool_arg as bool_arg
from ._checks import callable_arg as callable_arg
from ._checks import count_arg as count_arg
from ._checks import same_structure as same_structure
from ._checks import static_nonneg_int as static_nonneg_int
from ._checks import strategy_arg as strategy_arg
from ._keys import KeySchedule as KeySchedule
from ._keys import check_key as check_key
from ._loop import repeat as repeat
from ._loop import scan as scan
from ._loop import scan_stacked as scan_stacked
from ._loop import while_loop as while_loop
from ._sharding import zeros as zeros
from ._step import closure_convert
from ._trace import call_step as call_step
from ._types import Strategy as Strategy


def stopped(fn: Callable, *example_args: Any) -> Callable:
    """``fn`` with every value it closes over (outer tracers included) behind ``stop_gradient``.

    Inside ``shard_map`` it is traced for arguments varying over the axes ``example_args`` vary
    over, and evaluated for whatever types the loop's state has then."""
    with _vma.loop_state_axes(_vma.state_axes_of(example_args)):
        jaxpr, consts, out_shape = closure_convert(fn, *example_args)
    consts = [lax.stop_gradient(c) for c in consts]
    out_tree = jax.tree_util.tree_structure(out_shape)

    def call(*args):
        out = _vma.eval_jaxpr(jaxpr.jaxpr, [], *consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(out_tree, out)

    return call
