"""How a user's step function becomes a :class:`dyndepth._step.Loop` (:func:`trace_loop`).

The step is called as ``f([i, ]carry[, x][, p][, key])`` (:class:`StepKind`, :func:`call_step`)
on abstract examples of one sample and closure-converted
(:func:`dyndepth._step.closure_convert`).

Typed PRNG keys in the carry, ``xs`` or ``ys`` travel as their key data (``uint32``) and are
rewrapped for the user's function (:class:`Codec`). Weak types follow ``lax.while_loop``: a
weakly typed ``init`` leaf stays weak inside the step when the step returns its dtype (else it
takes the returned dtype); a step may return Python scalars and weakly typed values for the
carry (cast to its dtype when nothing is lost); the loop's outputs are weakly typed where the
step's are.

Conversions of a function whose consts are all concrete arrays (an un-jitted call) are cached
on the function object, so that calling ``repeat`` again with the same function reuses the
compiled loop, as ``lax`` loops do.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _budget, _compat, _sharding, _vma
from ._checks import same_structure
from ._keys import KeySchedule, is_typed_key
from ._leaves import Leaves
from ._step import Loop, closure_convert

# ----------------------------------------------------------------------------- key leaves


@dataclasses.dataclass(frozen=True)
class Codec:
    """Typed-key leaves of a pytree travel as key data: ``impls[j]`` is leaf ``j``'s key
    implementation, or None for an ordinary leaf."""

    impls: tuple[Any, ...]

    @staticmethod
    def of(leaves: Sequence[Any]) -> Codec:
        return Codec(tuple(jax.random.key_impl(x) if is_typed_key(x) else None for x in leaves))

    @property
    def trivial(self) -> bool:
        return all(i is None for i in self.impls)

    def encode(self, leaves: Sequence[Any]) -> Leaves:
        return [
            x if i is None else jax.random.key_data(x)
            for x, i in zip(leaves, self.impls, strict=True)
        ]

    def decode(self, leaves: Sequence[Any]) -> Leaves:
        return [
            x if i is None else jax.random.wrap_key_data(x, impl=i)
            for x, i in zip(leaves, self.impls, strict=True)
        ]


# ----------------------------------------------------------------------------- tracing a loop


@dataclasses.dataclass(frozen=True)
class StepKind:
    """How the user's function is called: ``f([i, ]carry[, x][, p][, key])``, and what it
    returns (``carry`` alone, or ``(carry, y)``). With ``with_index``, the loop's per-step input
    is the step index ``i`` (``(i, x)`` with ``with_x``). ``key_name`` is the loop argument
    that gives the key (``key`` or ``keys``), for the error of a step that does not take it.
    ``p``, a layer's slice of stacked parameters, is internal (``dyndepth.nn``) and comes
    without a key."""

    with_x: bool
    with_key: bool
    with_stacked: bool
    returns_y: bool
    fname: str = "f"
    with_index: bool = False
    key_name: str = "key"

    @property
    def loop_xs(self) -> bool:
        """Whether the loop has a per-step input (``x``, the step index, or both)."""
        return self.with_x or self.with_index


def _call_user(kind: StepKind, fn: Callable, carry, x, key, p):
    i = None
    if kind.with_index:
        i, x = x if kind.with_x else (x, None)
    names = ["i"] * kind.with_index + ["carry"] + ["x"] * kind.with_x + ["p"] * kind.with_stacked
    args = {"i": i, "carry": carry, "x": x, "p": p}
    out = call_step(fn, kind.fname, names, [args[n] for n in names],
                    key if kind.with_key else None, key_name=kind.key_name)  # fmt: skip
    if not kind.returns_y:
        return out, None
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError(
            f"`{kind.fname}` must return a pair `(carry, y)`, got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
            + "; for no per-step output, return `(carry, None)`"
        )
    return out[0], out[1]


def call_step(fn: Callable, fname: str, names: Sequence[str], args: Sequence[Any], key: Any,
              *, key_name: str = "key", index_hint: bool = True) -> Any:  # fmt: skip
    """``fn(*args, key)`` (``fn(*args)`` when ``key`` is None), the user's step called as the
    loop's arguments decide; ``names`` names ``args`` for the error message.

    A step whose ``key`` is keyword-only (``def f(carry, *, key=None)``, Equinox's convention)
    is called with ``key=key``. A step whose signature takes neither form raises a
    ``TypeError`` naming the expected call and the arguments that decide it (``key_name=``,
    ``with_index=``), instead of Python's count of positional arguments. The step is called
    positionally first; its signature is read only when that call fails with a ``TypeError``,
    and a ``TypeError`` raised inside the step (its arguments bind) propagates as it is.
    ``index_hint``: whether the loop takes ``with_index`` (the message then mentions it)."""
    full = [*args] if key is None else [*args, key]
    try:
        return fn(*full)
    except TypeError as error:
        if _binds(fn, full, {}) is not False:
            raise  # raised inside the step, or its signature cannot be read
        as_keyword = key is not None and _binds(fn, args, {"key": key})
        if not as_keyword:
            message = _signature_message(fn, fname, names, key, key_name, index_hint)
            raise TypeError(message) from error
    return fn(*args, key=key)


def _binds(fn: Callable, args: Sequence[Any], kwargs: dict) -> bool | None:
    """Whether ``fn``'s signature accepts ``fn(*args, **kwargs)``; None when it cannot be read."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _signature_message(fn: Callable, fname: str, names: Sequence[str], key: Any,
                       key_name: str, index_hint: bool) -> str:  # fmt: skip
    """The error for a step whose signature does not take the loop's call: the call expected,
    the loop arguments that decide it, and how to fix the step or the call."""
    expected = f"{fname}({', '.join([*names, 'key'] if key is not None else names)})"
    why = [f"`{key_name}=` is given" if key is not None else f"no `{key_name}=` is given"]
    if "i" in names:
        why.append("`with_index=True`")
    if key is not None:
        example = f"def {fname}({', '.join(names)}, *, key)"
        fix = (f"take the step's key last (positionally, or as a keyword-only `key`, Equinox's "
               f"convention: `{example}`), or leave out `{key_name}=`")  # fmt: skip
    else:
        fix = f"give the loop `{key_name}=` if the step takes a key last"
    if "i" in names:
        fix += ", and take the step index first or drop `with_index`"
    elif index_hint:
        fix += "; `with_index=True` passes the step index first"
    return (
        f"`{fname}` is called as `{expected}` because {' and '.join(why)}, but its signature is "
        f"`{fname}{inspect.signature(fn)}`: {fix}"
    )


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached(fn: Callable, key: tuple, build: Callable[[], tuple]) -> tuple:
    """``build()``, cached on ``fn`` under ``key`` when every const it returns is concrete."""
    try:
        table = _CACHE.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: no caching
        return build()
    hit = table.get(key)
    if hit is not None:
        return hit
    out = build()
    consts = out[1]
    if not any(isinstance(c, jax.core.Tracer) for c in consts):
        table[key] = out
    return out


