"""The per-step key schedule.

Every loop in dyndepth that takes a ``key`` gives step ``i`` the key ``step_key(key, i)``, which is
``jax.random.fold_in(key, i)``. The schedule depends on nothing but the key and the step index: not
on ``max_depth``, the strategy, the checkpointing, the batch or the scheduler. A sample that runs
for ``d`` steps therefore sees the same keys whether it runs alone, in a vmapped batch, or in a
slot of the per-sample scheduler, and the keys it would have seen at steps ``>= d`` are never
drawn.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["step_key"]


def is_typed_key(key: Any) -> bool:
    """True for a new-style typed key array (``jax.random.key``)."""
    dtype = getattr(key, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def check_key(key: Any, name: str = "key") -> None:
    """Raise a TypeError unless ``key`` is one PRNG key: typed, or a raw ``uint32[2]``."""
    if is_typed_key(key):
        if key.shape != ():
            raise TypeError(
                f"`{name}` must be a single PRNG key (shape ()), got a key array of shape "
                f"{key.shape}; under vmap, pass a batch of keys and map over it."
            )
        return
    dtype = getattr(key, "dtype", None)
    shape = getattr(key, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(
            f"`{name}` must be a PRNG key from jax.random.key or jax.random.PRNGKey, "
            f"got {type(key).__name__}: {key!r}"
        )
    if np.dtype(dtype) != np.uint32 or tuple(shape) != (2,):
        raise TypeError(
            f"`{name}` must be a PRNG key from jax.random.key or jax.random.PRNGKey: a typed "
            f"key or a uint32 array of shape (2,); got dtype {dtype} and shape {tuple(shape)}"
        )


def step_key(key: Any, i: Any) -> Any:
    """The key for step ``i`` of a loop driven by ``key``.

    Defined as ``jax.random.fold_in(key, i)``. ``key`` may be a typed key (``jax.random.key``) or a
    raw ``uint32[2]`` key (``jax.random.PRNGKey``); the result is of the same kind. ``i`` is a
    Python int or an integer scalar array (it may be traced).

    **Transformations:** jit, vmap (over ``key`` and/or ``i``); keys carry no gradient.

    **Raises:** ``TypeError`` if ``key`` is not a PRNG key.

    Example::

        k3 = dyndepth.step_key(key, 3)  # what step 3 of repeat(f, x, d, key=key, ...) receives
    """
    check_key(key)
    return jax.random.fold_in(key, i)


class KeySchedule:
    """Carries a loop's key through custom_vjp/custom_vmap boundaries as plain ``uint32`` data.

    Typed keys are unwrapped with ``jax.random.key_data`` and rewrapped with their implementation
    inside the loop, so the loop internals only ever see integer arrays (which have no tangent
    and batch like any other array).
    """

    def __init__(self, key: Any):
        self.typed = is_typed_key(key)
        self.impl = jax.random.key_impl(key) if self.typed else None
        self.data = jax.random.key_data(key) if self.typed else jnp.asarray(key)

    def key_at(self, data: jax.Array, i: jax.Array) -> Any:
        """The key of step ``i``, from the key data of one sample."""
        if self.typed:
            return jax.random.fold_in(jax.random.wrap_key_data(data, impl=self.impl), i)
        return jax.random.fold_in(data, i)
