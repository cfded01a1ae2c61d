"""Argument validation for ``dyndepth.nn``: every error names the argument and its value.

The checks shared with the loop primitives (ints, callables, keys, loop counts) are theirs,
re-used here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _layers

callable_arg = _layers.callable_arg
static_int = _layers.static_nonneg_int
key_arg = _layers.check_key
count_arg = _layers.count_arg
strategy_arg = _layers.strategy_arg
same_structure = _layers.same_structure
bool_arg = _layers.bool_arg


def is_concrete(x: Any) -> bool:
    """True unless ``x`` is a tracer (its value is known at trace time)."""
    return not isinstance(x, jax.core.Tracer)


def choice_arg(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"`{name}` must be one of {tuple(choices)}, got {value!r}")
    return value


def static_float(value: Any, name: str) -> float:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
        raise TypeError(
            f"`{name}` must be a static Python float, got {type(value).__name__}: {value!r}"
        )
    return float(value)


def shape_arg(shape: Any, name: str = "shape") -> tuple[int, ...]:
    if isinstance(shape, int | np.integer) and not isinstance(shape, bool | np.bool_):
        shape = (shape,)
    if not isinstance(shape, tuple | list):
        raise TypeError(
            f"`{name}` must be a tuple of non-negative ints, got {type(shape).__name__}: {shape!r}"
        )
    return tuple(static_int(s, f"{name}[{i}]") for i, s in enumerate(shape))


def rate_arg(rate: Any, name: str = "rate", *, shape: tuple[int, ...] | None = None) -> Any:
    """A drop rate in ``[0, 1]``: a Python float, or a float array (scalar, or ``shape``).

    Concrete values are checked; traced ones are used as they are. Returns the rate unchanged
    (Python floats stay Python floats, so they stay weakly typed).
    """
    if isinstance(rate, bool | np.bool_):
        raise TypeError(f"`{name}` must be a float in [0, 1], got bool: {rate!r}")
    if isinstance(rate, int | float | np.number):
        value = float(rate)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"`{name}` must lie in [0, 1], got {rate!r}")
        return value
    dtype = getattr(rate, "dtype", None)
    rshape = getattr(rate, "shape", None)
    if dtype is None or rshape is None:
        raise TypeError(
            f"`{name}` must be a float or a float array, got {type(rate).__name__}: {rate!r}"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`{name}` must have a floating dtype, got dtype {dtype}")
    allowed = [()] if shape is None else [(), tuple(shape)]
    if tuple(rshape) not in allowed:
        want = " or ".join(str(s) for s in allowed)
        raise ValueError(f"`{name}` must have shape {want}, got shape {tuple(rshape)}")
    if is_concrete(rate):
        arr = np.asarray(rate)
        bad = np.nonzero(~((arr >= 0.0) & (arr <= 1.0)).reshape(-1))[0]
        if bad.size:
            where = f" at index {int(bad[0])}" if arr.ndim else ""
            raise ValueError(
                f"`{name}` must lie in [0, 1], got {float(arr.reshape(-1)[bad[0]])}{where}"
            )
    return rate


def is_zero_rate(rate: Any) -> bool:
    """True when the rate is concretely zero everywhere (no draw needed)."""
    if isinstance(rate, float):
        return rate == 0.0
    return is_concrete(rate) and bool(np.all(np.asarray(rate) == 0.0))
