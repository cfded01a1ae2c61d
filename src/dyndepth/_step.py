"""The static description of one loop (:class:`Loop`) and how a user's step becomes one.

A user's step function is *closure-converted*: traced once to a jaxpr whose inputs are the
values it closes over ("consts": parameters, and tracers of enclosing transformations), the
carry, the step's slice of ``xs`` and the step's key. The consts then enter the loop primitives
as ordinary operands, so that ``vmap`` sees which of them are batched and ``grad`` which of
them are perturbed; the jaxpr itself is a static parameter of the primitives.

Typed PRNG keys in the carry, ``xs`` or ``ys`` travel as their key data (``uint32``) and are
rewrapped for the user's function. Weak types follow ``lax.while_loop``: a weakly typed
``init`` leaf stays weak inside the step when the step returns its dtype (else it takes the
returned dtype); a step may return Python scalars and weakly typed values for the carry (cast
to its dtype when nothing is lost); the loop's outputs are weakly typed where the step's are.

Conversions of a function whose consts are all concrete arrays (an un-jitted call) are cached
on the function object, so that calling ``repeat`` again with the same function reuses the
compiled loop, as ``lax`` loops do.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal

from . import _vma
from ._checks import same_structure
from ._keys import KeySchedule, is_typed_key
from ._leaves import Leaves, merge, take


@dataclasses.dataclass(frozen=True, eq=False)
class Loop:
    """One loop, statically: step ``i`` of a sample runs while ``i < n`` (its depth, or
    ``max_steps``) and the stop predicate holds; the loop stops at the first step that does not
    run. Hashed by identity (it is a primitive parameter).

    ``step_jaxpr`` maps ``(consts, carry, x[, key])`` to ``(carry, y)`` (flat leaves); its first
    ``stacked`` consts are the slices, at the step's layer index ``x[0]``, of stacked operands
    (``dyndepth.nn.layer_drop``), so that the backward pass can reference a layer's slice
    instead of storing it. ``cond_jaxpr`` maps ``(cconsts, carry)`` to a boolean scalar.
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
    slots: int | tuple[int, ...] | None = None
    stacked: int = 0

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

    @property
    def segment(self) -> int:
        """Largest checkpoint spacing: the size of the backward pass's recompute buffer."""
        if not self.thinning:
            return 1
        s = 1
        while math.ceil(self.max_steps / s) > self.slots_stored:
            s *= 2
        return s


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
    """How the user's function is called: ``f(carry[, x][, key][, p])``, and what it returns
    (``carry`` alone, or ``(carry, y)``)."""

    with_x: bool
    with_key: bool
    with_stacked: bool
    returns_y: bool
    fname: str = "f"


