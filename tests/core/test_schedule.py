"""The per-sample scheduler: results and gradients equal the unscheduled loop, work ~ sum(depth)."""

import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import applicable, conditional_branches, dyndepth_loops, tree_allclose
from shared_lists import DISTRIBUTIONS, FULL, depths_of, long_tail_depths, uniform_depths

import dyndepth
from dyndepth import _budget, _checks, _slots
from dyndepth import _cost as dd_cost

D = 3
M = 7


def make_layer(W):
    def layer(x, k):
        h = jnp.tanh(x @ W)
        keep = jax.random.bernoulli(k, 0.7, h.shape)
        return x + jnp.where(keep, h, 0.0)

    return layer


@pytest.fixture(scope="module")
def data():
    k = jax.random.PRNGKey(3)
    kw, kx, kd, kk = jax.random.split(k, 4)
    B = 13
    W = jax.random.normal(kw, (D, D)) * 0.5
    xs = jax.random.normal(kx, (B, D))
    ds = jax.random.randint(kd, (B,), 0, M + 1).at[0].set(0).at[1].set(M).at[2].set(0)
    ks = jax.random.split(kk, B)
    return W, xs, ds, ks


def batch_run(W, xs, ds, ks, strategy, slots=None, checkpoints=None):
    def one(x, d, k):
        return dyndepth.repeat(
            make_layer(W),
            x,
            d,
            max_depth=M,
            key=k,
            strategy=strategy,
            **applicable(strategy, checkpoints, slots),
        )

    return jax.vmap(one)(xs, ds, ks)


def loss(W, xs, ds, ks, strategy, slots=None, checkpoints=None):
    return jnp.sum(batch_run(W, xs, ds, ks, strategy, slots, checkpoints) ** 2)


@pytest.mark.parametrize("slots", [1, 4, 13, 20])
def test_scheduled_values_and_grads_match_unscheduled(data, slots):
    W, xs, ds, ks = data
    ref = batch_run(W, xs, ds, ks, "masked")
    out = jax.jit(batch_run, static_argnums=(4, 5))(W, xs, ds, ks, "auto", slots)
    tree_allclose(out, ref)
    g = jax.jit(jax.grad(loss, (0, 1)), static_argnums=(4, 5))(W, xs, ds, ks, "auto", slots)
    g_ref = jax.grad(loss, (0, 1))(W, xs, ds, ks, "masked")
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_scheduled_with_checkpoints(data):
    W, xs, ds, ks = data
    g = jax.grad(loss, (0, 1))(W, xs, ds, ks, "auto", 3, 2)
    g_ref = jax.grad(loss, (0, 1))(W, xs, ds, ks, "masked")
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_scheduled_per_sample_params_get_per_sample_grads(data):
    W, xs, ds, ks = data
    Wb = 0.1 * jax.random.normal(jax.random.PRNGKey(9), (xs.shape[0], D, D))

    def run(W, Wb, strategy):
        def one(x, d, k, wb):
            return dyndepth.repeat(
                make_layer(W + wb), x, d, max_depth=M, key=k, strategy=strategy,
                **applicable(strategy, slots=4),
            )  # fmt: skip

        return jnp.sum(jax.vmap(one)(xs, ds, ks, Wb) ** 2)

    tree_allclose(run(W, Wb, "auto"), run(W, Wb, "masked"))
    g = jax.grad(run, (0, 1))(W, Wb, "auto")
    g_ref = jax.grad(run, (0, 1))(W, Wb, "masked")
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)
    assert g[1].shape == Wb.shape


def test_pytree_carry_and_scan_outputs(data):
    W, xs, ds, ks = data
    seqs = jax.random.normal(jax.random.PRNGKey(4), (xs.shape[0], M, D))

    def run(W, strategy):
        def one(x, d, seq, k):
            def f(c, xi, kk):
                h = jnp.tanh(c["h"] @ W + xi)
                return {"h": h, "n": c["n"] + 1}, {"s": jnp.sum(h), "k": jax.random.key_data(kk)}

            return dyndepth.scan(
                f,
                {"h": x, "n": jnp.int32(0)},
                seq,
                depth=d,
                key=k,
                strategy=strategy,
                **applicable(strategy, slots=3),
            )

        return jax.vmap(one)(xs, ds, seqs, ks)

    (c1, y1), (c2, y2) = run(W, "auto"), run(W, "masked")
    tree_allclose((c1, y1), (c2, y2))
    np.testing.assert_array_equal(c1["n"], np.minimum(ds, M))

    def scalar(W, strategy):
        (c, y) = run(W, strategy)
        return jnp.sum(c["h"] ** 2) + jnp.sum(y["s"] ** 2)

    tree_allclose(jax.grad(scalar)(W, "auto"), jax.grad(scalar)(W, "masked"), rtol=1e-4)


