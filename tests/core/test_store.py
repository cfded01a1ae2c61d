"""The stored-carry layout and the thinned backward pass's units, against plain Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, run_on_eight_devices
from hypothesis import given, settings
from hypothesis import strategies as st
from shared_lists import FULL, covering

import dyndepth as dd
from dyndepth import _store


def plain_units(n: int, stride: int) -> list[tuple[bool, int, int, int]]:
    """``(recompute, step, position, segment)`` of each unit of a sample's backward pass: its
    segments last first, each recomputed (all but its first carry), then undone in reverse."""
    nseg = -(-n // stride)
    out = []
    for j in reversed(range(nseg)):
        start, length = j * stride, min(stride, n - j * stride)
        out += [(True, start + p, p, j) for p in range(length - 1)]
        out += [(False, start + p, p, j) for p in reversed(range(length))]
    return out


@jax.jit
def _units_of(n, K):
    """A sample of ``n`` steps under ``K`` slots: its stride, its units, and every unit
    ``_store.backward_unit`` gives for the first ``2 x 300`` (one compiled program whatever
    ``n`` and ``K``: the units past the sample's are cut off by the caller)."""
    stride = _store.strides_for(n[None], K)[0]
    u = jnp.arange(600)
    return stride, _store.units(n, stride), _store.backward_unit(n + 0 * u, stride + 0 * u, u)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), K=st.integers(1, 40))
def test_backward_units_match_plain_python(n, K):
    stride, units, got = _units_of(jnp.asarray(n, jnp.int32), jnp.asarray(K, jnp.int32))
    stride = int(stride)
    assert -(-n // stride) <= K and (stride == 1 or -(-n // (stride // 2)) > K)
    want = plain_units(n, stride)
    assert int(units) == len(want) <= 600
    if not want:
        return
    got = list(zip(*[np.asarray(a)[: len(want)].tolist() for a in got], strict=True))
    assert got == want
    # every step is undone once, and each unit reads a carry written before it: the stored
    # one (position 0) or the one its segment's previous recompute unit wrote
    assert sorted(step for rec, step, _, _ in want if not rec) == list(range(n))
    written = set()
    for rec, _, p, j in got:
        assert p == 0 or (j, p) in written
        if rec:
            written.add((j, p + 1))


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    steps=st.integers(1, 7),
    slots=st.integers(1, 6),
    axis=st.sampled_from([0, 1]),
    seed=st.integers(0, 2**16),
    shared=st.booleans(),
)
def test_cells_read_and_write_each_layout_as_plain_python(rows, steps, slots, axis, seed, shared):
    """``_store.cells`` / ``put_cells`` on a slot-major ``(K, B, ...)`` buffer (axis 0, the
    store) and a batch-major ``(B, T, ...)`` one (axis 1, xs and ys): each slot's cell at its
    row and position, written only where wanted, against indexing in plain Python. A shared
    position with ``b`` None (lockstep) is a slice; otherwise rows and positions per slot (no
    two wanted slots share a row, as the schedules guarantee)."""
    rng = np.random.default_rng(seed)
    shape = (steps, rows, 2) if axis == 0 else (rows, steps, 2)
    buf = rng.normal(size=shape).astype(np.float32)
    if shared:
        b, n = None, rows
        k = int(rng.integers(0, steps))
        ks, bs = [k] * n, list(range(rows))
    else:
        n = slots
        bs = rng.permutation(max(rows, n))[:n] % rows
        ks = rng.integers(0, steps, n)
        b, k = jnp.asarray(bs, jnp.int32), jnp.asarray(ks, jnp.int32)
    want = rng.random(n) < 0.6
    if not shared:  # (a row written by two slots: keep the first)
        seen = set()
        for s in range(n):
            want[s] &= int(bs[s]) not in seen
            if want[s]:
                seen.add(int(bs[s]))
    vals = rng.normal(size=(n, 2)).astype(np.float32)

    def at(x, s):
        return x[ks[s], bs[s]] if axis == 0 else x[bs[s], ks[s]]

    got = np.asarray(_store.cells([jnp.asarray(buf)], b, k, axis)[0])
    np.testing.assert_array_equal(got, np.stack([at(buf, s) for s in range(n)]))
    out = np.asarray(_store.put_cells([jnp.asarray(buf)], b, k, [jnp.asarray(vals)],
                                      jnp.asarray(want), axis)[0])  # fmt: skip
    expected = buf.copy()
    for s in range(n):
        if want[s]:
            if axis == 0:
                expected[ks[s], bs[s]] = vals[s]
            else:
                expected[bs[s], ks[s]] = vals[s]
    np.testing.assert_array_equal(out, expected)