def _call_user(kind: StepKind, fn: Callable, carry, x, key, p):
    args = [carry] + ([x] if kind.with_x else []) + ([key] if kind.with_key else [])
    args += [p] if kind.with_stacked else []
    out = fn(*args)
    if not kind.returns_y:
        return out, None
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TypeError(
            f"`{kind.fname}` must return a pair `(carry, y)`, got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
            + "; for no per-step output, return `(carry, None)`"
        )
    return out[0], out[1]


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
    if (not _vma.manual_axes() and isinstance(sharding, jax.sharding.NamedSharding)
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
) -> Traced:
    """Closure-convert the user's step (and stop predicate) into a :class:`Loop`.

    ``init`` is a pytree of arrays for one sample, ``xs`` one with a leading step axis,
    ``key_example`` an abstract key (None without a key) and ``stacked`` a pytree of stacked
    operands (or None)."""
    carry_leaves, carry_tree = jax.tree_util.tree_flatten(init)
    xs_leaves, xs_tree = jax.tree_util.tree_flatten(xs)
    stacked_leaves, stacked_tree = jax.tree_util.tree_flatten(stacked)
    carry_codec, x_codec = Codec.of(carry_leaves), Codec.of(xs_leaves)
    carry_enc = carry_codec.encode(carry_leaves)
    x_examples = [_example(a, True) for a in x_codec.encode(xs_leaves)]
    s_examples = [_example(a, True) for a in stacked_leaves]
    c_examples = [_example(a, False) for a in carry_enc]
    key_args = [] if key_example is None else [key_example]
    S, nc, nx = len(stacked_leaves), len(carry_enc), len(x_examples)
    seen: dict = {}

    def flat_step(*args):
        p_l, c_l, x_l = args[:S], args[S : S + nc], args[S + nc : S + nc + nx]
        key = args[S + nc + nx] if key_args else None
        carry = jax.tree_util.tree_unflatten(carry_tree, carry_codec.decode(c_l))
        x = jax.tree_util.tree_unflatten(xs_tree, x_codec.decode(x_l))
        p = jax.tree_util.tree_unflatten(stacked_tree, list(p_l)) if S else None
        new_carry, y = _call_user(kind, fn, carry, x, key, p)
        if seen.get("strong"):
            new_carry = _as_carry(carry, new_carry)
            same_structure(carry, new_carry, kind.fname, "carry")
        y_leaves, y_tree = jax.tree_util.tree_flatten(y)
        seen.update(y_tree=y_tree, y_codec=Codec.of(y_leaves))
        new_leaves = jax.tree_util.tree_leaves(new_carry)
        if len(new_leaves) == nc:
            new_leaves = carry_codec.encode(new_leaves)
        return new_leaves, seen["y_codec"].encode(y_leaves)

    # Inside shard_map, the step is traced on examples varying over the axes its operands vary
    # over; the kernels widen that by the axes of the consts and of the step's outputs.
    axes = _vma.state_axes_of([carry_enc, xs_leaves, stacked_leaves, key_example])

    def build():
        with _vma.loop_state_axes(axes):
            return traced_loop()

    def traced_loop():
        examples = c_examples
        if any(e.weak_type for e in examples):
            # lax's rule for a weakly typed init leaf: it stays weak (the step sees a weakly
            # typed carry) when the step returns its dtype, else it takes the dtype returned.
            new, _ = jax.eval_shape(flat_step, *s_examples, *examples, *x_examples, *key_args)
            if len(new) == nc:
                examples = [_promoted(e, n) for e, n in zip(examples, new, strict=True)]
        strong = tuple(_strong(e) for e in examples)
        seen["strong"] = True
        jaxpr, consts, (c_shape, y_shape) = closure_convert(
            flat_step, *s_examples, *examples, *x_examples, *key_args
        )
        cond_jaxpr, cconsts = None, []
        if cond_fn is not None:

            def flat_cond(*c_l):
                return cond_fn(jax.tree_util.tree_unflatten(carry_tree, carry_codec.decode(c_l)))

            cond_jaxpr, cconsts, c_out = closure_convert(flat_cond, *examples)
            _check_cond_output(c_out)
        loop = Loop(
            step_jaxpr=jaxpr,
            cond_jaxpr=cond_jaxpr,
            n_consts=S + len(consts),
            n_cconsts=len(cconsts),
            carry_avals=strong,
            x_avals=tuple(x_examples),
            y_avals=tuple(_strong(a) for a in y_shape),
            keys=keys,
            max_steps=max_steps,
            checkpoints=checkpoints,
            strategy=strategy,
            slots=slots,
            stacked=S,
        )
        # The loop's outputs are weakly typed where the step's are (as lax's loops return).
        weak = Weak(tuple(getattr(a, "weak_type", False) for a in c_shape),
                    tuple(getattr(a, "weak_type", False) for a in y_shape))  # fmt: skip
        return loop, consts, cconsts, seen["y_tree"], seen["y_codec"], weak

    cache_key = (
        kind, cond_fn, carry_tree, xs_tree, stacked_tree, carry_codec, x_codec, keys,
        tuple(map(_aval_key, c_examples + x_examples + s_examples + key_args)),
        max_steps, checkpoints, strategy, slots, _context(), axes,
    )  # fmt: skip
    loop, consts, cconsts, y_tree, y_codec, weak = _cached(fn, cache_key, build)
    init_leaves = [
        jnp.asarray(c).astype(a.dtype) for c, a in zip(carry_enc, loop.carry_avals, strict=True)
    ]
    return Traced(
        loop=loop,
        consts=list(stacked_leaves) + list(consts),
        cconsts=list(cconsts),
        init=init_leaves,
        xs=[jnp.asarray(a) for a in x_codec.encode(xs_leaves)],
        carry_tree=carry_tree,
        carry_codec=carry_codec,
        y_tree=y_tree,
        y_codec=y_codec,
        weak=weak,
    )


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
    return (jax.sharding.get_abstract_mesh(), jax.config.jax_enable_x64,
            jax.config.jax_numpy_dtype_promotion)  # fmt: skip


def _check_cond_output(c_out: Any) -> None:
    leaves = jax.tree_util.tree_leaves(c_out)
    if len(leaves) != 1 or leaves[0].shape != () or np.dtype(leaves[0].dtype) != np.bool_:
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in leaves) or "nothing"
        raise TypeError(
            f"`cond_fun` must return a boolean scalar, got {got}; under vmap, write it for one "
            "sample"
        )


# ----------------------------------------------------------------------------- derived loops


