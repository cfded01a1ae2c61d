"""The per-step key schedule.

Every loop in dyndepth that takes a ``key`` gives step ``i`` the key ``step_key(key, i)``, which is
``jax.random.fold_in(key, i)``. The schedule depends on nothing but the key and the step index: not
on ``max_depth``, the strategy, the checkpointing, the batch or the scheduler. A sample that runs
for ``d`` steps therefore sees the same keys whether it runs alone, in a vmapped batch, or in a
slot of the per-sample scheduler, and the keys it would have seen at steps ``>= d`` are never
drawn.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat

__all__ = ["step_key"]


def is_typed_key(key: Any) -> bool:
    """True for a new-style typed key array (``jax.random.key``)."""
    dtype = getattr(key, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _raw_key_shape() -> tuple[int, ...]:
    """The shape of a raw key (``jax.random.PRNGKey``) under the default PRNG implementation:
    (2,) for threefry, (4,) for rbg and unsafe_rbg."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def check_key(key: Any, name: str = "key") -> None:
    """Raise a TypeError unless ``key`` is one PRNG key: typed, or raw ``uint32`` data of the
    default implementation's shape."""
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
    raw = _raw_key_shape()
    if np.dtype(dtype) != np.uint32 or tuple(shape) != raw:
        raise TypeError(
            f"`{name}` must be a PRNG key from jax.random.key or jax.random.PRNGKey: a typed "
            f"key or a uint32 array of shape {raw} (the default PRNG implementation's); got "
            f"dtype {dtype} and shape {tuple(shape)}"
        )


