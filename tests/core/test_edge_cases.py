"""What a demanding user tried: callbacks in the step, typed keys in the carry, collectives over
the ``vmap`` axis, higher-order differentiation, empty carries and batches, ``jax.export`` with a
symbolic batch, weak types, eager calls, NumPy inputs. Each case is checked against a
plain-Python loop or ``lax``, or must raise an error that names the cause and the fix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import reference_repeat, reference_while, tree_allclose
from jax import lax
from shared_lists import CHECKPOINTING_STRATEGIES, GRAD_STRATEGIES, STRATEGIES

import dyndepth as dd

W = jnp.array([[0.5, -0.3, 0.1], [0.2, 0.8, -0.4], [-0.1, 0.3, 0.6]], jnp.float32)
X = jnp.array([0.3, -0.2, 0.5], jnp.float32)
XB = jnp.stack([X, -X, 2 * X, X + 1])
DEPTHS = jnp.array([0, 2, 3, 1], jnp.int32)


def layer(c):
    return jnp.tanh(c @ W)


# ----------------------------------------------------------------------------- callbacks


def _host_add_one(a):
    return np.asarray(a) + np.float32(1.0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pure_and_io_callbacks_run_forward_only(strategy):
    """A step with a callback has no JVP; the forward pass must not need one."""

    def pure(c):
        out = jax.pure_callback(
            _host_add_one, jax.ShapeDtypeStruct(c.shape, c.dtype), c, vmap_method="sequential"
        )
        return out * 0.5

    def io(c):
        out = jax.experimental.io_callback(_host_add_one, jax.ShapeDtypeStruct(c.shape, c.dtype), c)
        return out * 0.5

    for step in (pure, io):
        got = jax.jit(lambda x, s=step: dd.repeat(s, x, 3, max_depth=4, strategy=strategy))(X)
        tree_allclose(got, reference_repeat(lambda c: (c + 1.0) * 0.5, X, 3))
    got = jax.vmap(lambda x, d: dd.repeat(pure, x, d, max_depth=4, strategy=strategy))(XB, DEPTHS)
    want = jnp.stack([reference_repeat(lambda c: (c + 1.0) * 0.5, x, int(d))
                      for x, d in zip(XB, DEPTHS, strict=True)])  # fmt: skip
    tree_allclose(got, want)


@pytest.mark.parametrize("strategy", GRAD_STRATEGIES)
def test_unperturbed_values_are_not_differentiated(strategy):
    """An op without a reverse rule (an inner while loop, a callback) applied to values nothing
    differentiates: the gradient is right, as with lax.scan (only perturbed values are
    differentiated)."""
    inner = lax.while_loop(lambda v: v < 2.0, lambda v: v + 0.5, jnp.float32(0.3))

    def body(x):
        w = lax.while_loop(lambda v: v < 2.0, lambda v: v + 0.5, jnp.float32(0.3))
        c = jax.pure_callback(lambda: np.float32(0.5), jax.ShapeDtypeStruct((), jnp.float32))
        return x * jnp.cos(w) + c

    got = jax.grad(lambda x: dd.repeat(body, x, 4, max_depth=4, strategy=strategy))(1.0)
    tree_allclose(got, jnp.cos(inner) ** 4)


# ----------------------------------------------------------------------------- keys


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_typed_key_in_the_carry(strategy):
    def step(c):
        key, x = c
        key, sub = jax.random.split(key)
        return key, x + jax.random.normal(sub, x.shape)

    init = (jax.random.key(0), X)
    got = jax.jit(lambda c: dd.repeat(step, c, 3, max_depth=4, strategy=strategy))(init)
    want = reference_repeat(step, init, 3)
    tree_allclose(got, want)
    keys = jax.random.split(jax.random.key(1), 4)
    got = jax.vmap(lambda k, x, d: dd.repeat(step, (k, x), d, max_depth=4, strategy=strategy))(
        keys, XB, DEPTHS
    )
    want = [reference_repeat(step, (k, x), int(d)) for k, x, d in zip(keys, XB, DEPTHS,
                                                                       strict=True)]  # fmt: skip
    tree_allclose(got, jax.tree_util.tree_map(lambda *r: jnp.stack(r), *want))
    if strategy != "while":
        g = jax.grad(lambda x: jnp.sum(dd.repeat(step, (jax.random.key(0), x), 3, max_depth=4,
                                                 strategy=strategy)[1]))(X)  # fmt: skip
        tree_allclose(g, jnp.ones(3))


def test_raw_keys_of_the_default_implementation_are_accepted():
    """With the rbg PRNG implementation as default, PRNGKey gives uint32[4] keys."""
    jax.config.update("jax_default_prng_impl", "rbg")
    try:
        key = jax.random.PRNGKey(0)
        assert key.shape == (4,)
        step = lambda c, k: c + jax.random.normal(k, c.shape)  # noqa: E731
        got = dd.repeat(step, X, 2, max_depth=3, key=key)
        tree_allclose(got, reference_repeat(step, X, 2, key=key))
        tree_allclose(dd.step_key(key, 1), jax.random.fold_in(key, 1))
    finally:
        jax.config.update("jax_default_prng_impl", "threefry2x32")
    with pytest.raises(TypeError, match=r"uint32 array of shape \(2,\)"):
        dd.repeat(step, X, 2, max_depth=3, key=jnp.zeros((4,), jnp.uint32))


@pytest.mark.parametrize("i", [-1, 1.5, True, jnp.float32(2.0)])
def test_step_key_rejects_bad_indices(i):
    exc = ValueError if i == -1 else TypeError
    with pytest.raises(exc, match="`i` must be"):
        dd.step_key(jax.random.PRNGKey(0), i)


# ----------------------------------------------------------------------------- the vmap axis


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_over_the_vmap_axis_in_the_step(strategy):
    """pmean and axis_index over the enclosing vmap's axis: every sample steps in lockstep (as
    lax.while_loop and scan + cond under vmap do); values and gradients equal "masked"."""

    def step(c):
        return c - 0.5 * lax.pmean(c, "b") + 0.1 * lax.axis_index("b").astype(c.dtype)

    def run(s):
        f = lambda x, d: dd.repeat(step, x, d, max_depth=4, strategy=s)  # noqa: E731
        return jax.vmap(f, axis_name="b")

    tree_allclose(run(strategy)(XB, DEPTHS), run("masked")(XB, DEPTHS))
    if strategy != "while":
        loss = lambda s: lambda x: jnp.sum(run(s)(x, DEPTHS) ** 2)  # noqa: E731
        tree_allclose(jax.grad(loss(strategy))(XB), jax.grad(loss("masked"))(XB))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collective_in_the_stop_predicate(strategy):
    cond = lambda s: lax.pmax(s[1], "b") < 3  # noqa: E731
    body = lambda s: (layer(s[0]), s[1] + 1)  # noqa: E731
    f = lambda x, i: dd.while_loop(cond, body, (x, i), max_steps=5, strategy=strategy)  # noqa: E731
    got = jax.vmap(f, axis_name="b")(XB, jnp.array([0, 1, 2, 0], jnp.int32))
    # The largest counter reaches 3 after one step: every sample takes exactly one step.
    tree_allclose(got[0], jax.vmap(layer)(XB))


# ----------------------------------------------------------------------------- higher order


@pytest.mark.parametrize("strategy", CHECKPOINTING_STRATEGIES)
def test_forward_mode_of_the_reverse_mode_strategies(strategy):
    f = lambda a: dd.repeat(lambda c: jnp.sin(c) * a, X, 3, max_depth=4, strategy=strategy)  # noqa: E731
    ref = lambda a: reference_repeat(lambda c: jnp.sin(c) * a, X, 3)  # noqa: E731
    tree_allclose(jax.jvp(f, (0.7,), (1.0,)), jax.jvp(ref, (0.7,), (1.0,)))
    tree_allclose(jax.jacfwd(f)(0.7), jax.jacfwd(ref)(0.7))


@pytest.mark.parametrize("strategy", CHECKPOINTING_STRATEGIES)
def test_second_order(strategy):
    """Forward over reverse (hessian, jacfwd of grad), reverse over forward and reverse over
    reverse work, unbatched and under vmap (tests/core/test_reverse_over_reverse.py has the
    rest)."""

    def f(a, x=X, d=3):
        out = dd.repeat(lambda c: jnp.sin(c) * a, x, d, max_depth=4, strategy=strategy)
        return jnp.sum(out)

    def ref(a, x=X, d=3):
        return jnp.sum(reference_repeat(lambda c: jnp.sin(c) * a, x, d))

    tree_allclose(jax.hessian(f)(0.7), jax.hessian(ref)(0.7), rtol=1e-4, atol=1e-4)
    tree_allclose(jax.jacfwd(jax.grad(f))(0.7), jax.jacfwd(jax.grad(ref))(0.7), rtol=1e-4)
    rof = lambda g: jax.grad(lambda a: jax.jvp(g, (a,), (1.0,))[1])  # noqa: E731
    tree_allclose(rof(f)(0.7), rof(ref)(0.7), rtol=1e-4, atol=1e-4)
    batched = lambda a: jax.vmap(lambda x, d: f(a, x, d))(XB, DEPTHS).sum()  # noqa: E731
    batched_ref = lambda a: sum(ref(a, x, int(d)) for x, d in zip(XB, DEPTHS, strict=True))  # noqa: E731
    tree_allclose(jax.hessian(batched)(0.7), jax.hessian(batched_ref)(0.7), rtol=1e-4, atol=1e-4)
    tree_allclose(jax.grad(jax.grad(f))(0.7), jax.grad(jax.grad(ref))(0.7), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- empty things


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("carry", [None, (), {}], ids=["None", "tuple", "dict"])
def test_empty_carries(strategy, carry):
    f = lambda d: dd.repeat(lambda c: c, carry, d, max_depth=3, strategy=strategy)  # noqa: E731
    assert f(2) == carry
    assert jax.vmap(f)(DEPTHS) == carry
    out = dd.while_loop(lambda c: True, lambda c: c, carry, max_steps=2, strategy=strategy,
                        return_steps=True)  # fmt: skip
    assert out[0] == carry and int(out[1]) == 2


def test_empty_batches():
    f = lambda c: c + 1.0  # noqa: E731
    empty = jnp.zeros((0, 3))
    got = dd.repeat_batched(f, empty, jnp.zeros((0,), jnp.int32), max_depth=3)
    assert got.shape == (0, 3)
    got = jax.vmap(lambda x, d: dd.repeat(f, x, d, max_depth=3))(empty, jnp.zeros((0,), jnp.int32))
    assert got.shape == (0, 3)


# ----------------------------------------------------------------------------- types, caching


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_weakly_typed_init_follows_lax(strategy):
    cond, body = (lambda v: v < 2), (lambda v: v + jnp.int8(1))
    got = dd.while_loop(cond, body, 0, max_steps=5, strategy=strategy)
    want = lax.while_loop(cond, body, 0)
    assert got.dtype == want.dtype == jnp.int8 and int(got) == int(want)
    got = dd.repeat(lambda c: c * jnp.float16(2), 1.0, 3, max_depth=4, strategy=strategy)
    assert got.dtype == jnp.float16 and float(got) == 8.0


def test_eager_calls_with_the_same_step_do_not_compile_again():
    counts = []

    def step(c):
        counts.append(1)  # runs once per trace
        return jnp.tanh(c @ W)

    for _ in range(3):
        dd.repeat(step, X, 2, max_depth=4)
        dd.repeat(step, X + 1.0, 3, max_depth=4)
    assert len(counts) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_nested_loops_under_eager_vmap_over_numpy(strategy):
    xs = np.asarray(XB)

    def inner(c):
        return dd.repeat(layer, c, 2, max_depth=2, strategy=strategy)

    got = jax.vmap(lambda x: dd.repeat(inner, x, 2, max_depth=2, strategy=strategy))(xs)
    tree_allclose(got, jax.vmap(lambda x: reference_repeat(layer, x, 4))(XB))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_with_a_symbolic_batch(strategy):
    def f(x, d):
        return jax.vmap(lambda x, d: dd.repeat(layer, x, d, max_depth=4, strategy=strategy))(x, d)

    b = jax.export.symbolic_shape("b")[0]
    avals = (jax.ShapeDtypeStruct((b, 3), jnp.float32), jax.ShapeDtypeStruct((b,), jnp.int32))
    exported = jax.export.export(jax.jit(f))(*avals)
    want = jnp.stack([reference_repeat(layer, x, int(d)) for x, d in zip(XB, DEPTHS, strict=True)])
    tree_allclose(exported.call(XB, DEPTHS), want)
    if strategy != "while":
        g = lambda x, d: jax.grad(lambda x: jnp.sum(f(x, d) ** 2))(x)  # noqa: E731
        exported = jax.export.export(jax.jit(g))(*avals)
        tree_allclose(exported.call(XB, DEPTHS), jax.jit(g)(XB, DEPTHS))


# ----------------------------------------------------------------------------- errors


def test_argument_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"`f` must return a pair `\(carry, y\)`"):
        dd.scan(lambda c, x: c, X, None, depth=1, length=2)
    with pytest.raises(TypeError, match="`checked` must be a static Python bool"):
        dd.repeat(layer, X, 1, max_depth=3, checked="yes")
    with pytest.raises(ValueError, match="`checkpoints`=2 applies to strategy"):
        dd.repeat(layer, X, 1, max_depth=3, checkpoints=2, strategy="masked")
    with pytest.raises(ValueError, match="`slots`=2 sets the per-sample scheduler"):
        dd.repeat(layer, X, 1, max_depth=3, slots=2, strategy="checkpointed")
    with pytest.raises(ValueError, match=r"`slots` must name at least one slot count, got \(\)"):
        dd.repeat(layer, X, 1, max_depth=3, slots=())
    with pytest.raises(ValueError, match=r"`slots\[1\]` must be >= 1, got 0"):
        dd.repeat_batched(layer, XB, DEPTHS, max_depth=3, slots=[4, 0])
    with pytest.raises(TypeError, match=r"`slots\[0\]` must be a static Python int"):
        dd.while_loop(lambda c: True, layer, X, max_steps=2, slots=(2.0,))
    with pytest.raises(TypeError, match="`return_steps` must be a static Python bool"):
        dd.while_loop(lambda c: True, layer, X, max_steps=2, return_steps=1)


def test_while_loop_step_evaluations_match_its_docstring():
    """``checkpoints=None``: forward + backward evaluate the step ``steps`` times unbatched
    (stored residuals) and ``2 * steps`` under vmap."""
    from helpers import Counter

    counter = Counter()

    def body(c):
        counter.tick()
        return layer(c)

    cond = lambda c: jnp.sum(c) < 10.0  # noqa: E731
    steps = reference_while(cond, layer, X, 5)[1]
    loss = lambda x: jnp.sum(dd.while_loop(cond, body, x, max_steps=5))  # noqa: E731
    assert counter.run(jax.jit(jax.grad(loss)), X) == steps
    vloss = lambda xs: jnp.sum(jax.vmap(lambda x: dd.while_loop(cond, body, x, max_steps=5))(xs))  # noqa: E731
    assert counter.run(jax.jit(jax.grad(vloss)), X[None]) == 2 * steps


@pytest.mark.parametrize("length", [100, 4096, 10**5, 10**6])
def test_fewest_held_is_the_least_memory(length):
    from dyndepth._budget import fewest_held, recompute_slots

    k = fewest_held(length)
    # The fewest carries held (checkpoints and recompute buffers), by brute force.
    held = {}
    for e in range(length.bit_length() + 1):
        checkpoints = -(-length // 2**e)
        held.setdefault(checkpoints, checkpoints + sum(recompute_slots(2**e)))
    assert held[k] == min(held.values()) and k == max(c for c, h in held.items() if h == held[k])
    assert held[k] <= 4 * round(length ** (1 / 3)) + 4


def _traced_loop(width: int, matmuls: int, max_depth: int, slots=None):
    """The Loop dyndepth traces for a step of ``matmuls`` (width x width) products on a
    (width,) float32 carry."""
    from dyndepth._trace import StepKind, trace_loop

    W = jnp.eye(width)

    def step(c):
        for _ in range(matmuls):
            c = jnp.tanh(c @ W)
        return c

    kind = StepKind(with_x=False, with_key=False, with_stacked=False, returns_y=False)
    traced = trace_loop(
        kind, step, None, jnp.zeros(width), None, None, None, None,
        max_steps=max_depth, checkpoints=None, strategy="auto", slots=slots,
    )  # fmt: skip
    return traced.loop


@pytest.mark.parametrize(
    ("width", "matmuls", "rows", "max_depth", "platform"),
    [(16, 1, 64, 100, "cpu"), (16, 1, 4096, 10**5, "cpu"), (16, 1, 4096, 10**5, "gpu"),
     (2048, 8, 64, 1024, "cpu"), (2048, 8, 4096, 4096, "gpu"), (2048, 1, 1, 30, "cpu"),
     (16, 1, 4096, 2000, "tpu"), (16, 1, 64, 1000, "tpu"), (2048, 8, 4096, 4096, "tpu")],
)  # fmt: skip
def test_checkpoints_use_the_budget(width, matmuls, rows, max_depth, platform):
    """``checkpoints=None`` stores every carry while two copies fit the budget, else as many
    as fit (at least the fewest-memory count), and where writing a carry costs more than
    recomputing it at most SMALL_STORE; the stored bytes stay within the budget."""
    from conftest import TEST_COST

    from dyndepth import _budget

    loop = _traced_loop(width, matmuls, max_depth)
    dd.set_iteration_cost("cpu", None)  # (the suite's own cost counts every step as free)
    try:
        k = _budget.checkpoints_for(loop, rows, platform)
        cheap = _budget._recompute_is_cheaper(loop, width * 4, platform)
    finally:
        dd.set_iteration_cost("cpu", TEST_COST)
    carry = width * 4
    fits = _budget.DEFAULT_BUDGET // (2 * rows * _budget.stored_bytes(loop, rows, platform))
    bound = min(fits, _budget.SMALL_STORE) if cheap else fits
    if max_depth <= bound:
        assert k is None
    else:
        assert k == max(bound, _budget.fewest_held(max_depth))
        if bound >= _budget.fewest_held(max_depth):
            assert 2 * rows * k * carry <= _budget.DEFAULT_BUDGET
    # a tiny step on the CPU: recomputing is the cheaper; the GPU's memory is written at speed
    assert cheap == (platform == "cpu" and matmuls == 1 and width == 16)


def test_the_budget_counts_a_tpu_store_padded_to_the_lanes():
    """On a TPU, a loop that may run scheduled counts each carry's last dimension padded to
    the 128 lanes (16 floats take 512 bytes: the TPU compiler may lay a wrap-around pass's
    store out so); a loop that runs in lockstep there (a tiny step, whose rows' moves cost more
    than any count saves, or rows that share their depth), or any loop elsewhere, counts it as
    it is."""
    from dyndepth import _budget, _slots

    tiny, given = _traced_loop(16, 1, 1000), _traced_loop(16, 1, 1000, slots=32)
    wide = _traced_loop(256, 1, 1000, slots=32)
    assert not _slots.may_run_scheduled(tiny, 4096, "tpu")
    assert _slots.may_run_scheduled(tiny, 4096, "cpu") and _slots.may_run_scheduled(
        given, 4096, "tpu"
    )
    assert _budget.stored_bytes(tiny, 4096, "tpu") == _budget.stored_bytes(tiny, 4096, "cpu") == 64
    assert _budget.stored_bytes(given, 4096, "tpu") == 512
    assert _budget.stored_bytes(given, 4096, "tpu", per_sample=False) == 64
    shared = _budget.checkpoints_for(given, 4096, "tpu", per_sample=False)
    padded = _budget.checkpoints_for(given, 4096, "tpu")
    assert padded is not None and (shared is None or padded < shared), (padded, shared)
    assert _budget.stored_bytes(given, 4096, "gpu") == 64
    assert _budget.stored_bytes(wide, 4096, "tpu") == 1024
    assert not _slots.may_run_scheduled(given, 1, "tpu")


def test_the_budget_defaults_to_a_quarter_of_a_device_and_can_be_set(monkeypatch):
    """Unless set, a loop's budget is a quarter of one device's memory where the backend reports
    it (never below 512 MiB), 512 MiB where it does not (this CPU) or for a program lowered for
    another platform; ``set_stored_carry_budget`` and ``stored_carry_budget_scope`` set what
    loops traced after read (None: the default again); bad values raise, naming the argument."""
    from dyndepth import _budget
    from dyndepth import _cost as dd_cost

    if jax.default_backend() == "cpu":
        assert _budget.device_memory() is None
    assert _budget.stored_carry_budget() == _budget.DEFAULT_BUDGET
    for memory, want in ((64 * 2**30, 16 * 2**30), (2**30, _budget.DEFAULT_BUDGET),
                         (None, _budget.DEFAULT_BUDGET)):  # fmt: skip
        monkeypatch.setattr(_budget, "device_memory", lambda memory=memory: memory)
        assert _budget.stored_carry_budget() == want, memory
    monkeypatch.setattr(_budget, "device_memory", lambda: 64 * 2**30)
    other = "tpu" if jax.default_backend() != "tpu" else "cpu"
    with dd_cost.lowering_for(other):
        assert _budget.stored_carry_budget() == _budget.DEFAULT_BUDGET
    # A loop traced now stores every carry of 64 rows x 10**6 steps x 64 bytes (8 GiB, two
    # copies): within the device's 16 GiB, where 512 MiB bounds it (on a GPU: the CPU would store
    # at most SMALL_STORE of so small a step's carries).
    loop = _traced_loop(16, 2, 10**6)
    assert loop.budget == 16 * 2**30 and _budget.checkpoints_for(loop, 64, "gpu") is None
    try:
        dd.set_stored_carry_budget(2**20)
        assert _budget.stored_carry_budget() == 2**20
        with dd.stored_carry_budget_scope(3):
            assert _budget.stored_carry_budget() == 3
            assert _budget.checkpoints_for(_traced_loop(16, 2, 10**6), 64, "gpu") is not None
        assert _budget.stored_carry_budget() == 2**20
    finally:
        dd.set_stored_carry_budget(None)
    assert _budget.stored_carry_budget() == 16 * 2**30
    for bad, error in ((1.5, TypeError), ("1", TypeError), (True, TypeError), (0, ValueError)):
        with pytest.raises(error, match="`nbytes`"):
            dd.set_stored_carry_budget(bad)


@pytest.mark.parametrize(
    "checkpoints, max_depth", [(2, 200), pytest.param(3, 700, marks=pytest.mark.slow)]
)
def test_two_level_recompute_is_exact(checkpoints, max_depth):
    """Segments of 128 and 256 steps (from 64 on, the backward pass recomputes sub-checkpoints,
    then each sub-segment): grad, grad of vmap, vmap of grad and jacrev equal a plain loop's,
    per-sample depths from 0 to max_depth."""
    W = jax.random.normal(jax.random.PRNGKey(0), (3, 3)) * 0.4
    xs = jax.random.normal(jax.random.PRNGKey(1), (4, 3))
    depths = jnp.array([max_depth, 0, 97, max_depth - 65])

    def run(W, x, d, **kw):
        step = lambda c: jnp.tanh(c @ W) + 0.5 * c  # noqa: E731
        return dd.repeat(step, x, d, max_depth=max_depth, checkpoints=checkpoints, **kw)

    def plain(W, x, d):
        for _ in range(int(d)):
            x = jnp.tanh(x @ W) + 0.5 * x
        return x

    loss = lambda f: lambda W, xs: jnp.sum(jnp.sin(f(W, xs)))  # noqa: E731
    batched = lambda W, xs: jax.vmap(lambda x, d: run(W, x, d))(xs, depths)  # noqa: E731
    reference = lambda W, xs: jnp.stack([plain(W, x, d) for x, d in zip(xs, depths, strict=True)])  # noqa: E731
    tree_allclose(jax.grad(loss(batched), (0, 1))(W, xs),
                  jax.grad(loss(reference), (0, 1))(W, xs), rtol=1e-4, atol=1e-5)  # fmt: skip
    one = lambda W, x, d: jnp.sum(jnp.sin(run(W, x, d)))  # noqa: E731
    per_sample = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(W, xs, depths)
    want = [jax.grad(lambda W, x, d=d: jnp.sum(jnp.sin(plain(W, x, d))))(W, x)
            for x, d in zip(xs, depths, strict=True)]  # fmt: skip
    tree_allclose(per_sample, jnp.stack(want), rtol=1e-4, atol=1e-5)
    tree_allclose(jax.grad(one)(W, xs[0], depths[0]), want[0], rtol=1e-4, atol=1e-5)
    # jacrev: the cotangents batched, the forward pass not
    jac = jax.jacrev(lambda x: run(W, x, depths[0]))(xs[0])
    tree_allclose(jac, jax.jacrev(lambda x: plain(W, x, depths[0]))(xs[0]), rtol=1e-4, atol=1e-5)


def test_stored_carries_are_budgeted_for_the_whole_batch():
    """value_and_grad of vmap(repeat) at B=4096, max_depth=100,000, depth 3, a 16-float carry:
    the stored carries of the whole batch fit the budget (the budget per sample compiled to
    24 GiB of temporary memory); values and gradients equal a plain loop's."""
    from dyndepth._budget import DEFAULT_BUDGET

    B = 4096
    W = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) * 0.3
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, 16))
    depths = jnp.full((B,), 3)

    def loss(W, xs):
        step = lambda c: c + jnp.tanh(c @ W)  # noqa: E731
        one = lambda x, d: dd.repeat(step, x, d, max_depth=100_000)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths) ** 2)

    def plain(W, xs):
        for _ in range(3):
            xs = xs + jnp.tanh(xs @ W)
        return jnp.sum(xs**2)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(W, xs).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 2**30 and temp < 2 * DEFAULT_BUDGET, temp
    tree_allclose(compiled(W, xs), jax.value_and_grad(plain)(W, xs), rtol=1e-4)


