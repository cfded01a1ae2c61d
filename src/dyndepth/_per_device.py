"""A batched loop runs once per device, each on its own shard of the batch.

A loop whose trip count depends on its rows must not be partitioned by XLA like ordinary
operations: the scheduler's batch-wide decisions (which rows share a slot, when the loop stops)
would make XLA gather the batch, and a collective over the batch axis inside a loop whose trip
count differs per device never completes. So every batched loop goes through :func:`per_device`,
which runs it on each device's rows, independently, and combines what the devices must agree on
(the loop statistics, a shared parameter's gradient) once, after the loops:

- **``Explicit`` mesh axes** (``jax.make_mesh``'s default): the sharding is part of the types
  when the loop is traced, so the loop runs inside a ``jax.shard_map`` of its own.
- **``Auto`` mesh axes** (``jax.sharding.Mesh``'s default) under plain ``jit``: the sharding is
  known only when XLA partitions the program, so the loop is a
  ``jax.experimental.custom_partitioning`` call whose partition rule runs it on each shard of
  the batch axis (the other operands replicated; a parameter sharded over another axis, such as
  ``model``, is gathered once, before the loop). With one device nothing changes. Three
  exceptions run the loop unpartitioned (right, the batch gathered): a step with side effects
  (``jax.debug.print``, callbacks: the partitioner cannot carry them into the per-device calls),
  a program lowered for ``jax.export`` (the partitioner is a host callback, which an exported
  program cannot hold) and one lowered for devices without a live backend (a deviceless
  compile for a topology: XLA calls the partitioner back through a live backend; a warning
  says so).
- Inside ``shard_map`` the loop already sees one device's rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _compat, _sharding

# Set while a kernel is traced for a lowering over several devices (see partitioning).
_PARTITIONING = contextvars.ContextVar("dyndepth_partitioning", default=False)
# Set while a kernel is traced as XLA's partition of a loop (see samples_keep_columns).
_XLA_SPLIT = contextvars.ContextVar("dyndepth_xla_split", default=False)
_LOWERING_DEPTH = contextvars.ContextVar("dyndepth_lowering_depth", default=0)


@contextlib.contextmanager
def partitioning(on: bool) -> Iterator[None]:
    """While tracing a kernel: whether its batched loops become partitioned calls."""
    token = _PARTITIONING.set(on)
    try:
        yield
    finally:
        _PARTITIONING.reset(token)


@contextlib.contextmanager
def nested_lowering() -> Iterator[None]:
    token = _LOWERING_DEPTH.set(_LOWERING_DEPTH.get() + 1)
    try:
        yield
    finally:
        _LOWERING_DEPTH.reset(token)


def samples_keep_columns() -> bool:
    """Whether a kernel traced now must keep each sample's stored carries in the sample's own
    column of the store (:mod:`dyndepth._store`), not in schedule order: inside a loop that
    XLA partitions (``Auto`` axes, :func:`_partitioned`), whose forward and backward passes XLA
    splits each on its own and may reshard the store between them, moving its columns with the
    rows. (Under ``Explicit`` axes the types fix both passes' split alike.)"""
    return _XLA_SPLIT.get()


def lowering_for_devices(ctx: mlir.LoweringRuleContext) -> bool:
    """Whether a loop lowered in ``ctx`` should be partitioned per device: the outermost loop
    of a program lowered for several devices, outside ``shard_map``. (XLA learns the shardings
    only then; a program lowered for any single device has no device assignment yet.)"""
    devices = _compat.lowering_devices(ctx)
    if _compat.lowered_for_export(ctx):
        # A custom_partitioning call carries a host callback (the partitioner) that an exported
        # program cannot serialize: such a loop runs unpartitioned there (right, the batch
        # gathered).
        return False
    if _LOWERING_DEPTH.get() or devices is None or len(devices) < 2:
        return False
    if not live_devices(devices):
        _warn_deviceless(devices)
        return False
    return True


def live_devices(devices: Any) -> bool:
    """Whether ``devices`` belong to a backend this process runs (a program lowered for a
    topology without one, ``jax.experimental.topologies``, has compile-only devices)."""
    try:
        live = set(jax.devices(devices[0].platform))
    except RuntimeError:  # no such backend here
        return False
    return all(d in live for d in devices)


def _warn_deviceless(devices: Any) -> None:
    """A loop on an ``Auto`` mesh compiled for devices without a live backend runs
    unpartitioned: XLA calls a ``custom_partitioning`` rule back while it compiles, through the
    live backend that registered it, so a compile-only client fails ("Custom emitter for
    CustomSPMDPartitioning not found")."""
    warnings.warn(
        f"dyndepth: a loop on a mesh with Auto axes is lowered for {len(devices)} "
        f"{devices[0].platform} devices without a live backend (a deviceless compile for a "
        "topology), where its per-device form (a custom_partitioning call, whose partitioner "
        "XLA calls back through a live backend) cannot compile; it is lowered unpartitioned "
        "instead: the same values, but XLA partitions the loop itself (the batch may be "
        "gathered, a collective may run inside the loop), so this program's memory and "
        "collectives are not those of the program compiled on live devices. For a deviceless "
        "compile of the per-device loops, place the arrays on a mesh with Explicit axes "
        "(jax.make_mesh's default) under jax.set_mesh (docs/tpu.md)",
        stacklevel=2,
    )


def needs_devices_when_lowered(*prims: Any) -> None:
    """Have ``jit`` lower programs containing ``prims`` with their device assignment, as it
    does for ``custom_partitioning`` (JAX's own registry, private: without it, or on a JAX
    without it, loops on ``Auto`` meshes run unpartitioned, right but gathered; see
    :func:`dyndepth._compat.require_devices_when_lowered`)."""
    _compat.require_devices_when_lowered(*prims)


@dataclasses.dataclass(frozen=True)
class Across:
    """Reductions over the devices that split the batch (none: the identity)."""

    axes: tuple[str, ...] = ()

    def sum(self, x: Any) -> Any:
        return lax.psum(x, self.axes) if self.axes else x

    def max(self, x: Any) -> Any:
        return lax.pmax(x, self.axes) if self.axes else x


def per_device(fn: Callable, args: tuple, in_batched: Any, probe: Any,
               merges: tuple[Callable, ...] = (), gather_params: bool = False,
               out_axes: Any = 0) -> tuple:  # fmt: skip
    """``fn(*args)``, once per device on its shard of the batch when the batch is sharded.

    ``in_batched`` (a pytree shaped like ``args``) marks the leaves with a batch axis: ``True``
    (axis 0) or the axis (an ``int``: a store's rows follow its slots); ``False`` or ``None``:
    replicated. ``fn`` returns a tuple whose last ``len(merges)`` entries are per-device
    values: ``merge(value, across)`` combines them over the devices (``across``: an
    :class:`Across`); every other output has a batch axis and stays split, at the axis
    ``out_axes`` gives (a pytree prefix of those outputs). ``probe`` holds leaves whose leading
    axis is the batch's, whose types may carry an ``Explicit`` sharding. On an ``Explicit``
    mesh, a replicated leaf split over other axes than the batch's (a tensor-parallel weight)
    stays split, unless ``gather_params``.
    """
    mesh, axes = _sharding.batch_mesh(probe)
    if mesh is not None:
        return _in_shard_map(fn, args, in_batched, merges, mesh, axes, gather_params, out_axes)
    if _PARTITIONING.get() and not _sharding.manual_axes() and not _explicit_typed(args):
        return _partitioned(fn, args, in_batched, merges, out_axes)
    return _merged(fn(*args), merges, Across())


def _batch_axis(flag: Any) -> int | None:
    """The batch axis an ``in_batched`` entry of :func:`per_device` names, or None."""
    if flag is None or flag is False:
        return None
    return 0 if flag is True else int(flag)


def _at_axis(axis: int | None, entry: Any) -> P:
    """The partition spec that splits axis ``axis`` over ``entry`` (replicated: None)."""
    return P() if axis is None else P(*([None] * axis), entry)


def _out_leaf_axes(out_axes: Any, kept: Any) -> list[int]:
    """The batch axis of every leaf of the split outputs ``kept``, from the prefix ``out_axes``."""
    prefix = jax.tree_util.tree_structure(out_axes)
    subtrees = prefix.flatten_up_to(kept)
    return [ax for ax, sub in zip(jax.tree_util.tree_leaves(out_axes), subtrees, strict=True)
            for _ in jax.tree_util.tree_leaves(sub)]  # fmt: skip


def _explicit_typed(leaves: Any) -> bool:
    """Whether a leaf's type carries a mesh with ``Explicit`` axes (then the types, not XLA's
    propagation, say how values are sharded)."""
    mesh = _sharding.type_mesh(leaves)
    return mesh is not None and jax.sharding.AxisType.Explicit in mesh.axis_types


def _merged(out: tuple, merges: tuple[Callable, ...], across: Across) -> tuple:
    out = tuple(out)
    keep = out[: len(out) - len(merges)]
    per_dev = out[len(out) - len(merges) :]
    return keep + tuple(m(v, across) for m, v in zip(merges, per_dev, strict=True))


def _in_shard_map(fn, args, in_batched, merges, mesh, axes, gather_params, out_axes) -> tuple:
    entry = axes if len(axes) > 1 else axes[0]
    in_specs = jax.tree_util.tree_map(lambda b: _at_axis(_batch_axis(b), entry), in_batched)
    out_specs = jax.tree_util.tree_map(lambda ax: _at_axis(ax, entry), out_axes)

    def placed(a, want):
        # shard_map takes Explicit-typed inputs only as typed: a batch leaf broadcast inside
        # dyndepth (replicated) is split, locally; a parameter sharded over the batch axes is
        # gathered, as replicated parameters are; one sharded over other axes only (a
        # tensor-parallel `model` axis) stays so, and the step runs split over them.
        target = P(*want, *([None] * (jax.numpy.ndim(a) - len(want))))
        have = getattr(jax.typeof(a), "sharding", None)
        if have is not None and not have.mesh.empty:
            if tuple(have.spec) == tuple(target):
                return a
            split_over = {n for entry in have.spec for n in _sharding.axes_of(entry)}
            if not (want or gather_params or split_over & set(axes)):
                return a
        return jax.sharding.reshard(a, NamedSharding(mesh, target))

    _warn_gathered(args, axes)
    args = jax.tree_util.tree_map(placed, args, in_specs)

    def local(*a):  # (split outputs, merged outputs): out_specs are a prefix of it
        out = _merged(fn(*a), merges, Across(axes))
        return out[: len(out) - len(merges)], out[len(out) - len(merges) :]

    keep, merged = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(out_specs, P()),
                                 axis_names=set(axes))(*args)  # fmt: skip
    return keep + merged


