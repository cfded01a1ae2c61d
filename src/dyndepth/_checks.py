"""Argument validation shared by the public functions; every error names the argument."""

from __future__ import annotations

import functools
import operator
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from ._types import STRATEGIES

INT32_MAX = 2**31 - 1


def static_nonneg_int(value: Any, name: str, *, minimum: int = 0) -> int:
    """A static Python int >= minimum (numpy ints accepted; bools, floats, arrays are not)."""
    if isinstance(value, bool) or isinstance(value, jax.Array):
        raise TypeError(
            f"`{name}` must be a static Python int >= {minimum}, got {type(value).__name__}: "
            f"{value!r}"
        )
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a static Python int >= {minimum}, got {type(value).__name__}: "
            f"{value!r}"
        ) from None
    if ivalue < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {ivalue}")
    if ivalue > INT32_MAX:
        # step counters and buffer indices are int32 (x64 or not): larger values would wrap
        raise ValueError(f"`{name}` must be <= 2**31 - 1 = {INT32_MAX}, got {ivalue}")
    return ivalue


def checkpoints_arg(checkpoints: Any) -> int | None:
    if checkpoints is None:
        return None
    return static_nonneg_int(checkpoints, "checkpoints", minimum=1)


def slots_arg(slots: Any) -> int | tuple[int, ...] | str | None:
    """``None``, ``"work"``, one slot count (an int ``>= 1``), or the slot counts to choose from
    at run time (a non-empty tuple or list of them, returned descending without repeats)."""
    if slots is None or (isinstance(slots, str) and slots == "work"):
        return slots
    if isinstance(slots, str):
        raise ValueError(f'`slots` must be None, "work", a slot count or a sequence of them, '
                         f"got {slots!r}")  # fmt: skip
    if isinstance(slots, (tuple, list)):
        if not slots:
            raise ValueError(f"`slots` must name at least one slot count, got {slots!r}")
        counts = {static_nonneg_int(c, f"slots[{i}]", minimum=1) for i, c in enumerate(slots)}
        return tuple(sorted(counts, reverse=True))
    return static_nonneg_int(slots, "slots", minimum=1)


def strategy_arg(strategy: Any) -> str:
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def deprecated(message: str) -> None:
    """A ``DeprecationWarning`` pointing at the user's call of a public function, for a helper
    of that function to call (the warning skips this function, the helper and the public
    function)."""
    warnings.warn(message, DeprecationWarning, stacklevel=4)


def bool_arg(value: Any, name: str) -> bool:
    """A static Python bool (NumPy bools accepted)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"`{name}` must be a static Python bool, got {type(value).__name__}: {value!r}"
        )
    return bool(value)


def callable_arg(f: Any, name: str) -> None:
    if not callable(f):
        raise TypeError(f"`{name}` must be callable, got {type(f).__name__}: {f!r}")


def count_arg(
    value: Any, name: str, max_name: str, max_value: int, checked: bool = False
) -> jax.Array:
    """A loop count: a Python int or an integer scalar array, possibly traced.

    Concrete values are checked against ``[0, max_value]``; traced values are clamped into it,
    or with ``checked`` verified at run time. Returns an int32 scalar array.
    """
    if isinstance(value, bool) or isinstance(value, np.bool_):
        raise TypeError(f"`{name}` must be an integer, got bool: {value!r}")
    if isinstance(value, int | np.integer):
        if not 0 <= int(value) <= max_value:
            raise ValueError(
                f"`{name}` must lie in [0, {max_name}] = [0, {max_value}], got {int(value)}"
            )
        return jnp.asarray(int(value), dtype=jnp.int32)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"`{name}` must be a Python int or an integer scalar array, got "
            f"{type(value).__name__}: {value!r}"
        )
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"`{name}` must have an integer dtype, got dtype {dtype}"
            + (" (cast it with .astype(int))" if jnp.issubdtype(dtype, jnp.floating) else "")
        )
    if tuple(shape) != ():
        raise ValueError(
            f"`{name}` must be a scalar, got shape {tuple(shape)}; for one depth per sample, "
            "jax.vmap over the batch (or use dyndepth.repeat_batched)"
        )
    if not isinstance(value, jax.core.Tracer):
        concrete = int(value)
        if not 0 <= concrete <= max_value:
            raise ValueError(
                f"`{name}` must lie in [0, {max_name}] = [0, {max_value}], got {concrete}"
            )
    value = jnp.asarray(value)
    if checked:
        value = runtime_range_check(value, name, max_name, max_value)
    return _clamp(value, max_value)


def _clamp(value: jax.Array, max_value: int) -> jax.Array:
    """Clamp into ``[0, max_value]`` in the value's own dtype, then cast to int32 (casting first
    would wrap unsigned values >= 2**31 to negatives). A bound beyond the dtype's range is the
    dtype's largest value (casting it would wrap: ``uint8(300)`` is 44)."""
    dtype = np.dtype(value.dtype)
    hi = np.array(min(max_value, int(np.iinfo(dtype).max)), dtype)
    return jnp.clip(value, jnp.zeros((), dtype), hi).astype(jnp.int32)


