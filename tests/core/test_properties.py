"""Property-based tests: random pytree carries, depths, checkpoint budgets, batches and slots.

Every strategy of ``repeat``, ``scan`` and ``while_loop``, and ``repeat_batched`` (the per-sample
scheduler), must agree with the plain-Python reference loops in ``helpers`` in value, unbatched
and under ``jax.vmap`` with per-sample depths; every differentiable strategy must agree with
``"masked"`` in gradient, and ``jax.test_util.check_grads`` must accept the reverse mode of the
non-masked ones.

Compiles dominate the cost, so each example builds one jitted function holding every strategy
for its static configuration (carry structure, batch, ``max_depth``, ``checkpoints``, ``slots``)
and then feeds it several depth vectors as runtime values: a new depth never retraces (asserted
by a trace counter). Examples are few and shapes tiny.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from helpers import applicable, reference_repeat, reference_scan, reference_while, tree_allclose
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads
from shared_lists import GRAD_STRATEGIES, STRATEGIES

import dyndepth as dd

# Fewer draws per property in `make test` (every draw compiles); `make test-full` draws more.
DRAWS = 2 if os.environ.get("DYNDEPTH_FULL") == "1" else 1
VTOL = dict(rtol=1e-4, atol=1e-5)
GTOL = dict(rtol=1e-4, atol=1e-4)
# No example database: nothing is written into the working tree, and every run is a fresh draw.
SETTINGS = dict(
    deadline=None,
    database=None,
    # Every example compiles; shrinking a failure can take many minutes. The failing example is
    # reported as drawn.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ----------------------------------------------------------------------------- random carries


@dataclasses.dataclass(frozen=True)
class Leaf:
    """Spec of one carry leaf (a pytree leaf itself: dataclasses are not pytree nodes)."""

    kind: str  # "f" float32, "i" int32, "u" uint8, "b" bool
    shape: tuple[int, ...]


SHAPES = [(), (0,), (2,), (1, 3), (2, 0)]
leaf_specs = st.builds(Leaf, st.sampled_from(["f", "f", "i", "u", "b"]), st.sampled_from(SHAPES))
tree_specs = st.recursive(
    st.one_of(leaf_specs, st.just(None)),
    lambda children: st.one_of(
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abc"), children, min_size=1, max_size=3),
    ),
    max_leaves=5,
)
# The root always holds one float leaf, so there is something to differentiate.
carry_specs = st.tuples(st.builds(Leaf, st.just("f"), st.sampled_from([(), (2,)])), tree_specs)


def make_carry(spec, batch: int | None, seed: int):
    """Arrays for ``spec``, with a leading axis of size ``batch`` (or none)."""
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)

    def make(leaf: Leaf):
        shape = lead + leaf.shape
        if leaf.kind == "f":
            return jnp.asarray(rng.normal(size=shape) * 0.7, jnp.float32)
        if leaf.kind == "i":
            return jnp.asarray(rng.integers(-3, 4, size=shape), jnp.int32)
        if leaf.kind == "u":
            return jnp.asarray(rng.integers(0, 250, size=shape), jnp.uint8)
        return jnp.asarray(rng.random(size=shape) < 0.5)

    return jax.tree_util.tree_map(make, spec)


def is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def make_body(w):
    """One step on a sample: float leaves mix with each other and with the integer leaves; int
    leaves change by integer arithmetic only; bool leaves flip on the parity of the ints."""

    def f(c, k=None):
        leaves, tree = jax.tree_util.tree_flatten(c)
        m = 0.1 * sum(jnp.sum(jnp.tanh(x)) for x in leaves if is_float(x))
        q = sum(jnp.sum(x.astype(jnp.int32)) for x in leaves if not is_float(x))
        qf = 0.01 * jnp.asarray(q, jnp.int32).astype(jnp.float32)
        out = []
        for j, x in enumerate(leaves):
            if is_float(x):
                y = x + 0.5 * jnp.tanh(w * x + m) + qf
                if k is not None:
                    y = y + 0.1 * jax.random.uniform(jax.random.fold_in(k, j), x.shape)
                out.append(y)
            elif x.dtype == jnp.bool_:
                out.append(jnp.logical_xor(x, jnp.asarray(q, jnp.int32) % 2 == 1))
            else:
                out.append((x * 3 + 1) % 7)
        return jax.tree_util.tree_unflatten(tree, out)

    return f


def keyed(f, use_key):
    return f if use_key else (lambda c: f(c))


def sample(tree, b):
    return jax.tree_util.tree_map(lambda a: a[b], tree)


def float_split(tree):
    """``(float leaves, rebuild)``: rebuild(new float leaves) puts them back beside the others."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    mask = [is_float(x) for x in leaves]

    def rebuild(floats):
        it = iter(floats)
        return jax.tree_util.tree_unflatten(
            treedef, [next(it) if m else x for x, m in zip(leaves, mask, strict=True)]
        )

    return [x for x, m in zip(leaves, mask, strict=True) if m], rebuild