def _warn_gathered(args: Any, axes: tuple[str, ...]) -> None:
    """Warn, at trace time, of the operands split over other mesh axes than the batch's: the
    loop's ``shard_map`` is manual over the batch axes only, its ``in_specs`` may name only
    those, and JAX lowers its boundary replicated over every other ``Explicit`` axis, so XLA
    all-gathers such an operand (a tensor-parallel weight split over ``model``) on entry to the
    loop, forward and backward, whatever its type says inside."""
    split = []
    for a in jax.tree_util.tree_leaves(args):
        have = getattr(jax.typeof(a), "sharding", None)
        if have is None or have.mesh.empty:
            continue
        other = [n for entry in have.spec for n in _sharding.axes_of(entry) if n not in axes]
        if other:
            split.append(f"{jax.typeof(a).str_short()} (split over {', '.join(other)})")
    if split:
        warnings.warn(
            "dyndepth: a loop on an Explicit mesh runs in a shard_map manual over its batch "
            f"axes ({', '.join(axes)}), whose boundary JAX lowers replicated over the other "
            f"axes: {', '.join(split)} is all-gathered on entry to the loop (forward and "
            "backward), so the loop keeps no tensor parallelism of its memory. To keep the "
            "weights split, run the loop in a jax.shard_map manual over every mesh axis, the "
            "step with its own lax.psum (docs/scaling.md, 'Data and tensor parallelism "
            "together')",
            stacklevel=2,
        )