def perturbed_outputs(jaxpr: ClosedJaxpr, perturbed: Sequence[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on its perturbed inputs (a conservative forward data
    flow: an equation's floating outputs are perturbed when any of its inputs is, except
    through ``stop_gradient``). Integer and boolean outputs are never perturbed."""
    env: dict = {}
    for v, p in zip(jaxpr.jaxpr.invars, perturbed, strict=True):
        env[v] = bool(p)

    def read(v):
        return False if isinstance(v, Literal) else env.get(v, False)

    for eqn in jaxpr.jaxpr.eqns:
        hit = eqn.primitive.name != "stop_gradient" and any(read(v) for v in eqn.invars)
        for o in eqn.outvars:
            env[o] = hit and _is_float_aval(o.aval)
    return [read(v) and _is_float_aval(v.aval) for v in jaxpr.jaxpr.outvars]


def _is_float_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Perturbed:
    """Which leaves carry tangents: consts, carry (a fixpoint over the steps), xs and ys."""

    consts: tuple[bool, ...]
    carry: tuple[bool, ...]
    xs: tuple[bool, ...]
    ys: tuple[bool, ...]

    @property
    def any(self) -> bool:
        return any(self.carry) or any(self.ys)


def perturbation(loop: Loop, consts: Sequence[bool], init: Sequence[bool],
                 xs: Sequence[bool]) -> Perturbed:  # fmt: skip
    """Propagate perturbed inputs through the steps to a fixpoint on the carry."""
    consts = tuple(bool(c) and _is_float_aval(a) for c, a in
                   zip(consts, loop.step_jaxpr.in_avals, strict=False))  # fmt: skip
    carry = tuple(bool(c) and _is_float_aval(a) for c, a in
                  zip(init, loop.carry_avals, strict=True))  # fmt: skip
    xs = tuple(bool(c) and _is_float_aval(a) for c, a in zip(xs, loop.x_avals, strict=True))
    nk = 0 if loop.keys is None else 1
    nc = len(carry)
    while True:
        out = perturbed_outputs(loop.step_jaxpr, consts + carry + xs + (False,) * nk)
        new = tuple(a or b for a, b in zip(carry, out[:nc], strict=True))
        if new == carry:
            return Perturbed(consts, carry, xs, tuple(out[nc:]))
        carry = new


_JVP_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def jvp_loop(loop: Loop, pert: Perturbed) -> Loop:
    """The loop of ``(primal, tangent)`` pairs: consts, carry, xs and ys extended with the
    tangents of their perturbed leaves; its step is the ``jax.jvp`` of the original step."""
    table = _JVP_LOOPS.setdefault(loop, {})
    if pert in table:
        return table[pert]
    S, nk = loop.stacked, loop.n_consts
    const_avals = list(loop.step_jaxpr.in_avals[:nk])
    kp = list(pert.consts)
    order = const_order(loop, pert)
    t_avals = take(const_avals, kp)
    all_avals = const_avals + t_avals
    consts2 = [all_avals[j] for j in order]
    carry2 = list(loop.carry_avals) + take(loop.carry_avals, pert.carry)
    x2 = list(loop.x_avals) + take(loop.x_avals, pert.xs)
    nc, nx = len(loop.carry_avals), len(loop.x_avals)

    def step2(*args):
        ks = args[: len(consts2)]
        flat = [None] * len(all_avals)
        for pos, j in enumerate(order):
            flat[j] = ks[pos]
        base, tk = flat[:nk], flat[nk:]
        c2 = args[len(consts2) : len(consts2) + len(carry2)]
        rest = args[len(consts2) + len(carry2) :]
        x_2, key = rest[: len(x2)], (rest[len(x2)] if loop.keys is not None else None)
        c, tc, x, tx = c2[:nc], c2[nc:], x_2[:nx], x_2[nx:]

        def f(kd_, cd, xd):
            return loop.inner(
                merge(kd_, take(base, kp, False), kp),
                merge(cd, take(c, pert.carry, False), pert.carry),
                merge(xd, take(x, pert.xs, False), pert.xs),
                key,
            )

        primals = (take(base, kp), take(c, pert.carry), take(x, pert.xs))
        (c_new, y), (tc_new, ty) = jax.jvp(f, primals, (list(tk), list(tc), list(tx)))
        return list(c_new) + take(tc_new, pert.carry), list(y) + take(ty, pert.ys)

    key_args = [] if loop.keys is None else [loop.step_jaxpr.in_avals[-1]]
    jaxpr, consts, _ = closure_convert(step2, *consts2, *carry2, *x2, *key_args)
    assert not consts
    cond2 = None
    if loop.cond_jaxpr is not None:
        cj = loop.cond_jaxpr
        cond2, cc, _ = closure_convert(
            lambda *a: _vma.eval_jaxpr(cj.jaxpr, list(cj.consts), *a[: loop.n_cconsts + nc]),
            *cj.in_avals, *take(loop.carry_avals, pert.carry),
        )  # fmt: skip
        assert not cc
    derived = dataclasses.replace(
        loop,
        step_jaxpr=jaxpr,
        cond_jaxpr=cond2,
        n_consts=len(consts2),
        carry_avals=tuple(carry2),
        x_avals=tuple(x2),
        y_avals=tuple(loop.y_avals) + tuple(take(loop.y_avals, pert.ys)),
        stacked=S + sum(kp[:S]),
    )
    table[pert] = derived
    return derived


def const_order(loop: Loop, pert: Perturbed) -> list[int]:
    """The derived loop's consts as positions in ``consts + perturbed tangents``: stacked
    operands and their tangents first, so that the derived step slices both (see
    :func:`jvp_loop`)."""
    S, nk = loop.stacked, loop.n_consts
    tangent = {j: nk + r for r, j in enumerate(j for j in range(nk) if pert.consts[j])}
    order = list(range(S)) + [tangent[j] for j in range(S) if j in tangent]
    return order + list(range(S, nk)) + [tangent[j] for j in range(S, nk) if j in tangent]