def _example(x: Any, drop_lead: bool) -> Any:
    """An abstract example of one sample of ``x`` (typed with its sharding under an Explicit
    mesh outside ``shard_map``), keeping a weak type."""
    t = jax.typeof(x)
    shape = t.shape[1:] if drop_lead else t.shape
    sharding = getattr(t, "sharding", None)
    if (not _sharding.manual_axes() and isinstance(sharding, jax.sharding.NamedSharding)
            and not sharding.mesh.empty):  # fmt: skip
        if drop_lead:
            sharding = sharding.update(spec=tuple(sharding.spec)[1:])
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=sharding, weak_type=t.weak_type)
    return jax.ShapeDtypeStruct(shape, t.dtype, weak_type=t.weak_type)


def _strong(example: Any, dtype: Any = None) -> Any:
    """``example`` with a strong type (of ``dtype`` if given)."""
    return jax.ShapeDtypeStruct(
        example.shape,
        example.dtype if dtype is None else dtype,
        sharding=getattr(example, "sharding", None),
    )


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """The step's inputs for one sample, flattened: the trees, the key-leaf codecs, the leaves
    (key data for typed keys) and their abstract examples."""

    carry_tree: Any
    xs_tree: Any
    stacked_tree: Any
    carry_codec: Codec
    x_codec: Codec
    carry: list
    xs: list
    stacked: list
    c_examples: list
    x_examples: list
    s_examples: list
    key_args: list

    @staticmethod
    def of(init: Any, xs: Any, stacked: Any, key_example: Any) -> _Inputs:
        carry_leaves, carry_tree = jax.tree_util.tree_flatten(init)
        xs_leaves, xs_tree = jax.tree_util.tree_flatten(xs)
        stacked_leaves, stacked_tree = jax.tree_util.tree_flatten(stacked)
        carry_codec, x_codec = Codec.of(carry_leaves), Codec.of(xs_leaves)
        carry = carry_codec.encode(carry_leaves)
        return _Inputs(
            carry_tree, xs_tree, stacked_tree, carry_codec, x_codec, carry, xs_leaves,
            stacked_leaves, [_example(a, False) for a in carry],
            [_example(a, True) for a in x_codec.encode(xs_leaves)],
            [_example(a, True) for a in stacked_leaves],
            [] if key_example is None else [key_example],
        )  # fmt: skip

    def examples(self, carry_examples: Sequence[Any]) -> list:
        """The step's flat abstract arguments, with ``carry_examples`` for the carry."""
        return [*self.s_examples, *carry_examples, *self.x_examples, *self.key_args]