@settings(max_examples=40 if FULL else 20, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=10),
    slots=st.integers(1, 10),
    K=st.integers(1, 12),
)
def test_a_store_in_schedule_order_holds_every_carry_where_it_fits(lengths, slots, K):
    """The wrap-around forward pass's store in schedule order: run the schedule, each iteration
    writing its slots' ``(sample, step)`` as one block (``_store.put_in_order``), and check in
    plain Python that every sample's every step ran, at the iteration and slot
    ``Wrap.position`` says; where the schedule fits (``_store.fits_in_order``, against the
    plain capacity ``C <= K x (B // S)``), every step is found where
    ``_store.in_order_cells`` says. Gathered into the per-sample layout
    (``_store.to_per_sample``), slot ``k`` of sample ``b`` holds step
    ``min(k x stride, steps - 1)``'s carry (the first of a sample with steps, for one
    without)."""
    from dyndepth._schedule import Wrap

    B = len(lengths)
    steps = jnp.asarray(lengths, jnp.int32)

    def iterations_and_first(n):
        sched = Wrap.of(n, slots)
        return sched.iterations, sched.first

    C, first = jax.jit(iterations_and_first)(steps)
    C, S = int(C), first.shape[0]  # (the schedule's own slot count: at most B)
    fits = C <= K * (B // S)
    # every (sample, step), in batch order: where the schedule ran it, and where the store has it
    pairs = [(b, i) for b, n in enumerate(lengths) for i in range(n)]
    b, i = np.asarray(pairs, np.int32).reshape(-1, 2).T

    @jax.jit  # one program per example (eager, every op would compile for its shapes)
    def run(steps, b, i):
        sched = Wrap.of(steps, slots)

        def iteration(carry, t):
            state, store = carry
            view = sched.view(state, t)
            if fits:
                store = _store.put_in_order(store, t, [view.b * 100 + view.i], S)
            return (view.after, store), (view.b, view.i, view.live)

        store = {"buf": [jnp.full((K, B), -1, jnp.int32)]}
        (_, store), ran = jax.lax.scan(iteration, (sched.start([]), store), jnp.arange(C))
        ones, written = jnp.ones((B,), jnp.int32), jnp.full((B,), S, jnp.int32)
        return (_store.fits_in_order(sched.iterations, S, K, B), ran, sched.position(b, i),
                store["buf"][0], _store.in_order_cells(sched, B, b, i),
                _store.to_per_sample(store["buf"], ones, written, steps),
                _store.strides_for(steps, K))  # fmt: skip

    fits_seen, ran, where, buf, (k, col), ((per,), stride), strides = jax.tree_util.tree_map(
        np.asarray, run(steps, b, i)
    )
    assert bool(fits_seen) == fits
    at = {}
    for t, s in zip(*np.nonzero(ran[2]), strict=True):
        at[int(ran[0][t, s]), int(ran[1][t, s])] = (int(t), int(s))
    assert sorted(at) == pairs
    if not pairs:
        return
    assert list(zip(*(v.tolist() for v in where), strict=True)) == [at[p] for p in pairs]
    if not fits:
        return
    np.testing.assert_array_equal(buf[k, col], b * 100 + i)
    np.testing.assert_array_equal(stride, strides)
    deepest = int(np.argmax(lengths))
    for b, n in enumerate(lengths):
        for k in range(K):
            want = deepest * 100 if n == 0 else b * 100 + min(k * int(stride[b]), n - 1)
            assert int(per[k, b]) == want, (b, k)


SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 1.5, -2.25]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64,
                                   jnp.int32, jnp.bool_])  # fmt: skip