def sq_loss(out):
    return sum(0.5 * jnp.sum(x**2) for x in jax.tree_util.tree_leaves(out) if is_float(x))


@dataclasses.dataclass(frozen=True)
class Config:
    spec: object
    batch: int
    max_depth: int
    checkpoints: int | None
    slots: int | tuple[int, ...] | None
    use_key: bool


def slot_args(batch: int):
    """``slots``: None, one count, or a sequence of counts (some may reach the batch)."""
    count = st.integers(1, batch + 1)
    return st.one_of(st.none(), count, st.lists(count, min_size=1, max_size=3).map(tuple))


@st.composite
def configs(draw, min_depth: int = 0):
    max_depth = st.integers(min_depth, 5)
    batch = draw(st.integers(1, 4))
    return Config(
        spec=draw(carry_specs),
        batch=batch,
        max_depth=draw(max_depth),
        checkpoints=draw(st.sampled_from([None, 1, 2, 3, 8])),
        slots=draw(slot_args(batch)),
        use_key=draw(st.booleans()),
    )


def depth_vectors(draw, cfg: Config):
    """Two per-sample depth vectors: a drawn one and the edges 0 / max_depth alternating."""
    drawn = draw(st.lists(st.integers(0, cfg.max_depth), min_size=cfg.batch, max_size=cfg.batch))
    edges = [cfg.max_depth * (b % 2) for b in range(cfg.batch)][::-1]
    return [jnp.asarray(d, jnp.int32) for d in (drawn, edges)]


def batch_keys(cfg: Config, seed: int):
    return jax.random.split(jax.random.key(seed), cfg.batch)


# ----------------------------------------------------------------------------- repeat: values


def repeat_all(cfg: Config, traces: list):
    """One jitted function: every strategy vmapped and unbatched, and repeat_batched."""
    M, ck, slots = cfg.max_depth, cfg.checkpoints, cfg.slots

    @jax.jit
    def run(inits, w, depths, keys):
        traces.append(None)
        f = keyed(make_body(w), cfg.use_key)
        out = {}
        for s in STRATEGIES:

            def one(c, d, k, s=s):
                k = k if cfg.use_key else None
                opts = dict(max_depth=M, key=k, strategy=s, **applicable(s, ck, slots))
                return dd.repeat(f, c, d, **opts)

            out[f"vmap-{s}"] = jax.vmap(one)(inits, depths, keys)
            out[f"single-{s}"] = one(sample(inits, 0), depths[0], keys[0])
        out["repeat_batched"] = dd.repeat_batched(
            f,
            inits,
            depths,
            max_depth=M,
            keys=keys if cfg.use_key else None,
            slots=slots,
            checkpoints=ck,
        )
        return out

    return run


@settings(max_examples=6 * DRAWS, **SETTINGS)
@given(data=st.data())
def test_repeat_values_match_reference(data):
    cfg = data.draw(configs())
    seed = data.draw(st.integers(0, 2**16))
    inits = make_carry(cfg.spec, cfg.batch, seed)
    keys = batch_keys(cfg, seed)
    w = jnp.float32(data.draw(st.floats(-1.5, 1.5)))
    traces: list = []
    run = repeat_all(cfg, traces)
    ref_body = keyed(make_body(w), cfg.use_key)
    for depths in depth_vectors(data.draw, cfg):
        out = run(inits, w, depths, keys)
        expected = [
            reference_repeat(
                ref_body, sample(inits, b), int(depths[b]), key=keys[b] if cfg.use_key else None
            )
            for b in range(cfg.batch)
        ]
        for name, got in out.items():
            rows = [0] if name.startswith("single") else range(cfg.batch)
            for b in rows:
                got_b = got if name.startswith("single") else sample(got, b)
                tree_allclose(got_b, expected[b], **VTOL, err_msg=f"{name}, {cfg}, sample {b}")
    assert len(traces) == 1, "a new depth vector retraced"


# ----------------------------------------------------------------------------- scan, while_loop