def keystr(path: Any) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def same_structure(expected: Any, got: Any, fname: str, what: str) -> None:
    """Raise a TypeError naming the first leaf where ``got`` (what ``fname`` returned) differs
    from ``expected`` (its input ``what``) in pytree structure, shape or dtype."""
    t_exp = jax.tree_util.tree_structure(expected)
    t_got = jax.tree_util.tree_structure(got)
    if t_exp != t_got:
        raise TypeError(
            f"`{fname}` must return {what} with the same pytree structure as its input; "
            f"expected {t_exp}, got {t_got}"
        )
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(got), strict=True):
        sa, sb = tuple(jnp.shape(a)), tuple(jnp.shape(b))
        da, db = getattr(a, "dtype", None), getattr(b, "dtype", None)
        if sa != sb or da != db:
            raise TypeError(
                f"`{fname}` must keep the shape and dtype of {what}; at {what}{keystr(path)} "
                f"the input is {da}{list(sa)} but `{fname}` returned {db}{list(sb)}"
                + (" (cast the output with .astype(...))" if sa == sb else "")
            )


def batch_counts_arg(
    value: Any, name: str, max_name: str, max_value: int, checked: bool = False
) -> jax.Array:
    """Integer counts of shape ``(B,)`` (one per sample) or ``()`` (one for the whole batch; a
    Python int too); concrete values are range-checked."""
    if isinstance(value, list | tuple):
        # (Python ints are checked as Python ints: numpy cannot hold those beyond int64)
        for b, v in enumerate(value):
            _python_count_in_range(v, name, max_name, max_value, f" at batch index {b}")
        value = np.asarray(value)
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        _python_count_in_range(value, name, max_name, max_value, "")
        value = np.asarray(value, np.int32)
    dtype = getattr(value, "dtype", None)
    shape = getattr(value, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(f"`{name}` must be an integer array of shape (B,) or (), got {value!r}")
    if not jnp.issubdtype(dtype, jnp.integer) or np.dtype(dtype) == np.bool_:
        raise TypeError(f"`{name}` must have an integer dtype, got dtype {dtype}")
    if len(shape) > 1:
        raise ValueError(f"`{name}` must have shape (B,) or (), got shape {tuple(shape)}")
    if not isinstance(value, jax.core.Tracer):
        arr = np.asarray(value).reshape(-1)
        bad = np.nonzero((arr < 0) | (arr > max_value))[0]
        if bad.size:
            b = int(bad[0])
            where = f" at batch index {b}" if len(shape) else ""
            raise ValueError(
                f"`{name}` must lie in [0, {max_name}] = [0, {max_value}], got {int(arr[b])}{where}"
            )
    value = jnp.asarray(value)
    if checked:
        value = runtime_range_check(value, name, max_name, max_value)
    return _clamp(value, max_value)


def _python_count_in_range(value: Any, name: str, max_name: str, max_value: int,
                           where: str) -> None:  # fmt: skip
    """Raise if ``value``, a Python or NumPy int, lies outside ``[0, max_value]``."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_):
        if not 0 <= int(value) <= max_value:
            raise ValueError(
                f"`{name}` must lie in [0, {max_name}] = [0, {max_value}], got {int(value)}{where}"
            )


def leading_axis(tree: Any, name: str, B: int | None, source: str = "depths") -> int:
    """The size of the leading batch axis every leaf of ``tree`` shares: ``B`` (taken from
    ``source``), or with ``B`` None the first leaf's."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shape = jnp.shape(leaf)
        if shape and B is None:
            B, source = shape[0], f"{name}{keystr(path)}"
        if not shape or shape[0] != B:
            size = "" if B is None else f" of size {B} (from `{source}`)"
            raise ValueError(
                f"every leaf of `{name}` needs a leading batch axis{size}; "
                f"{name}{keystr(path)} has shape {tuple(shape)}"
            )
    return 0 if B is None else B


def _raise_out_of_range(name, max_name, max_value, value):
    arr = np.asarray(value)
    flat = arr.reshape(-1)
    bad = np.nonzero((flat < 0) | (flat > max_value))[0]
    if bad.size == 0:
        return
    b = int(bad[0])
    index = tuple(int(i) for i in np.unravel_index(b, arr.shape))
    where = "" if arr.ndim == 0 else f" at batch index {index[0] if len(index) == 1 else index}"
    raise ValueError(
        f"`{name}` must lie in [0, {max_name}] = [0, {max_value}], got {int(flat[b])}{where} "
        f"(checked=True)"
    )


def runtime_range_check(value: jax.Array, name: str, max_name: str, max_value: int) -> jax.Array:
    """Raise at run time (under jit and vmap) when ``value`` lies outside ``[0, max_value]``.

    Under ``vmap`` the whole batch is checked at once, so the message gives the batch index of the
    first offending value. The error surfaces from the jitted call as a runtime error whose
    message contains the ValueError's text."""
    report = functools.partial(_raise_out_of_range, name, max_name, max_value)

    @custom_vmap
    def check(v):
        jax.debug.callback(report, v)
        return v

    @check.def_vmap
    def check_rule(axis_size, in_batched, v):
        jax.debug.callback(report, v)
        return v, in_batched[0]

    return check(value)
