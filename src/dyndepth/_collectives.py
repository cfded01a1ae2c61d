"""The mesh and ``vmap`` axes a loop's step reaches with collectives, and the trace-time checks
that refuse a loop whose devices would wait for each other forever.

Inside ``shard_map`` a loop whose number of steps differs per device must not run a collective
over the axes that number varies over: the devices that stopped never join it. The checks here
see the step's jaxpr when the loop is traced and raise a ``ValueError`` saying what to write
instead.
"""

from __future__ import annotations

from typing import Any

import jax

from . import _compat, _sharding, _vma


def check_uneven_trip_counts(loop: Any, fname: str, n: Any, init: Any) -> None:
    """Raise if the loop, inside ``shard_map``, could hang on a collective: one over a manual
    axis its trip count varies over, or XLA's own over the ``Auto`` axes of a partial-manual
    ``shard_map``."""
    _no_collective_over_uneven_trip_counts(loop, fname, n, init)
    _no_auto_axes_around_uneven_trip_counts(loop, fname, n, init)


def _names_in(jaxpr: Any, collectives_only: bool = False) -> set:
    """Axis names that collectives and ``axis_index`` (unless ``collectives_only``) in
    ``jaxpr`` refer to."""
    names: set = set()
    for eqn in jaxpr.eqns:
        if collectives_only and eqn.primitive.name in ("axis_index", "pvary", "pcast"):
            continue
        for param in ("axes", "axis_name"):
            value = eqn.params.get(param)
            values = value if isinstance(value, tuple | list) else (value,)
            names.update(v for v in values if isinstance(v, str))
        for sub in _compat.jaxprs_in_params(eqn.params):
            names |= _names_in(sub, collectives_only)
    return names


def _no_collective_over_uneven_trip_counts(loop: Any, fname: str, n: Any, init: Any):
    """Inside ``shard_map``, a collective in the step over a mesh axis that the trip count
    varies over (the depth, or the carry a stop predicate reads) would wait forever for the
    devices that stopped: raise instead."""
    manual = set(_sharding.manual_axes())
    if not manual:
        return
    names = _names_in(loop.step_jaxpr.jaxpr, collectives_only=True)
    if loop.cond_jaxpr is not None:
        names |= _names_in(loop.cond_jaxpr.jaxpr, collectives_only=True)
    uneven = set(_vma.state_axes_of([n] + ([init] if loop.cond_jaxpr is not None else [])))
    bad = sorted(names & manual & uneven)
    if bad:
        raise ValueError(
            f"`{fname}` uses a collective over mesh axis {bad[0]!r} inside shard_map, but the "
            f"number of steps varies over {bad[0]!r} (a per-device depth or stop condition): "
            "the devices that stop early would never join it and the program would hang. "
            f"Reduce over {bad[0]!r} after the loop, give every device the same depth, or use "
            "strategy='masked' (every device runs max_depth steps)"
        )


def _no_auto_axes_around_uneven_trip_counts(loop: Any, fname: str, n: Any, init: Any):
    """Inside a ``shard_map`` manual over some mesh axes only, XLA partitions the step over the
    others (``Auto`` axes) itself, and may put collectives inside the loop whose rendezvous takes
    every device (seen: collective-permutes of a transformer block's gradient, with its weights
    split over ``model``). When the number of steps varies over a manual axis, the devices that
    stop early never join them and the program hangs or aborts: raise at trace time instead.
    What XLA will emit is not known when the loop is traced, so any such loop raises."""
    manual = set(_sharding.manual_axes())
    if not manual:
        return
    mesh = jax.sharding.get_abstract_mesh()
    auto = [name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if name not in manual and kind == jax.sharding.AxisType.Auto
            and mesh.shape[name] > 1]  # fmt: skip
    uneven = [a for a in _vma.state_axes_of([n] + ([init] if loop.cond_jaxpr is not None else []))
              if a in manual]  # fmt: skip
    if not (auto and uneven):
        return
    everything = tuple(mesh.axis_names)
    raise ValueError(
        f"`{fname}` runs inside a jax.shard_map that is manual over {sorted(manual)} only; "
        f"XLA partitions the step over the other mesh axes {auto} (Auto) itself and may put "
        "collectives over every device inside the loop, while the number of steps varies over "
        f"{uneven[0]!r} (a per-device depth or stop condition): the devices that stop early "
        "would never join them and the program would hang. Instead, make the shard_map manual "
        f"over every mesh axis (axis_names={set(everything)}, or leave axis_names out), split "
        f"the weights with in_specs (such as P(None, {auto[0]!r})) and write the step's "
        f"reductions over {auto[0]!r} yourself (lax.psum); or use plain jax.jit on a mesh with "
        "Explicit axes (jax.make_mesh(..., axis_types=(AxisType.Explicit,) * k) under "
        "jax.set_mesh), where the weights stay split inside the loop; or give every device the "
        "same depth, or use strategy='masked' (every device runs max_depth steps)"
    )


def uses_vmap_axis(loop: Any) -> bool:
    """Whether the step or predicate uses the axis of an enclosing ``vmap`` (a collective or
    ``axis_index`` over it): then every sample must step in lockstep with the others."""
    names = _names_in(loop.step_jaxpr.jaxpr)
    if loop.cond_jaxpr is not None:
        names |= _names_in(loop.cond_jaxpr.jaxpr)
    return bool(_compat.bound_axes(names) - set(_sharding.manual_axes()))