def scan_while_all(cfg: Config, traces: list):
    """Jitted: ``scan`` (xs per step, pytree ys incl. an int row) vmapped per strategy and
    unbatched, and ``while_loop`` vmapped with a per-sample stop written into the carry."""
    M, ck, slots = cfg.max_depth, cfg.checkpoints, cfg.slots

    @jax.jit
    def run(inits, xs, w, depths, keys):
        traces.append(None)
        f = make_body(w)
        out = {}
        for s in STRATEGIES:

            def one_scan(c, d, k, s=s):
                def g(c, x, k=None):
                    c = f(c, k)
                    head, rest = c
                    head = head + 0.1 * x
                    return (head, rest), {"s": jnp.sum(head) * x, "n": jnp.int32(1)}

                fn = g if cfg.use_key else (lambda c, x: g(c, x))
                k = k if cfg.use_key else None
                opts = dict(depth=d, key=k, strategy=s, **applicable(s, ck, slots))
                return dd.scan(fn, c, xs, **opts)

            def one_while(c, d, k, s=s):
                def body(state, k=None):
                    c, i, target = state
                    return f(c, k), i + 1, target

                fn = body if cfg.use_key else (lambda state: body(state))
                k = k if cfg.use_key else None
                return dd.while_loop(
                    lambda state: state[1] < state[2],
                    fn,
                    (c, jnp.int32(0), d),
                    max_steps=M,
                    key=k,
                    strategy=s,
                    return_steps=True,
                    **applicable(s, ck, slots),
                )

            out[f"scan-vmap-{s}"] = jax.vmap(one_scan)(inits, depths, keys)
            out[f"scan-single-{s}"] = one_scan(sample(inits, 0), depths[0], keys[0])
            out[f"while-vmap-{s}"] = jax.vmap(one_while)(inits, depths, keys)
        return out

    return run


@settings(max_examples=4 * DRAWS, **SETTINGS)
@given(data=st.data())
def test_scan_and_while_loop_values_match_reference(data):
    cfg = data.draw(configs())
    seed = data.draw(st.integers(0, 2**16))
    inits = make_carry(cfg.spec, cfg.batch, seed)
    keys = batch_keys(cfg, seed)
    xs = jnp.linspace(-1.0, 1.0, cfg.max_depth, dtype=jnp.float32)
    w = jnp.float32(data.draw(st.floats(-1.5, 1.5)))
    traces: list = []
    run = scan_while_all(cfg, traces)
    f = make_body(w)

    def ref_scan_body(c, x, k=None):
        head, rest = f(c, k)
        head = head + 0.1 * x
        return (head, rest), {"s": jnp.sum(head) * x, "n": jnp.int32(1)}

    def ref_while_body(state, k=None):
        c, i, target = state
        return f(c, k), i + 1, target

    for depths in depth_vectors(data.draw, cfg):
        out = run(inits, xs, w, depths, keys)
        for b in range(cfg.batch):
            d, key = int(depths[b]), keys[b] if cfg.use_key else None
            exp_scan = reference_scan(
                ref_scan_body if cfg.use_key else (lambda c, x: ref_scan_body(c, x)),
                sample(inits, b),
                xs,
                d,
                cfg.max_depth,
                key=key,
            )
            init_w = (sample(inits, b), jnp.int32(0), depths[b])
            (exp_c, _, _), exp_steps = reference_while(
                lambda state: state[1] < state[2],
                ref_while_body if cfg.use_key else (lambda state: ref_while_body(state)),
                init_w,
                cfg.max_depth,
                key=key,
            )
            assert exp_steps == d
            for s in STRATEGIES:
                msg = f"{s}, {cfg}, sample {b}"
                tree_allclose(sample(out[f"scan-vmap-{s}"], b), exp_scan, **VTOL, err_msg=msg)
                (got_c, got_i, _), got_steps = sample(out[f"while-vmap-{s}"], b)
                tree_allclose(got_c, exp_c, **VTOL, err_msg=f"while {msg}")
                assert int(got_i) == d == int(got_steps), msg
                if b == 0:
                    got = out[f"scan-single-{s}"]
                    tree_allclose(got, exp_scan, **VTOL, err_msg=f"single {msg}")
    assert len(traces) == 1, "a new depth vector retraced"


# ----------------------------------------------------------------------------- gradients