def test_a_read_in_a_loop_is_the_read_bit_for_bit(dtype):
    """``_store.read_in_loop`` (cells less a zero of the iteration, so that a compiler cannot
    move a conversion out of the loop) returns :func:`read`'s bits: ``-0.0``, NaN, infinities
    and subnormals included, per-row cells and a lockstep slice, in a loop's body."""
    values = np.array(SPECIAL * 2, np.float32)[:16]
    buf = jnp.asarray(values.reshape(4, 2, 2)).astype(dtype)  # (K=4, B=2, 2)
    if dtype == jnp.complex64:
        buf = buf + 1j * buf[::-1]
    rows = jnp.array([1, 0, 1], jnp.int32)
    steps = jnp.array([3, 0, 2], jnp.int32)

    def bits(x):
        x = np.asarray(x)
        return x.view(np.uint8) if x.dtype != np.bool_ else x

    for b, k in ((rows, steps), (None, jnp.int32(2))):
        want = _store.read([buf], b, k)[0]

        def body(t, acc, b=b, k=k):
            return _store.read_in_loop([buf], b, k, t)[0]

        got = jax.jit(lambda z, body=body: jax.lax.fori_loop(0, 3, body, z))(jnp.zeros_like(want))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(bits(got), bits(want))
    if dtype == jnp.float32:  # differentiated as the identity, each way (a bit cast is not)
        dbuf = jnp.arange(buf.size, dtype=dtype).reshape(buf.shape)
        read = lambda x: _store.read_in_loop([x], rows, steps, jnp.int32(1))[0]  # noqa: E731
        _, tangent = jax.jvp(read, (jnp.where(jnp.isfinite(buf), buf, 0),), (dbuf,))
        np.testing.assert_array_equal(tangent, _store.read([dbuf], rows, steps)[0])
        (cotangent,) = jax.vjp(read, buf)[1](tangent)
        expected = np.zeros(buf.shape, np.float32)
        for s, (b, k) in enumerate(zip(rows.tolist(), steps.tolist(), strict=True)):
            expected[k, b] += np.asarray(tangent)[s]
        np.testing.assert_array_equal(cotangent, expected)


@pytest.mark.parametrize(
    ("checkpoints", "slots", "seed"),
    [(None, None, 0), (16, None, 1), (16, 3, 2), (4, None, 3), (6, 8, 4), (None, 2, 5)],
)
def test_backward_stats_count_the_iterations_run(checkpoints, slots, seed):
    """``return_stats`` under value_and_grad: the forward and backward iterations it reports are
    the step evaluations a host callback counts (the scheduled backward pass, the recomputing
    one and the two-level sweep alike), and the backward sample-steps are at most ``sum(depth)``
    plus the recompute (``2 x sum(depth)``), or the two-level sweep's rows x iterations."""
    counter = Counter()
    W = jnp.eye(3) * 0.5
    xs = jnp.ones((8, 3))
    depths = jax.random.randint(jax.random.PRNGKey(seed), (8,), 0, 50)

    # One tick per evaluation of the step, forward or inside a vjp (a debug callback in a
    # plain step would run with the forward pass only).
    @jax.custom_vjp
    def layer(c, W):
        counter.tick()
        return jnp.tanh(c @ W)

    def layer_fwd(c, W):
        counter.tick()
        out = jnp.tanh(c @ W)
        return out, (c, W, out)

    def layer_bwd(res, g):
        c, W, out = res
        g = g * (1 - out**2)
        return g @ W.T, jnp.outer(c, g) if c.ndim == 1 else c.T @ g

    layer.defvjp(layer_fwd, layer_bwd)

    def loss(W):
        out, stats = dd.repeat_batched(lambda c: layer(c, W), xs, depths, max_depth=60,
                                       checkpoints=checkpoints, slots=slots,
                                       return_stats=True)  # fmt: skip
        return jnp.sum(out), stats

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    ticks = counter.run(fn, W)
    (_, stats), _ = fn(W)
    assert ticks == int(stats["iterations"]) + int(stats["backward_iterations"])
    total = int(jnp.sum(depths))
    assert int(stats["backward_executed_sample_steps"]) >= total
    K = 60 if checkpoints is None else checkpoints
    assert int(stats["stored_carries"]) == K


def _poisoned_blank(lead, aval):
    """A stand-in for ``_sharding.blank`` whose cells hold what no loop may use: NaN (the
    largest integer, ``True``)."""
    shape = tuple(lead) + tuple(aval.shape)
    if jnp.issubdtype(aval.dtype, jnp.inexact):
        return jnp.full(shape, jnp.nan, aval.dtype)
    if jnp.issubdtype(aval.dtype, jnp.integer):
        return jnp.full(shape, jnp.iinfo(aval.dtype).max, aval.dtype)
    return jnp.ones(shape, aval.dtype)


# (every store under every schedule, the loop turning; both loops each with DYNDEPTH_FULL=1)
UNSET_CASES = covering([None, 1, 2, 5], [None, 1, 3, 8], ["repeat", "while_loop"])


