"""Stochastic depth: ``drop_path``, ``stochastic_residual`` and ``layer_drop``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax import lax

from .._layers import Strategy, scan_stacked
from . import _validate as v

__all__ = ["drop_path", "layer_drop", "stochastic_residual"]

DropMode = Literal["row", "batch"]

_MODES = ("row", "batch")


def _mask_shape(x: jax.Array, mode: str) -> tuple[int, ...]:
    if mode == "batch":
        return (1,) * x.ndim
    if x.ndim == 0:
        raise ValueError(
            'mode="row" needs an array with a leading batch axis, got a scalar `x`; use '
            'mode="batch" (inside jax.vmap, "batch" gives one decision per sample)'
        )
    return (x.shape[0],) + (1,) * (x.ndim - 1)


def _scaled(y: jax.Array, rate: Any) -> jax.Array:
    """``y / (1 - rate)`` in the dtype of ``y``; at ``rate == 1`` (everything dropped, so the
    value is never used) ``y`` itself, so that no inf or NaN reaches a gradient (as timm)."""
    if isinstance(rate, float):
        return y / (1.0 - rate) if rate < 1.0 else y
    keep = 1.0 - jnp.asarray(rate)
    return y / jnp.where(keep > 0, keep, 1.0).astype(y.dtype)


def _keep(key: Any, rate: Any, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def _common(x: Any, key: Any, rate: Any, mode: Any, scale: Any, deterministic: Any):
    mode = v.choice_arg(mode, "mode", _MODES)
    scale = v.bool_arg(scale, "scale")
    deterministic = v.bool_arg(deterministic, "deterministic")
    rate = v.rate_arg(rate)
    x = jnp.asarray(x)
    shape = _mask_shape(x, mode)
    active = not deterministic and not v.is_zero_rate(rate)
    if active:
        if key is None:
            raise TypeError(
                "`key` is None but a drop decision has to be drawn (rate="
                f"{rate!r}, deterministic=False); pass a PRNG key, or deterministic=True"
            )
        v.key_arg(key)
    return x, rate, mode, scale, shape, active


def drop_path(
    x: jax.Array,
    key: Any,
    rate: Any,
    *,
    mode: DropMode = "row",
    scale: bool = True,
    deterministic: bool = False,
) -> jax.Array:
    """Stochastic depth on one tensor ("drop path"), as in timm and torchvision.

    The plain-Python meaning::

        def drop_path(x, key, rate, *, mode, scale, deterministic):
            if deterministic or rate == 0:
                return x
            if mode == "row":      # one decision per sample (index of axis 0)
                keep = jax.random.bernoulli(key, 1 - rate, (x.shape[0],) + (1,) * (x.ndim - 1))
            else:                  # mode == "batch": one decision for the whole tensor
                keep = jax.random.bernoulli(key, 1 - rate, (1,) * x.ndim)
            kept = x / (1 - rate) if scale else x
            return where(keep, kept, 0)

    With ``scale=True``, ``E[drop_path(x)] = x`` over keys. Dropped entries are exactly zero
    (also where ``x`` holds inf or nan). ``rate == 1`` drops everything, as timm and
    torchvision do, with zero (not NaN) gradients, also for a traced rate. Used as
    ``x + drop_path(branch(x), key, rate)`` in a residual block; :func:`stochastic_residual`
    does the same and skips the branch's compute.

    **Under vmap:** the function sees one sample, so ``mode="row"`` there means one decision per
    row of the sample (e.g. per token). For one decision per sample inside a vmapped model, use
    ``mode="batch"`` with per-sample keys.

    **Arguments:**

    - ``x``: an array (for ``mode="row"``, with a leading batch axis).
    - ``key``: a PRNG key; may be ``None`` when no decision is drawn (``deterministic=True`` or a
      concrete ``rate == 0``).
    - ``rate``: the drop probability in ``[0, 1]``: a Python float or a float scalar array (may
      be traced; concrete values are checked).
    - ``mode``: ``"row"`` (default) or ``"batch"``.
    - ``scale``: divide kept outputs by ``1 - rate`` (default ``True``).
    - ``deterministic``: static bool; ``True`` returns ``x`` (evaluation).

    **Returns:** an array of the shape and dtype of ``x``.

    **Transformations:** jit, vmap, grad, jvp (the gradient is the same mask, scaled).

    **Raises:** ``ValueError`` for a rate outside ``[0, 1]``, an unknown ``mode`` or a scalar
    ``x`` in ``"row"`` mode; ``TypeError`` for a missing or malformed ``key`` or non-bool
    ``scale``/``deterministic``.
    """
    x, rate, mode, scale, shape, active = _common(x, key, rate, mode, scale, deterministic)
    if not active:
        return x
    keep = _keep(key, rate, shape)
    kept = _scaled(x, rate) if scale else x
    return jnp.where(keep, kept, jnp.zeros((), x.dtype))


def _default_capacity(batch: int, rate: Any) -> int:
    """Rows of the gather buffer: mean kept plus three standard deviations, at most ``batch``."""
    if not isinstance(rate, float):
        if not v.is_concrete(rate):
            return batch
        rate = float(rate)
    mean = batch * (1.0 - rate)
    sd = math.sqrt(batch * rate * (1.0 - rate))
    return min(batch, max(1, math.ceil(mean + 3.0 * sd)))


def stochastic_residual(
    branch: Callable[[jax.Array], jax.Array],
    x: jax.Array,
    key: Any,
    rate: Any,
    *,
    mode: DropMode = "batch",
    scale: bool = True,
    deterministic: bool = False,
    capacity: int | None = None,
) -> jax.Array:
    """A residual block with stochastic depth, skipping the branch's compute when it is dropped.

    The plain-Python meaning: exactly ``x + drop_path(branch(x), key, rate, mode=mode,
    scale=scale, deterministic=deterministic)``, with the same random draw, i.e.::

        keep = (the keep mask that drop_path draws from key)
        return x + where(keep, branch(x) / (1 - rate) if scale else branch(x), 0)

    **What is skipped:**

    - ``mode="batch"`` (default): one decision for the whole call; ``lax.cond`` on it runs the
      branch only when it is kept, forward and backward. Under ``jax.vmap`` with per-sample keys
      the decision is batched and ``lax.cond`` turns into a select that computes the branch for
      every sample (correct values, no saving); call it outside the ``vmap`` with one key, or
      use ``mode="row"`` on the batch.
    - ``mode="row"``: one decision per row (axis 0, ``B`` rows). The kept rows are gathered into a
      buffer of ``capacity`` rows (static), the branch runs on that buffer, and its outputs are
      scattered back. If more than ``capacity`` rows are kept (a ``lax.cond`` on the count), the
      branch runs on all ``B`` rows instead, so the result never depends on ``capacity``. The
      branch must then act row by row (row ``i`` of its output depends only on row ``i`` of its
      input, as an MLP or per-sample attention do; not batch norm), and must accept a leading
      axis of ``capacity`` rows. Pass ``capacity=x.shape[0]`` to always run it on all rows.
      Under an outer ``vmap`` the count is batched and both branches of that ``lax.cond`` run.

    **Arguments:**

    - ``branch``: ``branch(x) -> y`` with the shape and dtype of ``x``. Parameters it closes
      over receive gradients (zero when the branch is dropped).
    - ``x``, ``key``, ``rate``, ``scale``, ``deterministic``: as :func:`drop_path`.
    - ``mode``: ``"batch"`` (default) or ``"row"``.
    - ``capacity``: ``mode="row"`` only: static int in ``[1, B]``, the rows of the gather buffer.
      ``None`` picks ``ceil(B (1 - rate) + 3 sqrt(B rate (1 - rate)))`` (at most ``B``) for a
      concrete ``rate``, and ``B`` (no gather) for a traced one.

    **Returns:** an array of the shape and dtype of ``x``.

    **Transformations:** jit, vmap, grad, jvp.

    **Raises:** as :func:`drop_path`; ``TypeError`` if ``branch`` is not callable or changes the
    shape or dtype; ``ValueError`` for ``capacity`` outside ``[1, B]``.
    """
    v.callable_arg(branch, "branch")
    x, rate, mode, scale, shape, active = _common(x, key, rate, mode, scale, deterministic)
    v.same_structure(
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.eval_shape(branch, x), "branch", "x"
    )
    if capacity is not None:
        capacity = v.static_int(capacity, "capacity", minimum=1)
        if mode == "row" and capacity > x.shape[0]:
            raise ValueError(
                f"`capacity` must lie in [1, B] = [1, {x.shape[0]}] (B = x.shape[0]), got "
                f"{capacity}"
            )
    if not active:
        return x + branch(x)

    def update(y):
        return _scaled(y, rate) if scale else y

    keep = _keep(key, rate, shape)
    if mode == "batch":
        return lax.cond(keep.reshape(()), lambda x: x + update(branch(x)), lambda x: x, x)

    B = x.shape[0]
    cap = _default_capacity(B, rate) if capacity is None else capacity
    zero = jnp.zeros((), x.dtype)

    def full(x):
        return x + jnp.where(keep, update(branch(x)), zero)

    if cap >= B:
        return full(x)
    rows = keep.reshape(B)
    count = jnp.sum(rows.astype(jnp.int32))
    idx = jnp.nonzero(rows, size=cap, fill_value=B)[0]

    def gathered(x):
        y = update(branch(jnp.take(x, idx, axis=0, mode="clip")))
        return x.at[idx].add(y, mode="drop")

    return lax.cond(count <= cap, gathered, full, x)


def _layer_count(stacked_params: Any) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(stacked_params)
    if not leaves:
        raise ValueError("`stacked_params` has no array leaves, so there is no layer axis")
    sizes = {}
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(
                "every leaf of `stacked_params` needs a leading layer axis; stacked_params"
                f"{jax.tree_util.keystr(path)} is a scalar"
            )
        sizes.setdefault(shape[0], jax.tree_util.keystr(path))
    if len(sizes) != 1:
        found = ", ".join(f"{n} at stacked_params{p}" for n, p in sizes.items())
        raise ValueError(f"the leaves of `stacked_params` have different leading axes: {found}")
    return next(iter(sizes))


def _kept_layers(key: Any, rates: jax.Array, mode: str, shape: tuple) -> tuple:
    """The drop decisions: ``(keep, count, idx)``, ``keep`` per layer (``"batch"``) or per layer
    and row (``"row"``, shape ``(L, B)``), and the ``count`` layers that run (kept by at least
    one row) at the front of ``idx``, in order."""
    L = rates.shape[0]
    if mode == "batch":
        keep = jax.random.bernoulli(key, 1.0 - rates)
        run = keep
    else:
        keep = jax.random.bernoulli(key, 1.0 - rates[:, None], (L, shape[0]))
        run = jnp.any(keep, axis=1)
    count = jnp.sum(run.astype(jnp.int32))
    idx = jnp.nonzero(run, size=L, fill_value=0)[0]
    return keep, count, idx


def layer_drop(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    stacked_params: Any,
    x: jax.Array,
    key: Any,
    rate: Any,
    *,
    mode: DropMode = "batch",
    scale: bool = False,
    deterministic: bool = False,
    strategy: Strategy = "auto",
    checkpoints: int | None = None,
) -> jax.Array:
    """LayerDrop (Fan et al., 2019) over a stack of layers with parameters stacked on axis 0.

    The plain-Python meaning (``L`` layers, ``params[l]`` the slice ``l`` of every leaf)::

        def layer_drop(layer_fn, params, x, key, rate, *, mode, scale, deterministic):
            rates = broadcast_to(rate, (L,))
            if deterministic or all(rates == 0):
                keep = ones((L, B), bool)
            elif mode == "batch":   # one decision per layer
                keep = jax.random.bernoulli(key, 1 - rates)[:, None]          # (L, 1)
            else:                   # mode == "row": one per layer and row of x (axis 0)
                keep = jax.random.bernoulli(key, 1 - rates[:, None], (L, B))  # (L, B)
            for l in range(L):
                y = layer_fn(params[l], x)
                if scale and not deterministic:
                    y = x + (y - x) / (1 - rates[l])   # rescale the residual update
                x = where(keep[l] (per row), y, x)
            return x

    **Cost follows the layers kept.** The indices of the kept layers (in order) go into a
    static-size ``(L,)`` array with a traced count, and ``dyndepth.scan`` runs ``count`` steps,
    step ``j`` gathering the parameters of layer ``idx[j]`` from the stack by dynamic indexing:
    dropped layers cost neither forward nor backward compute. In ``"row"`` mode a layer runs if
    at least one row keeps it, on all rows, and rows that drop it keep their input (so a layer
    that mixes rows, such as batch norm, still matches the plain-Python meaning). Under
    ``jax.vmap`` with per-sample keys (``mode="batch"`` inside the vmapped function), each sample
    keeps its own layers and the loop runs through dyndepth's per-sample scheduler
    (``strategy="auto"``); the stack stays shared and each step gathers one layer per running
    slot.

    ``scale=True`` assumes a residual layer ``layer_fn(p, x) = x + branch(p, x)`` and divides
    the branch's update by the survival probability (stochastic-depth scaling); the default
    ``False`` is LayerDrop's (no rescaling).

    **Arguments:**

    - ``layer_fn``: ``layer_fn(params_l, x) -> x`` (same shape and dtype), ``params_l`` a slice
      of ``stacked_params``.
    - ``stacked_params``: a pytree whose leaves share a leading layer axis of size ``L``. They
      receive gradients; dropped layers get exactly zero.
    - ``x``: the input, an array (a leading batch axis for ``mode="row"``).
    - ``key``: a PRNG key (``None`` allowed when nothing is drawn).
    - ``rate``: drop probability in ``[0, 1]``: one for all layers (float or scalar array), or a
      float array of shape ``(L,)`` (see :func:`survival_schedule`). May be traced.
    - ``mode``: ``"batch"`` (default) or ``"row"``.
    - ``scale``: rescale kept residual updates by ``1 / (1 - rate)`` (default ``False``).
    - ``deterministic``: static bool; ``True`` runs every layer (evaluation), with a plain
      ``lax.scan``.
    - ``strategy``, ``checkpoints``: passed to :func:`dyndepth.scan`. ``"auto"`` (default)
      and ``"checkpointed"`` store each kept layer's residuals (the layer's parameters are
      referenced in the stack, not copied) and run no layer again in the backward pass; under
      ``vmap`` with per-sample keys, or when a layer's residuals exceed 4x the size of ``x``,
      they store one activation per kept layer and recompute each kept layer once.
      ``"masked"`` (scan + cond over all ``L`` layers) supports forward mode too, and skips
      dropped layers when the decisions are unbatched, but its reverse mode adds a gradient
      the size of the whole stack at every layer (slow for large stacks); ``"while"`` is
      forward mode only.

    **Returns:** an array of the shape and dtype of ``x``.

    **Transformations:** jit, vmap, grad, jvp, jacfwd, forward over reverse (every strategy
    but ``"while"``, which has no reverse mode; jvp with every strategy).

    **Raises:** ``ValueError`` for a rate outside ``[0, 1]``, rates of a shape other than ``()``
    or ``(L,)``, an unknown ``mode`` or ``strategy``, or leaves of ``stacked_params`` without a
    common leading axis; ``TypeError`` if ``layer_fn`` is not callable or changes the shape or
    dtype of ``x``, or for a missing ``key``.
    """
    v.callable_arg(layer_fn, "layer_fn")
    L = _layer_count(stacked_params)
    mode = v.choice_arg(mode, "mode", _MODES)
    scale = v.bool_arg(scale, "scale")
    deterministic = v.bool_arg(deterministic, "deterministic")
    rate = v.rate_arg(rate, shape=(L,))
    v.strategy_arg(strategy)
    x = jnp.asarray(x)
    shape = _mask_shape(x, mode)
    params0 = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked_params
    )
    out = jax.eval_shape(layer_fn, params0, jax.ShapeDtypeStruct(x.shape, x.dtype))
    v.same_structure(jax.ShapeDtypeStruct(x.shape, x.dtype), out, "layer_fn", "x")

    if deterministic or v.is_zero_rate(rate):
        out, _ = lax.scan(lambda x, p: (layer_fn(p, x), None), x, stacked_params)
        return out
    if key is None:
        raise TypeError(
            f"`key` is None but drop decisions have to be drawn (rate={rate!r}, "
            "deterministic=False); pass a PRNG key, or deterministic=True"
        )
    v.key_arg(key)
    rates = jnp.broadcast_to(jnp.asarray(rate, jnp.float32), (L,))
    keep, count, idx = _kept_layers(key, rates, mode, shape)
    # The layer's parameters, rate and row decisions are all sliced at the layer index by the
    # loop: under vmap with per-sample keys only the running slots' slices are gathered, never
    # a copy of the stack; unbatched, the backward pass references the slice instead of
    # storing it; and no gather with per-sample indices happens outside the loop (it would
    # need an output sharding when the batch is sharded over Explicit mesh axes).
    per_layer = (stacked_params, rates, None if mode == "batch" else keep)

    def step(x, _, p):
        params_l, r, rows = p
        y = layer_fn(params_l, x)
        if scale:
            y = x + _scaled(y - x, r)
        if rows is not None:
            y = jnp.where(rows.reshape(shape), y, x)
        return y

    return scan_stacked(
        step, x, (idx,), per_layer, depth=count, strategy=strategy, checkpoints=checkpoints
    )