def test_outer_vmap_batch_of_batches(data):
    W, xs, ds, ks = data
    xs2 = jnp.stack([xs, xs * 0.5])
    ds2 = jnp.stack([ds, jnp.flip(ds)])

    def run(W, strategy):
        return jax.vmap(lambda x, d: batch_run(W, x, d, ks, strategy, 4))(xs2, ds2)

    tree_allclose(run(W, "auto"), run(W, "masked"))
    g = jax.grad(lambda W: jnp.sum(run(W, "auto") ** 2))(W)
    g_ref = jax.grad(lambda W: jnp.sum(run(W, "masked") ** 2))(W)
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_repeat_batched_matches_reference_and_reports_work(data):
    W, xs, ds, ks = data
    out, st = dyndepth.repeat_batched(
        make_layer(W), xs, ds, max_depth=M, keys=ks, slots=4, return_stats=True
    )
    for b in range(xs.shape[0]):
        x = xs[b]
        for i in range(int(ds[b])):
            x = make_layer(W)(x, dyndepth.step_key(ks[b], i))
        tree_allclose(out[b], x)
    assert int(st["useful_sample_steps"]) == int(ds.sum())
    assert int(st["executed_sample_steps"]) == 4 * int(st["iterations"])
    assert int(st["executed_sample_steps"]) >= int(ds.sum())


def test_repeat_batched_without_keys_and_grad(data):
    W, xs, ds, _ = data

    def f(x):
        return x + jnp.tanh(x @ W)

    def ref_loss(xs):
        return jnp.sum(
            jax.vmap(lambda x, d: dyndepth.repeat(f, x, d, max_depth=M, strategy="masked"))(xs, ds)
            ** 2
        )

    def sched_loss(xs):
        return jnp.sum(dyndepth.repeat_batched(f, xs, ds, max_depth=M, slots=2) ** 2)

    tree_allclose(sched_loss(xs), ref_loss(xs))
    tree_allclose(jax.grad(sched_loss)(xs), jax.grad(ref_loss)(xs), rtol=1e-4)


@pytest.mark.parametrize("depth", [0, M, "traced"])
def test_repeat_batched_with_one_depth_for_the_batch(data, depth):
    """A depth of shape () (or a Python int) serves every sample: values, keys, stats and
    gradients (w.r.t. the weight and the inits) equal those of the same depth given per
    sample, and the compiled value_and_grad runs in lockstep: no conditional over slot
    counts, one copy of the step forward and backward."""
    W, xs, _, ks = data
    B = xs.shape[0]
    d = 3 if depth == "traced" else depth

    def shared(W, xs, d):
        return dyndepth.repeat_batched(make_layer(W), xs, d, max_depth=M, keys=ks,
                                       return_stats=True)  # fmt: skip

    def per_sample(W, xs):  # (one slot per sample: the lockstep loop, per-sample depths)
        ds = jnp.full((B,), d, jnp.int32)
        return dyndepth.repeat_batched(make_layer(W), xs, ds, max_depth=M, keys=ks, slots=B,
                                       return_stats=True)  # fmt: skip

    run = jax.jit(shared) if depth == "traced" else partial(shared, d=d)
    args = (jnp.int32(d),) if depth == "traced" else ()
    (out, st), (want, want_st) = run(W, xs, *args), per_sample(W, xs)
    tree_allclose(out, want, rtol=1e-6)
    assert {k: np.asarray(v).tolist() for k, v in st.items()} == {
        k: np.asarray(v).tolist() for k, v in want_st.items()
    }
    assert int(st["executed_sample_steps"]) == B * d
    grads = jax.grad(lambda W, xs: jnp.sum(run(W, xs, *args)[0] ** 2), argnums=(0, 1))(W, xs)
    want_g = jax.grad(lambda W, xs: jnp.sum(per_sample(W, xs)[0] ** 2), argnums=(0, 1))(W, xs)
    tree_allclose(grads, want_g, rtol=1e-5)
    loss = lambda W, xs: jnp.sum(run(W, xs, *args)[0] ** 2)  # noqa: E731
    hlo = jax.jit(jax.value_and_grad(loss)).lower(W, xs).compile().as_text()
    assert "branch_computations" not in hlo