def _partitioned(fn, args, in_batched, merges, out_axes) -> tuple:
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    in_axes = [_batch_axis(b) for b in in_tree.flatten_up_to(in_batched)]
    out_struct = jax.eval_shape(fn, *args)
    n_keep = len(out_struct) - len(merges)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_struct)
    out_axes = _out_leaf_axes(out_axes, tuple(out_struct[:n_keep]))
    out_axes += [None] * (len(out_leaves) - len(out_axes))

    def flat(across):
        def run(*ls):
            token = _XLA_SPLIT.set(True)
            try:
                out = _merged(fn(*jax.tree_util.tree_unflatten(in_tree, ls)), merges, across)
            finally:
                _XLA_SPLIT.reset(token)
            return tuple(jax.tree_util.tree_leaves(out))

        return run

    def shardings(mesh, arg_shapes):
        lead = _batch_spec(arg_shapes, in_axes)
        placed = lambda axs: tuple(NamedSharding(mesh, _at_axis(a, lead)) for a in axs)
        return placed(in_axes), placed(out_axes), _sharding.axes_of(lead)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        arg_sh, out_sh, axes = shardings(mesh, arg_shapes)
        return mesh, flat(Across(axes)), out_sh, arg_sh

    call = custom_partitioning(flat(Across()))
    call.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=_rule(leaves, in_axes, out_leaves, out_axes),
    )
    return jax.tree_util.tree_unflatten(out_tree, list(call(*leaves)))


def _batch_spec(arg_shapes: Any, in_axes: list[int | None]) -> Any:
    """The mesh axes (a name, a tuple of names, or None) that split the first batched operand's
    batch axis."""
    for shape, axis in zip(arg_shapes, in_axes, strict=True):
        sharding = getattr(shape, "sharding", None)
        spec = getattr(sharding, "spec", ())
        if axis is not None and len(spec) > axis and spec[axis] is not None:
            return spec[axis]
    return None


def _rule(leaves, in_axes, out_leaves, out_axes) -> SdyShardingRule:
    """Shardy's view of the call: the batched leaves share the factor ``b`` of their batch
    axis; every other dimension is its own factor and must be replicated."""
    others: list[str] = []

    def mapping(x, axis):
        dims = []
        for d in range(jax.numpy.ndim(x)):
            if d == axis:
                dims.append("b")
            else:
                others.append(f"f{len(others)}")
                dims.append(others[-1])
        return tuple(dims)

    operands = tuple(mapping(x, a) for x, a in zip(leaves, in_axes, strict=True))
    results = tuple(mapping(x, a) for x, a in zip(out_leaves, out_axes, strict=True))
    return SdyShardingRule(operands, results, need_replication_factors=tuple(others))