@pytest.mark.parametrize("batched", [False, True])
def test_a_huge_max_depth_does_not_allocate_max_depth_carries(batched):
    """max_depth=10**6, depth 5: the default switches to bounded checkpointing by itself."""
    from dyndepth._budget import DEFAULT_BUDGET

    W = jnp.eye(64) * 0.5

    def one(x, d):
        return dd.repeat(lambda c: jnp.tanh(c @ W), x, d, max_depth=10**6)

    def loss(x, d):
        out = jax.vmap(one)(x, d) if batched else one(x, d)
        return jnp.sum(out**2)

    x = jnp.ones((2, 64) if batched else (64,))
    d = jnp.array([5, 3]) if batched else jnp.array(5)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(x, d).compile()
    # the budget is the whole loop's, the batch included
    assert compiled.memory_analysis().temp_size_in_bytes < DEFAULT_BUDGET + 2**20
    value, grad = compiled(x, d)

    def plain(x):
        rows = x if batched else x[None]
        depths = d if batched else d[None]
        total = 0.0
        for r, n in zip(rows, depths, strict=True):
            for _ in range(int(n)):
                r = jnp.tanh(r @ W)
            total = total + jnp.sum(r**2)
        return total

    tree_allclose((value, grad), jax.value_and_grad(plain)(x), rtol=1e-5)