@pytest.mark.parametrize(
    "depths, inits, error, match",
    [
        (jnp.zeros((2, 2), jnp.int32), None, ValueError, r"must have shape \(B,\) or \(\)"),
        (2.0, None, TypeError, r"`depths` must be an integer array of shape \(B,\) or \(\)"),
        (M + 1, None, ValueError, r"`depths` must lie in \[0, max_depth\] = \[0, 7\], got 8$"),
        (2, {"a": jnp.ones((4, D)), "b": jnp.ones((3, D))}, ValueError,
         r"leading batch axis of size 4 \(from `inits\['a'\]`\); inits\['b'\] has shape"),
        (2, {"a": jnp.ones(())}, ValueError,
         r"`inits` needs a leading batch axis; inits\['a'\] has shape \(\)"),
    ],
)  # fmt: skip
def test_repeat_batched_depth_errors(depths, inits, error, match):
    inits = jnp.ones((4, D)) if inits is None else inits
    with pytest.raises(error, match=match):
        dyndepth.repeat_batched(lambda x: x, inits, depths, max_depth=M)


@pytest.mark.parametrize(("dist", "hi"), [("uniform", 100), ("long-tail", 256)])
def test_executed_sample_steps_close_to_sum_of_depths(dist, hi):
    B = 256
    ds = (uniform_depths if dist == "uniform" else long_tail_depths)(jax.random.PRNGKey(0), B, hi)
    xs = jnp.zeros((B, 1))
    _, st = dyndepth.repeat_batched(
        lambda x: x + 1.0, xs, ds, max_depth=hi, slots="work", return_stats=True
    )
    ratio = int(st["executed_sample_steps"]) / int(ds.sum())
    assert ratio <= 1.15, (dist, ratio, st)
    # The masked alternatives execute B * max(depth) or B * max_depth sample-steps.
    assert int(st["executed_sample_steps"]) < B * int(ds.max())


