"""The static description of one loop (:class:`Loop`), and closure conversion.

A user's step function is *closure-converted* (:func:`closure_convert`): traced once to a jaxpr
whose inputs are the values it closes over ("consts": parameters, and tracers of enclosing
transformations), the carry, the step's slice of ``xs`` and the step's key. The consts then enter
the loop primitives as ordinary operands, so that ``vmap`` sees which of them are batched and
``grad`` which of them are perturbed; the jaxpr itself is a static parameter of the primitives.
How a user's function becomes a :class:`Loop` is :mod:`dyndepth._trace`; the loops derived for
differentiation are :mod:`dyndepth._derivative`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr

from . import _vma
from ._keys import KeySchedule
from ._leaves import Leaves


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """One loop, statically: step ``i`` of a sample runs while ``i < n`` (its depth, or
    ``max_steps``) and the stop predicate holds; the loop stops at the first step that does not
    run. Hashed by identity (it is a primitive parameter).

    ``step_jaxpr`` maps ``(consts, carry, x[, key])`` to ``(carry, y)`` (flat leaves); its first
    ``stacked`` consts are the slices, at the step's layer index ``x[0]``, of stacked operands
    (``dyndepth.nn.layer_drop``), so that the backward pass can reference a layer's slice
    instead of storing it. ``cond_jaxpr`` maps ``(cconsts, carry)`` to a boolean scalar, and
    with ``priority`` also to the sample's priority in the continuous-batching queue (a second
    output, so that both share the predicate's operands).
    """

    step_jaxpr: ClosedJaxpr
    cond_jaxpr: ClosedJaxpr | None
    n_consts: int
    n_cconsts: int
    carry_avals: tuple[Any, ...]
    x_avals: tuple[Any, ...]
    y_avals: tuple[Any, ...]
    keys: KeySchedule | None
    max_steps: int
    checkpoints: int | None
    strategy: str
    budget: int  # bytes of stored carries (dyndepth._budget), read when the loop was traced
    slots: int | tuple[int, ...] | None = None
    stacked: int = 0
    priority: bool = False

    # ------------------------------------------------------------------ calling the step

    def inner(self, consts: Sequence[Any], carry: Sequence[Any], x: Sequence[Any], key: Any):
        """The step on unbatched leaves, stacked consts already sliced."""
        args = [*consts, *carry, *x] + ([] if self.keys is None else [key])
        out = _vma.eval_jaxpr(self.step_jaxpr.jaxpr, list(self.step_jaxpr.consts), *args)
        nc = len(self.carry_avals)
        return list(out[:nc]), list(out[nc:])

    def step(self, consts: Sequence[Any], carry: Sequence[Any], x: Sequence[Any], key: Any):
        return self.inner(step_consts(self.stacked, consts, x), carry, x, key)

    def cond(self, cconsts: Sequence[Any], carry: Sequence[Any]) -> jax.Array:
        assert self.cond_jaxpr is not None
        cj = self.cond_jaxpr
        return _vma.eval_jaxpr(cj.jaxpr, list(cj.consts), *cconsts, *carry)[0]

    def start_priority(self, cconsts: Sequence[Any], carry: Sequence[Any]) -> jax.Array:
        """The sample's priority (a float32 scalar; higher starts first) at its ``carry``."""
        assert self.cond_jaxpr is not None and self.priority
        cj = self.cond_jaxpr
        value = _vma.eval_jaxpr(cj.jaxpr, list(cj.consts), *cconsts, *carry)[1]
        return jnp.asarray(value).astype(jnp.float32)

    def vstep(self, c_axes: Sequence[int | None], rows: int) -> Callable:
        """The step over a leading axis of ``rows``; consts with axis ``None`` are shared."""
        return jax.vmap(self.step, in_axes=(list(c_axes), 0, 0, 0), axis_size=rows)

    def vcond(self, cc_axes: Sequence[int | None], rows: int) -> Callable:
        return jax.vmap(self.cond, in_axes=(list(cc_axes), 0), axis_size=rows)

    def key_at(self, kd: Any, i: jax.Array) -> Any:
        """Keys of step ``i`` from key data ``kd``: per row when ``i`` has a row axis."""
        if self.keys is None:
            return None
        if jnp.ndim(i) == 0:
            return self.keys.key_at(kd, i)
        return jax.vmap(self.keys.key_at)(kd, i)

    # ------------------------------------------------------------------ checkpointing

    @property
    def slots_stored(self) -> int:
        """Checkpoint slots stored by the forward pass."""
        if self.checkpoints is None or self.checkpoints >= self.max_steps:
            return max(self.max_steps, 1)
        return self.checkpoints

    @property
    def thinning(self) -> bool:
        return self.slots_stored < self.max_steps


def step_consts(stacked: int, consts: Sequence[Any], x: Sequence[Any]) -> Leaves:
    """The consts one step sees: the first ``stacked`` sliced at the layer index ``x[0]``."""
    if not stacked:
        return list(consts)
    i = x[0]
    sliced = [jax.lax.dynamic_index_in_dim(c, i, 0, keepdims=False) for c in consts[:stacked]]
    return sliced + list(consts[stacked:])


# ----------------------------------------------------------------------------- closure conversion


def _lift_consts(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The jaxpr with its constvars turned into leading invars."""
    jaxpr = closed.jaxpr
    dbg = jaxpr.debug_info
    names = dbg.arg_names
    if names is not None:
        dbg = dbg._replace(arg_names=("",) * len(jaxpr.constvars) + tuple(names))
    lifted = jaxpr.replace(constvars=[], invars=jaxpr.constvars + jaxpr.invars, debug_info=dbg)
    return ClosedJaxpr(lifted, [])


def _canonical(c: Any) -> Any:
    # A closed-over NumPy array is a non-canonical constant for the primitives.
    return jnp.asarray(c) if isinstance(c, np.ndarray | np.generic) else c


def closure_convert(fn: Callable, *examples: Any) -> tuple[ClosedJaxpr, list, Any]:
    """Trace ``fn`` on abstract ``examples``: ``(jaxpr, consts, out_shape)``, every value ``fn``
    closes over (tracers of enclosing transformations included) a leading input of ``jaxpr``.

    Inside ``jax.shard_map`` the examples are traced as varying over the manual mesh axes, like
    the loop state they stand for."""
    examples = jax.tree_util.tree_map(_vma.varying_example, examples)
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*examples)
    return _lift_consts(closed), [_canonical(c) for c in closed.consts], out_shape