def _flat_step(kind: StepKind, fn: Callable, inputs: _Inputs) -> tuple[Callable, dict]:
    """The user's step on flat leaves, and what its tracing records (``seen``): the ys' tree
    and key codec, and (once ``seen["strong"]`` is set) the check of its returned carry."""
    S, nc, nx = len(inputs.stacked), len(inputs.carry), len(inputs.x_examples)
    seen: dict = {}

    def flat_step(*args):
        p_l, c_l, x_l = args[:S], args[S : S + nc], args[S + nc : S + nc + nx]
        key = args[S + nc + nx] if inputs.key_args else None
        carry = jax.tree_util.tree_unflatten(inputs.carry_tree, inputs.carry_codec.decode(c_l))
        x = jax.tree_util.tree_unflatten(inputs.xs_tree, inputs.x_codec.decode(x_l))
        p = jax.tree_util.tree_unflatten(inputs.stacked_tree, list(p_l)) if S else None
        new_carry, y = _call_user(kind, fn, carry, x, key, p)
        if seen.get("strong"):
            # Compared with a fresh copy of the input carry: the step may have consumed its own
            # (an Equinox `eqx.nn.State` refuses to be flattened once a new one is made from it).
            before = jax.tree_util.tree_unflatten(inputs.carry_tree, inputs.carry_codec.decode(c_l))
            new_carry = _as_carry(before, new_carry)
            same_structure(before, new_carry, kind.fname, "carry")
        y_leaves, y_tree = jax.tree_util.tree_flatten(y)
        seen.update(y_tree=y_tree, y_codec=Codec.of(y_leaves))
        new_leaves = jax.tree_util.tree_leaves(new_carry)
        if len(new_leaves) == nc:
            new_leaves = inputs.carry_codec.encode(new_leaves)
        return new_leaves, seen["y_codec"].encode(y_leaves)

    return flat_step, seen


def _carry_examples(flat_step: Callable, inputs: _Inputs) -> list:
    """The carry's examples. lax's rule for a weakly typed init leaf: it stays weak (the step
    sees a weakly typed carry) when the step returns its dtype, else it takes the dtype
    returned."""
    examples = inputs.c_examples
    if any(e.weak_type for e in examples):
        new, _ = jax.eval_shape(flat_step, *inputs.examples(examples))
        if len(new) == len(examples):
            examples = [_promoted(e, n) for e, n in zip(examples, new, strict=True)]
    return examples