def grads_all(cfg: Config, traces: list):
    """Jitted gradients w.r.t. the float leaves of init and the closed-over ``w``, per strategy
    (vmapped loss over per-sample depths and unbatched on sample 0) and for repeat_batched."""
    M, ck, slots = cfg.max_depth, cfg.checkpoints, cfg.slots

    @jax.jit
    def run(inits, w, depths, keys):
        traces.append(None)
        floats, rebuild = float_split(inits)

        def opts(k, s):
            k = k if cfg.use_key else None
            return dict(max_depth=M, key=k, strategy=s, **applicable(s, ck, slots))

        out = {}
        for s in GRAD_STRATEGIES:

            def vloss(floats, w, s=s):
                f = keyed(make_body(w), cfg.use_key)
                one = lambda c, d, k: dd.repeat(f, c, d, **opts(k, s))
                return sq_loss(jax.vmap(one)(rebuild(floats), depths, keys))

            def sloss(floats0, w, s=s):
                f = keyed(make_body(w), cfg.use_key)
                c0 = sample(rebuild(floats), 0)
                _, rebuild0 = float_split(c0)
                return sq_loss(dd.repeat(f, rebuild0(floats0), depths[0], **opts(keys[0], s)))

            out[f"vmap-{s}"] = jax.grad(vloss, argnums=(0, 1))(floats, w)
            out[f"single-{s}"] = jax.grad(sloss, argnums=(0, 1))([x[0] for x in floats], w)

        def bloss(floats, w):
            f = keyed(make_body(w), cfg.use_key)
            out = dd.repeat_batched(
                f,
                rebuild(floats),
                depths,
                max_depth=M,
                keys=keys if cfg.use_key else None,
                slots=slots,
                checkpoints=ck,
            )
            return sq_loss(out)

        out["repeat_batched"] = jax.grad(bloss, argnums=(0, 1))(floats, w)
        return out

    return run


@settings(max_examples=5 * DRAWS, **SETTINGS)
@given(data=st.data())
def test_gradients_agree_with_masked(data):
    cfg = data.draw(configs(min_depth=1))
    seed = data.draw(st.integers(0, 2**16))
    inits = make_carry(cfg.spec, cfg.batch, seed)
    keys = batch_keys(cfg, seed)
    w = jnp.float32(data.draw(st.floats(-1.5, 1.5)))
    traces: list = []
    run = grads_all(cfg, traces)
    for depths in depth_vectors(data.draw, cfg):
        g = run(inits, w, depths, keys)
        for name, got in g.items():
            base = "single-masked" if name.startswith("single") else "vmap-masked"
            if name == "repeat_batched":
                base = "vmap-masked"
            tree_allclose(got, g[base], **GTOL, err_msg=f"{name}, {cfg}, depths={depths}")
            assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(got))
    assert len(traces) == 1, "a new depth vector retraced"


# ----------------------------------------------------------------------------- check_grads

W_MAT = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)) * 0.5, jnp.float32)


def mat_body(W):
    def f(c, k):
        x, n = c
        noise = jax.random.normal(k, x.shape)
        return x + jnp.tanh(x @ W) * (1.0 + 0.1 * noise), n + 1

    return f


@settings(max_examples=3 * DRAWS, **SETTINGS)
@given(
    batch=st.integers(1, 3),
    checkpoints=st.sampled_from([None, 1, 2]),
    slots=slot_args(3),
    depth_lists=st.lists(
        st.lists(st.integers(0, 4), min_size=3, max_size=3), min_size=1, max_size=2
    ),
    kind=st.sampled_from(["single-checkpointed", "vmap-checkpointed", "vmap-auto", "batched"]),
)
def test_check_grads_reverse_mode(batch, checkpoints, slots, depth_lists, kind):
    """``jax.test_util.check_grads`` (reverse mode, order 1: the VJP against central
    differences) on a tanh residual body with per-step noise and an int leaf, w.r.t. the
    float init and the closed-over matrix. Float32, hence ``eps=1e-2`` and loose tolerances."""
    M = 4
    X = jnp.asarray(np.random.default_rng(batch).normal(size=(batch, 3)), jnp.float32)
    N = jnp.zeros((batch,), jnp.int32)
    keys = jax.random.split(jax.random.key(7), batch)
    opts = dict(max_depth=M, checkpoints=checkpoints)

    @jax.jit
    def loss(X, W, depths):
        f = mat_body(W)
        if kind == "single-checkpointed":
            x, _ = dd.repeat(
                f, (X[0], N[0]), depths[0], key=keys[0], strategy="checkpointed", **opts
            )
            return jnp.sum(jnp.sin(x))
        if kind == "batched":
            x, _ = dd.repeat_batched(f, (X, N), depths[:batch], keys=keys, slots=slots, **opts)
        else:
            strategy = kind.split("-")[1]
            more = applicable(strategy, checkpoints, slots)
            x, _ = jax.vmap(
                lambda x, n, d, k: dd.repeat(
                    f, (x, n), d, max_depth=M, key=k, strategy=strategy, **more
                )
            )(X, N, depths[:batch], keys)
        return jnp.sum(jnp.sin(x))

    for depths in depth_lists[:2]:
        depths = jnp.asarray(depths, jnp.int32)
        check_grads(
            lambda X, W, depths=depths: loss(X, W, depths),
            (X, W_MAT),
            order=1,
            modes=["rev"],
            eps=1e-2,
            atol=2e-2,
            rtol=2e-2,
        )