@pytest.mark.parametrize(("checkpoints", "slots", "loop"), UNSET_CASES)
def test_cells_the_store_leaves_unset_are_never_used(monkeypatch, loop, checkpoints, slots):
    """The stored carries' buffers are left unset where the backend allows
    (``_sharding.blank``: ``lax.empty``, which a CPU fills with zeros). Filled with NaN here
    instead, every kernel's value and gradients (lockstep ``slots=8``, wrap-around in a count
    that divides the batch or not, the time rule; every carry stored or thinned, the thinned
    backward pass's segments and the two-level sweep; a stop predicate's store that grows its
    strides) are still those of a plain Python loop: no unset cell is read, but into a select
    that discards it."""
    from dyndepth import _sharding

    monkeypatch.setattr(_sharding, "blank", _poisoned_blank)
    kw, kx = jax.random.split(jax.random.PRNGKey(7))
    W = jax.random.normal(kw, (3, 3)) / 3
    xs = jax.random.normal(kx, (8, 3))
    depths = jnp.array([0, 3, 12, 1, 0, 7, 16, 2])

    def step(W, c):
        return c + 0.5 * jnp.tanh(c @ W)

    def holds(c, d):
        return c[0] + 0.2 * d.astype(c.dtype) < 3.0

    def looped(W, x, d):
        if loop == "repeat":
            return dd.repeat(lambda c: step(W, c), x, d, max_depth=16, checkpoints=checkpoints,
                             slots=slots)  # fmt: skip
        return dd.while_loop(lambda c: holds(c, d), lambda c: step(W, c), x, max_steps=16,
                             checkpoints=checkpoints, slots=slots)  # fmt: skip

    def plain(W, x, d):  # (one sample, its values concrete)
        c = x
        for i in range(16):
            if i >= int(d) if loop == "repeat" else not bool(holds(c, d)):
                break
            c = step(W, c)
        return jnp.sum(c**2)

    def loss(W, xs):
        return jnp.sum(jax.vmap(lambda x, d: looped(W, x, d))(xs, depths) ** 2)

    value, (g_W, g_xs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(W, xs)
    grad = jax.value_and_grad(plain, argnums=(0, 1))
    want = [grad(W, x, d) for x, d in zip(xs, depths, strict=True)]
    np.testing.assert_allclose(value, sum(v for v, _ in want), rtol=2e-5)
    np.testing.assert_allclose(g_W, sum(g[0] for _, g in want), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g_xs, jnp.stack([g[1] for _, g in want]), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("depths, fits", [([16, 1, 1, 1, 1, 1, 1, 1], False),
                                          ([2, 1, 2, 1, 2, 1, 2, 1], True)])  # fmt: skip
def test_a_store_laid_out_by_rows_is_read_whole_and_never_scattered(monkeypatch, checkpoints,
                                                                    depths, fits):  # fmt: skip
    """A store the platform lays out with its rows along the lanes (a TPU's large store of
    narrow carries, ``_cost.rows_on_lanes``, made true here): the lockstep pass reads each
    slot's slice through or'ed bits, and a thinned store's forward pass runs in lockstep
    unless its wrap-around schedule writes the store in schedule order (a block per
    iteration, no scatter). Values and gradients those of plain Python (the store filled with
    NaN); the forward pass executes B x max(depths) sample-steps where the thinned store does
    not fit in order, and fewer where it does (or every carry is stored)."""
    from dyndepth import _cost, _sharding

    monkeypatch.setattr(_sharding, "blank", _poisoned_blank)
    W = jax.random.normal(jax.random.PRNGKey(3), (3, 3)) / 3
    xs = jax.random.normal(jax.random.PRNGKey(4), (8, 3))
    depths = jnp.asarray(depths)

    def step(W, c):
        return c + 0.5 * jnp.tanh(c @ W)

    def loss(W, xs):
        out, stats = dd.repeat_batched(lambda c: step(W, c), xs, depths, max_depth=16,
                                       checkpoints=checkpoints, return_stats=True)  # fmt: skip
        return jnp.sum(out**2), stats["executed_sample_steps"]

    def plain(W, x, d):
        for _ in range(int(d)):
            x = step(W, x)
        return jnp.sum(x**2)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, free), _ = run(W, xs)
    monkeypatch.setattr(_cost, "rows_on_lanes", lambda shape, dtype: True)
    (value, executed), (g_W, g_xs) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1),
                                                                has_aux=True))(W, xs)  # fmt: skip
    want = [
        jax.value_and_grad(plain, argnums=(0, 1))(W, x, d) for x, d in zip(xs, depths, strict=True)
    ]
    np.testing.assert_allclose(value, sum(v for v, _ in want), rtol=2e-5)
    np.testing.assert_allclose(g_W, sum(g[0] for _, g in want), rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(g_xs, jnp.stack([g[1] for _, g in want]), rtol=2e-5, atol=1e-6)
    lockstep = 8 * int(jnp.max(depths))
    assert int(free) < lockstep  # (scheduled where the rows' layout does not matter)
    if checkpoints is None or fits:
        assert int(executed) == int(free)
    else:
        assert int(executed) == lockstep


@pytest.mark.parametrize(("batched", "checkpoints"), covering([True, False], [None, 2], crossed=1))
def test_cells_left_unset_are_never_used_in_second_order(monkeypatch, batched, checkpoints):
    """Reverse over reverse and forward over reverse (the Hessian-vector product of a loss's
    gradient) with the stores filled with NaN: those of plain Python, batched or not."""
    from dyndepth import _sharding

    monkeypatch.setattr(_sharding, "blank", _poisoned_blank)
    W = jax.random.normal(jax.random.PRNGKey(5), (3, 3)) / 3
    xs = jax.random.normal(jax.random.PRNGKey(6), (4, 3))
    depths = jnp.array([0, 5, 2, 9])

    def step(W, c):
        return c + 0.5 * jnp.tanh(c @ W)

    def looped(W, x, d):
        return dd.repeat(lambda c: step(W, c), x, d, max_depth=10, checkpoints=checkpoints)

    def plain(W, x, d):
        c = x
        for i in range(10):
            c = jnp.where(i < d, step(W, c), c)
        return c

    def loss(one):
        if batched:
            return lambda W: jnp.sum(jax.vmap(lambda x, d: one(W, x, d))(xs, depths) ** 2)
        return lambda W: sum(jnp.sum(one(W, x, d) ** 2) for x, d in zip(xs, depths, strict=True))

    def second(f):
        grad = jax.grad(f)
        hvp = jax.jvp(grad, (W,), (jnp.ones_like(W),))[1]
        return jax.grad(lambda W: jnp.sum(grad(W) ** 2))(W), hvp

    for a, b in zip(jax.jit(lambda: second(loss(looped)))(), second(loss(plain)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("strategy", ["checkpointed", "auto"])
def test_cells_an_unbatched_store_leaves_unset_are_never_used(monkeypatch, strategy, checkpoints):
    """The unbatched loop's buffers (its stored carries and the step residuals it stores:
    ``tanh``'s output here), left unset too, filled with NaN: gradients of a loop that stops
    before its ``max_depth`` are those of a plain Python loop."""
    from dyndepth import _sharding

    monkeypatch.setattr(_sharding, "blank", _poisoned_blank)
    W = jax.random.normal(jax.random.PRNGKey(3), (3, 3)) / 3
    x = jnp.array([0.3, -0.2, 0.5])

    def looped(W, x):
        step = lambda c: c + 0.5 * jnp.tanh(c @ W)  # noqa: E731
        return jnp.sum(dd.repeat(step, x, 5, max_depth=12, strategy=strategy,
                                 checkpoints=checkpoints) ** 2)  # fmt: skip

    def plain(W, x):
        for _ in range(5):
            x = x + 0.5 * jnp.tanh(x @ W)
        return jnp.sum(x**2)

    got = jax.jit(jax.value_and_grad(looped, argnums=(0, 1)))(W, x)
    want = jax.value_and_grad(plain, argnums=(0, 1))(W, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("checkpoints", [None, 2])
@pytest.mark.parametrize("loop", ["repeat", "while_loop"])
def test_reverse_mode_over_no_samples(loop, checkpoints):
    """``grad`` of ``vmap`` of a loop over a batch of zero samples: zero gradients, as a plain
    loop over no samples gives (it raised "zero-size array to reduction" once)."""
    W = jnp.eye(3)
    xs, ds = jnp.ones((0, 3)), jnp.zeros((0,), jnp.int32)

    def one(W, x, d):
        step = lambda c: jnp.tanh(c @ W)  # noqa: E731
        if loop == "repeat":
            return dd.repeat(step, x, d, max_depth=5, checkpoints=checkpoints)
        return dd.while_loop(lambda c: c[0] < 1, step, x, max_steps=5, checkpoints=checkpoints)

    grad = jax.grad(lambda W: jnp.sum(jax.vmap(lambda x, d: one(W, x, d))(xs, ds)))(W)
    np.testing.assert_array_equal(grad, jnp.zeros_like(W))


@pytest.mark.parametrize("checkpoints", [None, 8])
def test_shared_inputs_are_not_copied_per_sample(checkpoints):
    """value_and_grad of ``vmap`` of loops whose per-step inputs the batch shares: a scan's
    ``xs`` and ``with_index``'s step index stay one copy for the batch, whatever backward pass
    runs (they were broadcast per sample: B x xs bytes)."""
    B, T, D = 64, 1000, 1024
    xs = jnp.full((T, D), 1e-3)
    init = jnp.ones((B, D))
    ds = jnp.arange(B) * 15

    def scan_loss(init):
        step = lambda c, x: (c * 0.99 + jnp.sin(x), None)  # noqa: E731
        one = lambda c, d: dd.scan(step, c, xs, depth=d, length=T, checkpoints=checkpoints)[0]  # noqa: E731
        return jnp.sum(jax.vmap(one)(init, ds) ** 2)

    def index_loss(init):
        step = lambda i, c: c * 0.99 + jnp.sin(i.astype(c.dtype))  # noqa: E731
        one = lambda c, d: dd.repeat(step, c, d, max_depth=100_000, with_index=True,  # noqa: E731
                                     checkpoints=checkpoints)  # fmt: skip
        return jnp.sum(jax.vmap(one)(init[:, :4], ds) ** 2)

    scan_temp = jax.jit(jax.grad(scan_loss)).lower(init).compile().memory_analysis()
    assert scan_temp.temp_size_in_bytes < 8 * xs.nbytes, scan_temp.temp_size_in_bytes
    index_temp = jax.jit(jax.grad(index_loss)).lower(init).compile().memory_analysis()
    assert index_temp.temp_size_in_bytes < B * 100_000 * 4 / 8, index_temp.temp_size_in_bytes


THINNED_ON_MESH = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import dyndepth as dd

mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
W = jnp.eye(4) * 0.5 + 0.1
depths = np.arange(16) % 7
errors = []
with jax.set_mesh(mesh):
    xs = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("data")))
    for K in (2, None):
        for shared in (True, False):
            d = jnp.asarray(5) if shared else jax.device_put(jnp.asarray(depths),
                                                             NamedSharding(mesh, P("data")))
            def loss(W, xs, d=d, K=K, shared=shared):
                one = lambda x, d: dd.repeat(lambda c: jnp.tanh(c @ W), x, d, max_depth=300,
                                             checkpoints=K)
                return jnp.sum(jax.vmap(one, in_axes=(0, None if shared else 0))(xs, d) ** 2)
            got = jax.jit(jax.grad(loss))(W, xs)
            def plain(W, n):
                out = jax.lax.fori_loop(0, n, lambda _, c: jnp.tanh(c @ W), jnp.ones(4))
                return jnp.sum(out ** 2)
            want = sum(jax.grad(plain)(W, 5 if shared else int(n)) for n in depths)
            errors.append(float(jnp.max(jnp.abs(got - want))))
print("RESULT" + json.dumps(errors))
"""


def test_thinned_checkpoints_on_an_explicit_mesh():
    """A batch split over an ``Explicit`` mesh's ``data`` axis, thinned checkpoints (given, or
    chosen for ``max_depth`` 300), one depth for the batch or one per sample: the gradient of a
    plain loop (it raised ShardingTypeError with one depth for the batch)."""
    errors = run_on_eight_devices(THINNED_ON_MESH)
    assert max(errors) < 1e-5, errors


def test_continuous_refill_under_x64():
    """``jax_enable_x64`` with a vmapped ``while_loop`` in fewer slots than samples: the
    refill's counters keep their types, values and gradients those of a plain loop (an
    internal counter once turned int64)."""
    jax.config.update("jax_enable_x64", True)  # (with JAX's standard promotion, as users run)
    jax.config.update("jax_numpy_dtype_promotion", "standard")
    try:
        W = jnp.eye(3, dtype=jnp.float64) * 0.5
        xs = jnp.arange(24.0).reshape(8, 3) / 30

        def loss(W, slots):
            one = lambda x: dd.while_loop(lambda c: c[0] < 1, lambda c: jnp.tanh(c @ W) + 0.3,  # noqa: E731
                                          x, max_steps=9, slots=slots)  # fmt: skip
            return jnp.sum(jax.vmap(one)(xs) ** 2)

        got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(W, 2)
        want = jax.jit(jax.value_and_grad(loss), static_argnums=1)(W, 8)
        assert got[1].dtype == jnp.float64
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-10)
    finally:
        jax.config.update("jax_enable_x64", False)
        jax.config.update("jax_numpy_dtype_promotion", "strict")