def _build_loop(flat_step: Callable, seen: dict, cond_fn: Callable | None,
                priority_fn: Callable | None, inputs: _Inputs, options: dict) -> tuple:  # fmt: skip
    """Closure-convert the step and stop predicate (with the queue priority as its second
    output): ``(loop, consts, cconsts, y_tree, y_codec, weak)``."""
    examples = _carry_examples(flat_step, inputs)
    seen["strong"] = True
    jaxpr, consts, (c_shape, y_shape) = closure_convert(flat_step, *inputs.examples(examples))
    cond_jaxpr, cconsts = None, []
    if cond_fn is not None:

        def flat_cond(*c_l):
            carry = jax.tree_util.tree_unflatten(inputs.carry_tree, inputs.carry_codec.decode(c_l))
            if priority_fn is None:
                return cond_fn(carry)
            return cond_fn(carry), priority_fn(carry)

        cond_jaxpr, cconsts, c_out = closure_convert(flat_cond, *examples)
        cond_out = c_out if priority_fn is None else c_out[0]
        _check_scalar_output(cond_out, "cond_fun", "a boolean scalar", _is_bool)
        if priority_fn is not None:
            _check_scalar_output(c_out[1], "priority", "a real scalar (an int or float)", _is_real)
    S = len(inputs.stacked)
    loop = Loop(
        step_jaxpr=jaxpr, cond_jaxpr=cond_jaxpr, n_consts=S + len(consts),
        n_cconsts=len(cconsts), carry_avals=tuple(_strong(e) for e in examples),
        x_avals=tuple(inputs.x_examples), y_avals=tuple(_strong(a) for a in y_shape),
        stacked=S, priority=priority_fn is not None, **options,
    )  # fmt: skip
    # The loop's outputs are weakly typed where the step's are (as lax's loops return).
    weak = Weak(tuple(getattr(a, "weak_type", False) for a in c_shape),
                tuple(getattr(a, "weak_type", False) for a in y_shape))  # fmt: skip
    return loop, consts, cconsts, seen["y_tree"], seen["y_codec"], weak


def trace_loop(
    kind: StepKind,
    fn: Callable,
    cond_fn: Callable | None,
    init: Any,
    xs: Any,
    keys: KeySchedule | None,
    key_example: Any,
    stacked: Any,
    *,
    max_steps: int,
    checkpoints: int | None,
    strategy: str,
    slots: int | tuple[int, ...] | None,
    priority_fn: Callable | None = None,
) -> Traced:
    """Closure-convert the user's step (and stop predicate, and its queue priority) into a
    :class:`Loop`.

    ``init`` is a pytree of arrays for one sample, ``xs`` one with a leading step axis,
    ``key_example`` an abstract key (None without a key) and ``stacked`` a pytree of stacked
    operands (or None)."""
    inputs = _Inputs.of(init, xs, stacked, key_example)
    flat_step, seen = _flat_step(kind, fn, inputs)
    options = dict(keys=keys, max_steps=max_steps, checkpoints=checkpoints, strategy=strategy,
                   slots=slots, budget=_budget.stored_carry_budget())  # fmt: skip
    # Inside shard_map, the step is traced on examples varying over the axes its operands vary
    # over; the kernels widen that by the axes of the consts and of the step's outputs.
    axes = _vma.state_axes_of([inputs.carry, inputs.xs, inputs.stacked, key_example])

    def build():
        with _vma.loop_state_axes(axes):
            return _build_loop(flat_step, seen, cond_fn, priority_fn, inputs, options)

    cache_key = (
        kind, cond_fn, priority_fn, inputs.carry_tree, inputs.xs_tree, inputs.stacked_tree,
        inputs.carry_codec, inputs.x_codec, keys,
        tuple(map(_aval_key, inputs.c_examples + inputs.x_examples + inputs.s_examples
                  + inputs.key_args)),
        max_steps, checkpoints, strategy, slots, options["budget"], _context(), axes,
    )  # fmt: skip
    loop, consts, cconsts, y_tree, y_codec, weak = _cached(fn, cache_key, build)
    init_leaves = [jnp.asarray(c).astype(a.dtype)
                   for c, a in zip(inputs.carry, loop.carry_avals, strict=True)]  # fmt: skip
    return Traced(
        loop=loop, consts=list(inputs.stacked) + list(consts), cconsts=list(cconsts),
        init=init_leaves, xs=[jnp.asarray(a) for a in inputs.x_codec.encode(inputs.xs)],
        carry_tree=inputs.carry_tree, carry_codec=inputs.carry_codec, y_tree=y_tree,
        y_codec=y_codec, weak=weak,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Weak:
    """Which carry and ys outputs of the step are weakly typed (a Python scalar returned, or
    a weakly typed carry kept so): the loop returns them weakly typed too."""

    carry: tuple[bool, ...]
    ys: tuple[bool, ...]


def _weakly_typed(x: Any) -> Any:
    """``x`` with a weak type (``jax.lax.convert_element_type_p`` to its own dtype)."""
    if getattr(x, "weak_type", False) or is_typed_key(x):
        return x
    try:
        return jax.lax.convert_element_type_p.bind(
            x, new_dtype=jnp.dtype(x.dtype), weak_type=True, sharding=None
        )
    except TypeError:  # pragma: no cover - the primitive's parameters changed in this JAX
        return x


def _rewrap_weak(leaves: Sequence[Any], weak: tuple[bool, ...]) -> list:
    return [_weakly_typed(a) if w else a for a, w in zip(leaves, weak, strict=True)]


_KIND_RANK = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _promoted(example: Any, returned: Any) -> Any:
    """The carry example for an init leaf ``example`` whose step returns ``returned``.

    A strong leaf stays as it is; a weak one stays weak when the step returns its dtype (lax
    keeps such a carry weak), and otherwise takes the returned dtype, or its own when the step
    returns a weakly typed value of a lower kind (a Python int for a float carry)."""
    if not example.weak_type:
        return example
    if np.dtype(returned.dtype) == np.dtype(example.dtype):
        return example
    dtype = returned.dtype
    if getattr(returned, "weak_type", False) and _rank(example.dtype) > _rank(dtype):
        dtype = example.dtype
    return _strong(example, dtype)


def _rank(dtype: Any) -> int:
    return _KIND_RANK.get(np.dtype(dtype).kind, 4)


def _as_carry(carry: Any, new_carry: Any) -> Any:
    """The step's returned carry with Python scalars and weakly typed leaves cast to the
    carry's dtypes where that loses nothing (a weak int into a float carry; never a float
    into an int carry), as ``lax`` loops accept them; anything else is left for
    :func:`dyndepth._checks.same_structure` to report."""
    if jax.tree_util.tree_structure(carry) != jax.tree_util.tree_structure(new_carry):
        return new_carry
    leaves = jax.tree_util.tree_leaves(carry)
    out = jax.tree_util.tree_leaves(new_carry)
    return jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(carry),
        [_as_leaf(a, b) for a, b in zip(leaves, out, strict=True)],
    )


