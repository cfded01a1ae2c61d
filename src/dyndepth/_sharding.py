"""Where a value lives: the mesh context, and values typed with their shardings.

Inside ``jax.shard_map`` some mesh axes are manual (:func:`manual_axes`). Under plain ``jit``
with mesh axes of type ``Explicit``, arrays are typed with their shardings: dyndepth's own
buffers must then carry the types of the values written into them (:func:`zeros`,
:func:`mesh_context`), a loop over a batch sharded over such axes runs once per device
(:func:`batch_mesh`, :mod:`dyndepth._per_device`), and an operation traced on the whole batch
is re-targeted to one device's rows (:func:`without_other_mesh`). How values vary over manual
axes inside ``shard_map`` is :mod:`dyndepth._vma`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes of the enclosing ``shard_map`` (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(mesh.manual_axes)


def axes_of(entry: Any) -> tuple[str, ...]:
    """The mesh axes that one entry of a ``PartitionSpec`` names: none for ``None``, one for a
    name, several for a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_without(spec: Any, axes: set[str]) -> Any:
    def keep(entry):
        left = tuple(n for n in axes_of(entry) if n not in axes)
        return None if not left else (left if isinstance(entry, tuple) else left[0])

    return jax.sharding.PartitionSpec(*(keep(e) for e in spec))


def without_other_mesh(params: dict, mesh: Any) -> dict:
    """``params`` with a sharding on another mesh made one on ``mesh``. A step traced under
    ``jit`` with ``Explicit`` mesh axes records shardings on that mesh (``vmap`` over rows
    broadcasts with one; ``jax.sharding.reshard`` names its target); inside the per-device
    ``shard_map`` the same operation runs on a device's rows, where the axes that split the
    batch are manual: an output sharding or a reshard's target keeps its other axes (a
    tensor-parallel ``model`` axis; a matmul contracted over ``model`` needs its output
    sharding), one that is not a ``NamedSharding`` is dropped (None: inferred)."""
    out = dict(params)
    for name, value in params.items():
        other = getattr(value, "mesh", None)
        if other is None or getattr(other, "abstract_mesh", other) == mesh:
            continue
        if isinstance(value, jax.sharding.NamedSharding):
            manual = set(manual_axes())
            out[name] = jax.sharding.NamedSharding(mesh, _spec_without(value.spec, manual))
        elif name in ("sharding", "out_sharding"):
            out[name] = None
    return out


def explicit_batch_axes(x: Any) -> tuple[Any, tuple[str, ...]]:
    """``(mesh, axes)`` when the leading axis of ``x`` is sharded over ``Explicit`` mesh axes.

    That is how ``jax.jit`` sees a batch placed with ``jax.device_put(x, NamedSharding(mesh,
    P("data")))`` on a mesh from ``jax.make_mesh`` (whose axes are ``Explicit`` by default).
    ``(None, ())`` otherwise: unsharded, ``Auto`` axes (the sharding is not part of the type
    then) or already inside ``shard_map``.
    """
    try:
        sharding = jax.typeof(x).sharding
        mesh, spec = sharding.mesh, sharding.spec
    except AttributeError:
        return None, ()
    if mesh.empty or not len(spec) or spec[0] is None:
        return None, ()
    lead = axes_of(spec[0])
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if manual_axes() or any(types.get(a) != jax.sharding.AxisType.Explicit for a in lead):
        return None, ()
    return mesh, tuple(lead)


def batch_mesh(leaves: Any) -> tuple[Any, tuple[str, ...]]:
    """:func:`explicit_batch_axes` of the first leaf of ``leaves`` whose leading axis is
    sharded over ``Explicit`` mesh axes; ``(None, ())`` if none is."""
    for x in jax.tree_util.tree_leaves(leaves):
        mesh, axes = explicit_batch_axes(x)
        if mesh is not None:
            return mesh, axes
    return None, ()