def test_jvp_of_repeat_batched_and_nn_layers_with_auto():
    W = jnp.eye(3) * 0.7
    xs = jnp.arange(12.0).reshape(4, 3) / 10
    ds = jnp.array([0, 3, 1, 2])
    t = jnp.ones_like(xs)

    def batched(xs):
        return dd.repeat_batched(lambda c: jnp.tanh(c @ W), xs, ds, max_depth=3)

    def masked(xs):
        one = lambda x, d: dd.repeat(
            lambda c: jnp.tanh(c @ W), x, d, max_depth=3, strategy="masked"
        )
        return jax.vmap(one)(xs, ds)

    tree_allclose(jax.jvp(batched, (xs,), (t,)), jax.jvp(masked, (xs,), (t,)), rtol=1e-6)

    def recurrent(x, strategy):
        core = lambda s, x: jnp.tanh(s @ W + x)
        return dd.nn.recurrent_depth(core, x, x, n=1, k=2, max_n=2, max_k=2, strategy=strategy)

    got = jax.jvp(lambda x: recurrent(x, "auto"), (xs[1],), (t[1],))
    tree_allclose(got, jax.jvp(lambda x: recurrent(x, "masked"), (xs[1],), (t[1],)), rtol=1e-6)


def test_repeat_batched_rejects_a_non_bool_checked():
    with pytest.raises(TypeError, match="checked"):
        dd.repeat_batched(lambda c: c, jnp.zeros((2, 1)), jnp.array([1, 1]), max_depth=2,
                          checked="yes")  # fmt: skip