def _as_leaf(want: Any, got: Any) -> Any:
    if is_typed_key(want) or is_typed_key(got):
        return got
    if isinstance(got, bool | int | float | complex):
        got = jnp.asarray(got)  # weakly typed, as lax traces a returned Python scalar
    dtype = getattr(got, "dtype", None)
    if dtype is None or np.dtype(dtype) == np.dtype(want.dtype):
        return got
    if (getattr(got, "weak_type", False) and jnp.shape(got) == jnp.shape(want)
            and _rank(dtype) <= _rank(want.dtype)):  # fmt: skip
        return jax.lax.convert_element_type(got, want.dtype)
    return got


@dataclasses.dataclass
class Traced:
    """A traced loop with its operands: what the loop primitives take, and how to turn their
    outputs back into the user's pytrees."""

    loop: Loop
    consts: list
    cconsts: list
    init: list
    xs: list
    carry_tree: Any
    carry_codec: Codec
    y_tree: Any
    y_codec: Codec
    weak: Weak

    def carry_out(self, leaves: Sequence[Any]) -> Any:
        leaves = _rewrap_weak(leaves, self.weak.carry)
        return jax.tree_util.tree_unflatten(self.carry_tree, self.carry_codec.decode(leaves))

    def ys_out(self, leaves: Sequence[Any]) -> Any:
        leaves = _rewrap_weak(leaves, self.weak.ys)
        return jax.tree_util.tree_unflatten(self.y_tree, self.y_codec.decode(leaves))


def _aval_key(x: Any) -> Any:
    if x is None:
        return None
    return (tuple(x.shape), np.dtype(x.dtype) if not is_typed_key(x) else str(x.dtype),
            getattr(x, "weak_type", False), getattr(x, "sharding", None))  # fmt: skip


def _context() -> Any:
    """What a traced step depends on besides its inputs: the mesh and every configuration
    option JAX keys its own traces on (x64, dtype and rank promotion, the default matmul
    precision, ...): a step traced under one is not reused under another."""
    return (jax.sharding.get_abstract_mesh(), _compat.trace_context())


def _check_scalar_output(out: Any, name: str, kind: str, dtype_ok: Callable) -> None:
    """Raise unless the function ``name`` returned one scalar whose dtype ``dtype_ok`` accepts
    (``kind`` says which, in the message)."""
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != 1 or leaves[0].shape != () or not dtype_ok(leaves[0].dtype):
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in leaves) or "nothing"
        raise TypeError(
            f"`{name}` must return {kind}, got {got}; under vmap, write it for one sample"
        )


def _is_bool(dtype: Any) -> bool:
    return np.dtype(dtype) == np.bool_


def _is_real(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