def type_mesh(leaves: Any) -> Any:
    """The (abstract) mesh that some leaf's type carries, or None: under ``jit``, an array placed
    with a ``NamedSharding`` on a mesh with ``Explicit`` axes is typed with that mesh."""
    for x in jax.tree_util.tree_leaves(leaves):
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh
    return None


@contextlib.contextmanager
def mesh_context(leaves: Any):
    """Make the mesh that the leaves' types carry the context mesh, when none is set, for the
    duration: arrays dyndepth creates (``jnp.zeros`` buffers) then have the same type as the
    values written into them, as under ``jax.set_mesh``."""
    mesh = type_mesh(leaves) if jax.sharding.get_abstract_mesh().empty else None
    if mesh is None:
        yield
    else:
        with jax.sharding.use_abstract_mesh(mesh):
            yield


def _lead_sharding(lead: tuple[int, ...], aval: Any) -> Any:
    """The sharding of a buffer ``lead + aval.shape`` typed like ``aval`` on its trailing axes
    (the ``lead`` axes unsharded), or None where ``aval`` carries no mesh (or inside
    ``shard_map``)."""
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty or manual_axes():
        return None
    spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
    return jax.sharding.NamedSharding(
        sharding.mesh, jax.sharding.PartitionSpec(*([None] * len(lead)), *spec)
    )


def zeros(lead: tuple[int, ...], aval: Any) -> Any:
    """``jnp.zeros(lead + aval.shape, aval.dtype)``, typed like ``aval`` on its trailing axes
    (the ``lead`` axes unsharded) when ``aval`` carries a ``NamedSharding`` on a mesh, outside
    ``shard_map``: a buffer that values of type ``aval`` can be written into under ``jit`` with
    Explicit mesh axes. Plain zeros otherwise."""
    shape = tuple(lead) + tuple(aval.shape)
    target = _lead_sharding(lead, aval)
    if target is not None:
        return jax.numpy.zeros(shape, aval.dtype, out_sharding=target)
    return jax.numpy.zeros(shape, aval.dtype)


def blank(lead: tuple[int, ...], aval: Any) -> Any:
    """A buffer of the shape and type :func:`zeros` gives, its values left unset where the
    backend allows (``lax.empty``: a TPU or GPU allocates it without a pass over its memory; a
    CPU fills it with zeros), for a buffer whose cells are all written before they are read, or
    read only into a select that discards them (the stored carries, :mod:`dyndepth._store`).
    On a TPU v5e the zeros of a long tail's store took 3.1 ms of a 46 ms value_and_grad
    (``benchmarks/README.md``, "Where the long tail's time goes now")."""
    shape = tuple(lead) + tuple(aval.shape)
    return jax.lax.empty(shape, aval.dtype, out_sharding=_lead_sharding(lead, aval))


def typed_like(x: Any, ref: Any) -> Any:
    """``x`` resharded like ``ref`` when ``ref``'s type carries a sharding on a mesh that ``x``'s
    does not match (outside ``shard_map``); ``x`` otherwise."""
    want = getattr(jax.typeof(ref), "sharding", None)
    have = getattr(jax.typeof(x), "sharding", None)
    if (
        not isinstance(want, jax.sharding.NamedSharding)
        or want.mesh.empty
        or manual_axes()
        or jax.typeof(x).shape != jax.typeof(ref).shape
        or have == want
    ):
        return x
    return jax.sharding.reshard(x, want)


def typed_aval(x: Any, drop_lead: bool = False) -> Any:
    """``x``'s shape, dtype and, for an array typed with a mesh, its sharding; with
    ``drop_lead``, of one entry along the leading axis."""
    t = jax.typeof(x)
    shape = t.shape[1:] if drop_lead else t.shape
    sharding = getattr(t, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and not sharding.mesh.empty:
        if drop_lead:
            sharding = sharding.update(spec=tuple(sharding.spec)[1:])
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(shape, t.dtype)