@pytest.mark.parametrize(
    "B, slots", [(64, "work"), (1024, "work")] + ([(256, "work")] if FULL else [])
)
def test_work_within_bound_on_every_distribution_forward_and_backward(B, slots):
    """Rows evaluated by the step, counted by a callback inside it (idle rows count too):
    <= 1.15 x sum(depth) forward and backward; values and gradients equal the masked loop's.
    With ``slots="work"`` the bound holds for every distribution (the default time rule trades
    work for iterations: test_choose_by_time_is_the_argmin_of_modeled_time)."""
    hi = 24
    calls = []

    def counted(v):  # one call per loop iteration, with every row of it
        calls.append(v.size)
        return v

    @jax.custom_jvp
    def count_rows(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(counted, shape, x, vmap_method="expand_dims")

    @count_rows.defjvp
    def _(primals, tangents):  # the tangent needs the count, so the backward pass calls it
        y = count_rows(*primals)
        return y, tangents[0] * (y * 0.0 + 1.0)

    def f(x):
        return count_rows(x[0]) * 0.0 + x * 1.01 + 0.5

    def loss(xs, ds):
        return jnp.sum(dyndepth.repeat_batched(f, xs, ds, max_depth=hi, slots=slots) ** 2)

    def ref_loss(xs, ds):
        def one(x, d):
            return dyndepth.repeat(lambda c: c * 1.01 + 0.5, x, d, max_depth=hi, strategy="masked")

        return jnp.sum(jax.vmap(one)(xs, ds) ** 2)

    def stats(xs, ds):
        return dyndepth.repeat_batched(f, xs, ds, max_depth=hi, slots=slots, return_stats=True)[1]

    fwd, vg, stats = jax.jit(loss), jax.jit(jax.value_and_grad(loss)), jax.jit(stats)
    ref_vg = jax.jit(jax.value_and_grad(ref_loss))
    xs = jnp.linspace(-1.0, 1.0, B)[:, None]
    for i, name in enumerate(DISTRIBUTIONS):
        ds = depths_of(name, jax.random.PRNGKey(i), B, hi)
        total = int(ds.sum())
        calls.clear()
        jax.block_until_ready(fwd(xs, ds))
        forward_rows = sum(calls)
        calls.clear()
        value, grad = jax.block_until_ready(vg(xs, ds))
        backward_rows = sum(calls) - forward_rows
        assert total <= forward_rows <= 1.15 * total, (name, forward_rows, total)
        assert total <= backward_rows <= 1.15 * total, (name, backward_rows, total)
        calls.clear()
        assert int(stats(xs, ds)["executed_sample_steps"]) == forward_rows, name
        tree_allclose((value, grad), ref_vg(xs, ds), rtol=1e-5)


@pytest.mark.parametrize(
    "slots, want",
    [
        (None, (256, 128, 64, 32, 8)),
        ("work", (256, 128, 16, 2, 1)),
        (32, (32,)),
        ((1, 300, 128, 128, 256), (256, 128, 1)),
    ],
)
@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_each_slot_count_is_one_compiled_loop(trace_kernels_for, platform, slots, want):
    """The compiled value_and_grad has one while loop per slot count forward and one backward
    (counts of B or more are one: the lockstep batch). On this CPU (and a GPU) one conditional
    per pass chooses among them; on a TPU they run one after another, and no conditional
    chooses among them: the only conditionals set up a count's schedule (its per-sample table
    and its slots' first samples: int32 only) where that count runs. (None: the time rule's
    ladder where an iteration costs one row.)"""
    assert _slots.SlotRule.of(_checks.slots_arg(slots), 256, 1.0).candidates == want
    trace_kernels_for(platform)

    def loss(W, xs, ds):
        f = lambda x: jnp.tanh(x @ W)  # noqa: E731
        return jnp.sum(dyndepth.repeat_batched(f, xs, ds, max_depth=5, slots=slots) ** 2)

    args = (jnp.eye(D), jnp.ones((256, D)), jnp.ones((256,), jnp.int32))
    hlo = jax.jit(jax.value_and_grad(loss)).lower(*args).compile().as_text()
    assert dyndepth_loops(hlo) == {"forward": len(want), "backward": len(want)}
    if platform == "cpu":
        for scope in ("dyndepth_forward", "dyndepth_backward"):
            assert conditional_branches(hlo, scope).count(len(want)) == (len(want) > 1), scope
        return
    outputs = re.findall(r"= (\(.*?\)) conditional\(", hlo)
    schedule = r"\(s32\[4,256\]\{1,0\}, s32\[\d+\]\{0\}\)"
    assert all(re.fullmatch(schedule, out) for out in outputs), outputs
    assert len(outputs) <= 2 * len(want)


def _chain(ops: int):
    """A step of ``ops`` elementwise operations (one equation each)."""

    def step(x):
        for _ in range(ops):
            x = jnp.sin(x)
        return x

    return step


@pytest.mark.parametrize("checkpoints", [None, 2])
def test_a_ladder_under_a_conditional_computes_what_the_chain_does(trace_kernels_for,
                                                                   checkpoints):  # fmt: skip
    """Where the slot counts' loops run under a conditional (this CPU's and a GPU's choice, and
    a thinned store's backward passes everywhere), value_and_grad and the stats equal those of
    the chain a TPU runs; the compiled program has a conditional over the counts forward and
    backward, the chain none forward."""

    def loss(W, xs, ds):
        f = lambda x: jnp.tanh(x @ W)  # noqa: E731
        out, stats = dyndepth.repeat_batched(
            f, xs, ds, max_depth=6, slots=(8, 4, 2), checkpoints=checkpoints, return_stats=True
        )
        return jnp.sum(out**2), stats

    k = jax.random.split(jax.random.PRNGKey(3), 3)
    args = (jax.random.normal(k[0], (D, D)) / D, jax.random.normal(k[1], (8, D)),
            jnp.array([0, 6, 1, 2, 5, 6, 3, 1], jnp.int32))  # fmt: skip
    vg = jax.jit(jax.value_and_grad(loss, has_aux=True))
    under_conditional = vg(*args)
    assert conditional_branches(vg.lower(*args).compile().as_text()).count(3) >= 2
    trace_kernels_for("tpu")
    chained = jax.jit(jax.value_and_grad(loss, has_aux=True))
    tree_allclose(under_conditional, chained(*args), rtol=1e-6)
    assert 3 not in conditional_branches(chained.lower(*args).compile().as_text(),
                                         "dyndepth_forward")  # fmt: skip


@pytest.mark.parametrize("ops, counts", [(60, 5), (150, 3), (300, 2)])
def test_a_larger_step_compiles_a_shorter_ladder(ops, counts):
    """The time rule's ladder holds at most ``LADDER_EQUATIONS`` equations of the step over its
    counts (two at the least): the compiled value_and_grad has that many loops forward and
    backward, counts spread over about the same span from ``B`` down."""
    assert ops == dd_cost.jaxpr_equations(jax.make_jaxpr(_chain(ops))(jnp.zeros(D)).jaxpr)

    def loss(xs, ds):
        return jnp.sum(dyndepth.repeat_batched(_chain(ops), xs, ds, max_depth=5) ** 2)

    args = (jnp.ones((256, D)), jnp.ones((256,), jnp.int32))
    hlo = jax.jit(jax.value_and_grad(loss)).lower(*args).compile().as_text()
    assert dyndepth_loops(hlo) == {"forward": counts, "backward": counts}


def test_ladders_by_step_size():
    """Every size of step: at most ``LADDER_EQUATIONS`` equations over the ladder unless it is
    the shortest (2 counts), no longer for a larger step, descending from ``B`` by powers of two,
    reaching down to ``B / 4`` at least (the best count of uniform depths, ``B / 2``, one step
    from a count in every ladder)."""
    longest = None
    for eqns in range(0, 700):
        n = _slots.ladder_length(eqns)
        assert 2 <= n <= _slots.MAX_COUNTS
        assert n == 2 or n * max(eqns, 1) <= _slots.LADDER_EQUATIONS, eqns
        assert longest is None or n <= longest
        longest = n
        for B in (3, 64, 1000, 4096):
            cands = _slots.slot_candidates(B, 0.0, eqns)
            assert cands[0] == B and list(cands) == sorted(set(cands), reverse=True)
            assert len(cands) <= n and cands[-1] <= -(-B // 4)
            assert all(-(-a // 4) <= b < a for a, b in zip(cands[:-1], cands[1:], strict=True)), (
                cands
            )
    assert _slots.slot_candidates(256, 0.0) == _slots.slot_candidates(256, 0.0, 4)


def test_jaxpr_equations_counts_nested_jaxprs():
    """A conditional's branches each count; a loop's body counts once."""

    def f(x):
        y = jax.lax.cond(x.sum() > 0, lambda v: jnp.sin(jnp.cos(v)), lambda v: v * 2.0, x)
        return jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v), y)

    jaxpr = jax.make_jaxpr(f)(jnp.zeros(3)).jaxpr
    flat = [e.primitive.name for e in jaxpr.eqns]
    # (the branches: sin and cos; a product)
    assert dd_cost.jaxpr_equations(jaxpr) == len(flat) + 2 + 1 + _loop_body_size(jaxpr)


def _loop_body_size(jaxpr) -> int:
    (loop,) = [e for e in jaxpr.eqns if e.primitive.name in ("while", "scan")]
    body = loop.params.get("body_jaxpr") or loop.params["jaxpr"]
    cond = loop.params.get("cond_jaxpr")
    return sum(len(j.jaxpr.eqns) for j in (body, cond) if j is not None)


def _random_lengths(rng, trial, B):
    hi = int(rng.integers(1, 200))
    lengths = rng.integers(0, hi + 1, B)
    if trial % 4 == 1:  # few deep
        lengths = np.where(rng.random(B) < 0.05, hi, rng.integers(0, 2, B))
    elif trial % 4 == 2:  # long tail
        lengths = np.minimum(1 + rng.poisson(np.exp(rng.normal(np.log(hi / 8), 0.5, B))), hi)
    elif trial % 8 == 3:
        lengths[:] = 0
    return lengths


def _iterations(lengths, c):
    return max(int(lengths.max()), -(-int(lengths.sum()) // c))


def test_choose_by_work_takes_the_most_slots_within_the_work_slack():
    """Checked against a brute-force reading of the rule on random lengths."""
    rng = np.random.default_rng(0)
    choose = jax.jit(_slots.choose_by_work, static_argnums=1)
    for trial in range(200):
        B = int(rng.choice([3, 5, 64, 100, 256]))
        cands = _slots.work_candidates(B)
        assert cands[0] == B and cands[-1] == 1 and list(cands) == sorted(cands, reverse=True)
        lengths = _random_lengths(rng, trial, B)
        work = [c * _iterations(lengths, c) for c in cands]
        ok = [w <= (1 + _slots.WORK_SLACK) * lengths.sum() for w in work]
        want = ok.index(True) if any(ok) else int(np.argmin(work))
        got = int(choose(jnp.asarray(lengths), cands))
        assert got == want, (lengths, cands, work)
        assert work[got] <= (1 + _slots.WORK_SLACK) * lengths.sum()
    assert _slots.work_candidates(2) == (2,)


def test_choose_by_time_is_the_argmin_of_modeled_time():
    """For given backend constants (an iteration's fixed cost in rows, a scheduled row's moves
    in rows), the rule's choice is the argmin over its candidates of ``C(S) x (fixed_rows + S x
    (1 + moved_rows))``, the moves left out at ``S = B`` (lockstep), the most slots among
    equals, checked in NumPy on random distributions; the ladder stops at ``fixed_rows / 8``."""
    rng = np.random.default_rng(1)
    choose = jax.jit(_slots.choose_by_time, static_argnums=(1, 2, 3))
    for trial in range(200):
        B = int(rng.choice([3, 64, 512, 4096]))
        fixed = float(rng.choice([0.0, 1.0, 18.0, 300.0, 2500.0]))
        moved = float(rng.choice([0.0, 0.3, 1.3, 5.0, 100.0]))
        cands = _slots.slot_candidates(B, fixed)
        assert cands[0] == B and list(cands) == sorted(set(cands), reverse=True)
        assert all(c >= fixed // 8 for c in cands[1:])
        lengths = _random_lengths(rng, trial, B)
        modeled = [_iterations(lengths, c) * (fixed + c * (1 + (c < B) * moved)) for c in cands]
        got = int(choose(jnp.asarray(lengths), cands, fixed, moved))
        assert got == int(np.argmin(modeled)), (fixed, moved, cands, modeled, got)
        # With moves, the ladder keeps the counts whose rows with twice their moves are
        # fewer than the batch's (those that cannot beat lockstep among them).
        kept = _slots.slot_candidates(B, fixed, 0, moved)
        assert kept == (B, *(c for c in cands[1:] if c * (1 + 2 * moved) < B))
        if moved == 0.0:
            assert kept == cands


def test_the_tpu_costs_choose_the_counts_measured_fastest():
    """The TPU's built-in costs, on the workloads ``benchmarks/tpu_slot_costs.py`` timed on a
    v5e (value_and_grad of x + tanh(x W)): lockstep where a scheduled row's moves outweigh the
    rows saved (B=4096 of width 16, uniform depths: lockstep 2.70 ms, 2,048 slots 49.5; B=1024
    of width 256: lockstep 1.36 ms, 512 slots 2.80), 256 slots on a long tail of width 512
    (3.39 ms against lockstep's 4.47), and continuous batching in lockstep there too."""
    tpu = dd_cost._DEFAULTS["tpu"]
    # (B, width, the measured batch's sum and longest depth, the fastest count)
    for B, width, total, longest, want in ((4096, 16, 1_045_937, 500, 4096),
                                           (1024, 256, 51_305, 100, 1024),
                                           (2048, 512, 34_944, 87, 256)):  # fmt: skip
        W = jnp.zeros((width, width))
        step = jax.make_jaxpr(lambda x, W=W: x + jnp.tanh(x @ W))(jnp.zeros(width))
        row_flops = dd_cost.jaxpr_flops(step.jaxpr)
        fixed = tpu.fixed_rows(row_flops, width * width * 4)
        rule = _slots.SlotRule.of(None, B, fixed, 3, tpu.moved_rows(row_flops))
        rest, extra = divmod(total - longest, B - 1)  # (a batch of that sum and longest depth)
        lengths = np.array([longest] + [rest + 1] * extra + [rest] * (B - 1 - extra))
        assert lengths.sum() == total and lengths.max() == longest
        assert rule.candidates[int(rule.choose(jnp.asarray(lengths)))] == want, (B, width, rule)
        assert _slots.refill_slots(None, B, fixed, rule.moved_rows) == B


def test_measured_costs_choose_for_their_backend():
    """The measured defaults: on the GPU constants the long-tail batch of the H200 measurement
    (B=4096, 134,800 steps, the longest 165) takes 1,024 slots (its measured best), and a batch
    of 256 of a width-256 step runs in lockstep; on the CPU a width-64 step's uniform batch takes
    B / 2, and a width-256 step's takes B / 2 too, where without the weights read at every
    iteration it took B / 4 (1.6x slower, measured). An unknown platform takes the GPU's
    costs. (The suite's own CPU costs are tests/conftest.py's: the defaults are read apart.)"""
    gpu, cpu = dd_cost.backend_cost("gpu"), dd_cost._DEFAULTS["cpu"]
    assert dd_cost.backend_cost("some-accelerator") == gpu

    def flops(width):
        W = jnp.zeros((width, width))
        step = lambda x: x + 0.1 * jnp.tanh(x @ W) @ W  # noqa: E731
        return dd_cost.jaxpr_flops(jax.make_jaxpr(step)(jnp.zeros(width)).jaxpr)

    assert flops(64) >= 2 * 2 * 64 * 64  # two matrix products of 2 x 64 x 64
    long_tail = np.array([165] + [33] * 4060 + [(134_800 - 165 - 33 * 4060) // 35] * 35)
    rule = _slots.SlotRule.of(None, 4096, gpu.fixed_rows(flops(1024)))
    assert rule.candidates[int(rule.choose(jnp.asarray(long_tail)))] == 1024
    assert _slots.SlotRule.of(None, 256, gpu.fixed_rows(flops(256))).candidates == (256,)
    uniform = np.arange(512) % 128 + 1
    rule = _slots.SlotRule.of(None, 512, cpu.fixed_rows(flops(64), 64 * 64 * 4))
    assert rule.candidates[int(rule.choose(jnp.asarray(uniform)))] == 256
    # benchmarks/scheduler.py's uniform batch (B=256, sum 12,654, max 100) of x + tanh(x W)
    uniform = np.array([100] + [50] * 250 + [(12_654 - 100 - 50 * 250) // 5] * 5)
    row_flops = dd_cost.jaxpr_flops(jax.make_jaxpr(lambda x: x + jnp.tanh(x @ W256))(X256).jaxpr)
    for weights, want in ((256 * 256 * 4, 128), (0, 64)):
        rule = _slots.SlotRule.of(None, 256, cpu.fixed_rows(row_flops, weights))
        assert rule.candidates[int(rule.choose(jnp.asarray(uniform)))] == want, weights


W256, X256 = jnp.zeros((256, 256)), jnp.zeros(256)


def test_a_shared_typed_key_is_priced_with_the_weights():
    """A step closing over a typed PRNG key (a const shared by the rows, of an extended dtype)
    runs scheduled, its key's data counted among the shared bytes."""
    key = jax.random.key(7)

    def step(x):
        return x + jax.random.normal(key, x.shape)

    xs, ds = jnp.zeros((6, D)), jnp.asarray([0, 1, 2, 3, 1, 0], jnp.int32)
    out = jax.vmap(lambda x, d: dyndepth.repeat(step, x, d, max_depth=3))(xs, ds)
    want = ds[:, None].astype(jnp.float32) * jax.random.normal(key, (D,))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert _budget.nbytes([key, jnp.zeros(3)]) == key.dtype.itemsize + 12


def test_an_iteration_reads_the_shared_weights_once():
    """The fixed cost in rows counts the shared operands' bytes at the backend's rate; the
    default rate (infinite) leaves them out."""
    cost = dd_cost.IterationCost(fixed_seconds=2e-6, flops_per_second=1e9, row_floor_seconds=0.0,
                                 bytes_per_second=1e9)  # fmt: skip
    assert cost.fixed_rows(1e3) == pytest.approx(2.0)
    assert cost.fixed_rows(1e3, 3e3) == pytest.approx(5.0)
    plain = dd_cost.IterationCost(fixed_seconds=2e-6, flops_per_second=1e9, row_floor_seconds=0.0)
    assert plain.fixed_rows(1e3, 3e3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"`cost.bytes_per_second` must be > 0"):
        dyndepth.set_iteration_cost("cpu", dataclasses.replace(cost, bytes_per_second=0.0))


def test_a_scheduled_row_moves_in_rows_of_the_step():
    """``moved_row_seconds`` over a row's cost (the step's flops at the rate, or the floor);
    none by default; a negative or NaN one raises, naming the field."""
    cost = dd_cost.IterationCost(fixed_seconds=2e-6, flops_per_second=1e9, row_floor_seconds=1e-6,
                                 moved_row_seconds=3e-6)  # fmt: skip
    assert cost.moved_rows(1e4) == pytest.approx(0.3)  # (a row of 10 us)
    assert cost.moved_rows(10.0) == pytest.approx(3.0)  # (the floor, 1 us)
    assert dataclasses.replace(cost, moved_row_seconds=0.0).moved_rows(1e4) == 0.0
    for bad in (-1e-9, float("nan")):
        with pytest.raises(ValueError, match=r"`cost.moved_row_seconds` must be finite and >= 0"):
            dyndepth.set_iteration_cost("cpu", dataclasses.replace(cost, moved_row_seconds=bad))


@pytest.mark.parametrize("slots", [3, None, (3, 1)])
def test_while_loop_per_sample_predicate_scheduled(data, slots):
    """Continuous batching forward (3 slots; a quarter of the batch for None; the largest of
    a sequence), the wrap-around backward over the steps taken."""
    W, xs, _, _ = data

    def run(W, strategy, slots):
        def one(x):
            return dyndepth.while_loop(
                lambda c: jnp.sum(c**2) < 20.0,
                lambda c: c * 1.2 + jnp.tanh(c @ W),
                x,
                max_steps=12,
                strategy=strategy,
                slots=slots,
                return_steps=True,
            )

        return jax.vmap(one)(xs)

    (c1, n1), (c2, n2) = run(W, "auto", slots), run(W, "masked", None)
    tree_allclose(c1, c2)
    np.testing.assert_array_equal(n1, n2)
    assert len(set(np.asarray(n1).tolist())) > 1  # the samples really stop at different steps
    g = jax.grad(lambda W: jnp.sum(run(W, "auto", slots)[0]))(W)
    g_ref = jax.grad(lambda W: jnp.sum(run(W, "masked", None)[0]))(W)
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)


def test_while_loop_scheduled_work_uniform_stopping_times():
    """Per-sample stopping times uniform in [1, 100]: executed <= 1.15 x the steps taken."""
    B = 256
    stops = uniform_depths(jax.random.PRNGKey(5), B, 100).astype(jnp.float32)
    calls = []

    def body(c):
        jax.debug.callback(lambda v: calls.append(1), c[0])
        return c + jnp.array([1.0, 0.0])

    def run(init):
        return jax.vmap(
            lambda c: dyndepth.while_loop(
                lambda c: c[0] < c[1], body, c, max_steps=100, slots=32, return_steps=True
            )
        )(init)

    init = jnp.stack([jnp.zeros(B), stops], axis=1)
    _, steps = jax.jit(run)(init)
    np.testing.assert_array_equal(steps, stops.astype(jnp.int32))
    assert len(calls) <= 1.15 * int(steps.sum()), (len(calls), int(steps.sum()))


def test_repeat_batched_sums_shared_grads_and_composes_with_outer_vmap(data):
    W, xs, ds, ks = data

    def loss(W, xs, ds):
        return jnp.sum(dyndepth.repeat_batched(make_layer(W), xs, ds, max_depth=M, keys=ks) ** 2)

    def ref(W, xs, ds):
        return jnp.sum(batch_run(W, xs, ds, ks, "masked") ** 2)

    tree_allclose(jax.grad(loss)(W, xs, ds), jax.grad(ref)(W, xs, ds), rtol=1e-4, atol=1e-4)
    # An outer vmap over two batches, each with its own gradient of the shared W.
    xs2, ds2 = jnp.stack([xs, 0.5 * xs]), jnp.stack([ds, jnp.flip(ds)])
    g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(W, xs2, ds2)
    g_ref = jax.vmap(jax.grad(ref), in_axes=(None, 0, 0))(W, xs2, ds2)
    tree_allclose(g, g_ref, rtol=1e-4, atol=1e-4)
    assert not bool(jnp.allclose(g[0], g[1]))


@pytest.mark.parametrize("way", ["grad(vmap(repeat))", "grad(repeat_batched)"])
def test_grad_of_vmap_keeps_no_per_sample_copy_of_a_shared_weight(way):
    """The natural API is the fast one: under ``grad(vmap(repeat))`` the gradient of a weight
    the step closes over is summed inside the backward loop (one accumulator), as with
    ``repeat_batched``. Per-sample copies of a 256 x 256 weight for 64 samples would take
    16 MiB of temp memory; the compiled program takes less than a sixth of that."""
    B, dim, T = 64, 256, 8
    W = jax.random.normal(jax.random.PRNGKey(0), (dim, dim)) / 16
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, dim))
    ds = jax.random.randint(jax.random.PRNGKey(2), (B,), 1, T + 1)

    def step(W):
        return lambda c: c + jnp.tanh(c @ W)

    def loss(W):
        if way == "grad(repeat_batched)":
            out = dyndepth.repeat_batched(step(W), xs, ds, max_depth=T)
        else:
            out = jax.vmap(lambda x, d: dyndepth.repeat(step(W), x, d, max_depth=T))(xs, ds)
        return jnp.sum(out**2)

    compiled = jax.jit(jax.grad(loss)).lower(W).compile()
    copies = B * W.size * W.dtype.itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < copies / 6