def _check_index(i: Any) -> None:
    if isinstance(i, bool | np.bool_):
        raise TypeError(f"`i` must be a non-negative integer step index, got bool: {i!r}")
    if isinstance(i, int | np.integer):
        if int(i) < 0 or int(i) > 2**32 - 1:
            raise ValueError(f"`i` must be a step index in [0, 2**32 - 1], got {int(i)}")
        return
    dtype = getattr(i, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or np.dtype(dtype) == np.bool_:
        raise TypeError(
            f"`i` must be a non-negative integer step index (Python int or integer array), got "
            f"{type(i).__name__}: {i!r}"
        )
    if not isinstance(i, jax.core.Tracer) and np.any(np.asarray(i) < 0):
        raise ValueError(f"`i` must be a non-negative step index, got {np.asarray(i)}")


def step_key(key: Any, i: Any) -> Any:
    """The key for step ``i`` of a loop driven by ``key``.

    Defined as ``jax.random.fold_in(key, i)``. ``key`` may be a typed key (``jax.random.key``) or a
    raw ``uint32[2]`` key (``jax.random.PRNGKey``); the result is of the same kind. ``i`` is a
    Python int or an integer scalar array (it may be traced).

    **Transformations:** jit, vmap (over ``key`` and/or ``i``); keys carry no gradient.

    **Raises:** ``TypeError`` if ``key`` is not a PRNG key or ``i`` is not an integer;
    ``ValueError`` for a concrete negative ``i``.

    Example::

        k3 = dyndepth.step_key(key, 3)  # what step 3 of repeat(f, x, d, key=key, ...) receives
    """
    check_key(key)
    _check_index(i)
    return jax.random.fold_in(key, i)


# Key implementations whose draws under ``jax.vmap`` are each sample's own: vmap of
# ``random_bits`` over a batch of threefry keys draws with every key. JAX batches the ``rbg`` and
# ``unsafe_rbg`` generators (``lax.rng_bit_generator``) with the batch's first key for every
# sample, so a sample's draws would depend on its neighbours; a user's own implementation is
# not known to batch per sample either.
_BATCHES_PER_SAMPLE = frozenset({"threefry2x32"})


@dataclasses.dataclass(frozen=True)
class KeySchedule:
    """How a loop's key travels through the loop internals: as plain ``uint32`` key data (which
    has no tangent and batches like any other array), rewrapped with its implementation when a
    step draws its key. ``impl`` is None for raw keys (``jax.random.PRNGKey``); ``name`` is the
    implementation's name (the default implementation's for raw keys)."""

    impl: Any = None
    name: str = "threefry2x32"

    @staticmethod
    def of(key: Any) -> KeySchedule:
        if is_typed_key(key):
            impl = jax.random.key_impl(key)
            return KeySchedule(impl, str(impl))
        return KeySchedule(None, str(jax.config.jax_default_prng_impl))

    @property
    def batches_per_sample(self) -> bool:
        """Whether a step vmapped over rows draws each row's numbers from that row's key alone
        (see ``_BATCHES_PER_SAMPLE``). When not, a batched loop runs its samples one after
        another (:mod:`dyndepth._primitives`), or refuses (``strategy="masked"``)."""
        return self.name in _BATCHES_PER_SAMPLE

    def data(self, key: Any) -> jax.Array:
        """The key data of ``key`` (any batch shape)."""
        return jax.random.key_data(key) if self.impl is not None else jnp.asarray(key)

    def key_at(self, data: jax.Array, i: jax.Array) -> Any:
        """The key of step ``i``, from the key data of one sample."""
        if self.impl is not None:
            return jax.random.fold_in(jax.random.wrap_key_data(data, impl=self.impl), i)
        return jax.random.fold_in(data, i)


# ----------------------------------------------------------------------------- draws under vmap

_DRAWS = frozenset({"random_bits", "random_split", "random_fold_in"})


def _impl_name(aval: Any) -> str:
    dtype = getattr(aval, "dtype", None)
    impl = getattr(dtype, "_impl", None)
    return str(getattr(impl, "name", dtype))


def _draw_impl(eqn: Any) -> str | None:
    """The key implementation an equation draws with, if it is one that a ``vmap`` batches
    from one key (see ``_BATCHES_PER_SAMPLE``); else None."""
    name = eqn.primitive.name
    if name == "rng_bit_generator":
        return "rng_bit_generator"
    if name in _DRAWS:
        impl = _impl_name(eqn.invars[0].aval)
        return None if impl in _BATCHES_PER_SAMPLE else impl
    return None


def mixed_draws(jaxpr: Any) -> tuple[str | None, list[bool]]:
    """``(impl, reaches)``: the first key implementation ``jaxpr`` draws with whose draws a
    ``vmap`` would mix between samples (None if none), and for each input whether it reaches
    such a draw (conservatively: every input of an equation whose inner jaxprs draw so)."""
    found: str | None = None
    needed: set = set()
    for eqn in reversed(jaxpr.eqns):
        impl = _draw_impl(eqn)
        if impl is None:
            for sub in _compat.jaxprs_in_params(eqn.params):
                impl = impl or mixed_draws(sub)[0]
        if impl is not None:
            found = impl
            needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
        elif any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, jax.extend.core.Literal))
    return found, [v in needed for v in jaxpr.invars]


_refuse_p = Primitive("dyndepth_unbatched_draws")


def refuse_batched(x: jax.Array, impl: str, strategy: str) -> jax.Array:
    """``x`` itself; batching it raises (at trace time). A ``strategy="masked"`` loop is plain
    ``lax``, batched by ``vmap`` as a whole, so a batched value reaching a draw of ``impl``
    would mix the samples' draws."""
    return _refuse_p.bind(x, impl=impl, strategy=strategy)


def _refuse_batch(args, dims, *, impl, strategy):
    raise ValueError(
        f"a key of implementation {impl!r} batched under jax.vmap (one key per sample) with "
        f"strategy={strategy!r}: JAX draws {impl!r} numbers for a whole vmapped batch from its "
        "first key, so a sample's draws would depend on its batch neighbours, against the key "
        "schedule (step i of a sample draws from fold_in(key, i), whatever the batch). Use "
        "strategy='auto', 'checkpointed' or 'while' (they run such a batch one sample after "
        "another), or threefry keys (jax.random.key(seed, impl='threefry2x32'))"
    )


_refuse_p.def_impl(lambda x, **_: x)
_refuse_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(_refuse_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))
batching.primitive_batchers[_refuse_p] = _refuse_batch
ad.deflinear(_refuse_p, lambda ct, **params: [ct])  # (a float operand feeding a draw)
