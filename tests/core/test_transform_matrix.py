"""The transform matrix: every loop, strategy and ``checkpoints`` setting under every composition of
``grad``, ``vmap``, ``jacrev`` and ``jvp`` that users write, against plain-Python references.

Each *case* gives, for one sample, a dyndepth function ``fn(params, x, depth, key)`` and its
reference, an eager Python loop using nothing from dyndepth (``depth`` a concrete integer). Each
*transform* is written once and applied to both: it receives the ``vmap`` to use, ``jax.vmap``
for dyndepth and :func:`python_vmap` (a Python loop over the batch, which keeps every depth
concrete) for the reference. The cases run through every transform, so a wrong batching, JVP,
partial-evaluation or transpose rule shows up as a mismatch naming the loop, the strategy, the
checkpointing and the composition.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from helpers import (
    conditional_branches,
    reference_repeat,
    reference_scan,
    reference_while,
    tree_allclose,
)
from shared_lists import cfg_id, covering

import dyndepth as dd

B = 3  # samples
G = 2  # groups, for the transforms with two batch axes
DIM = 2
MAX = 4
H = 2  # loss heads: the inner vmap of vmap(vmap(grad)) batches only the cotangent
TOL = dict(rtol=2e-5, atol=2e-5)

PARAMS = {
    "W": jax.random.normal(jax.random.PRNGKey(0), (DIM, DIM)) * 0.7,
    "b": jax.random.normal(jax.random.PRNGKey(1), (DIM,)) * 0.3,
}
X = jax.random.normal(jax.random.PRNGKey(2), (G * B, DIM))
# Per-sample depths with 0 and MAX; distinct neighbours, so a mixed-up sample shows.
DEPTHS = jnp.array([2, 0, MAX, 1, 3, MAX], jnp.int32)
# Depths within 2 stored carries (a configuration's third entry "within"): with
# ``checkpoints=2`` every sample keeps every carry, and a batch's backward pass is that of a
# loop storing every carry (``dyndepth._budget.every_carry``) where the depths above thin.
WITHIN = jnp.array([2, 0, 1, 2, 1, 0], jnp.int32)
KEYS = jax.random.split(jax.random.PRNGKey(3), G * B)
HEADS = jax.random.normal(jax.random.PRNGKey(4), (H, DIM))
SEQ = jax.random.normal(jax.random.PRNGKey(5), (G * B, MAX, DIM))


def python_vmap(fn, in_axes):
    """``jax.vmap`` as a Python loop over the batch (axis 0 or None per positional argument)."""

    def mapped(*args):
        size = next(jnp.shape(jax.tree_util.tree_leaves(a)[0])[0]
                    for a, ax in zip(args, in_axes, strict=True) if ax == 0)  # fmt: skip
        outs = []
        for i in range(size):
            sliced = [
                jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], a) if ax == 0 else a
                for a, ax in zip(args, in_axes, strict=True)
            ]
            outs.append(fn(*sliced))
        return jax.tree_util.tree_map(lambda *rows: jnp.stack(rows), *outs)

    return mapped


def loss(out):
    return sum(jnp.sum(jnp.sin(leaf)) for leaf in jax.tree_util.tree_leaves(out))


# ----------------------------------------------------------------------------- cases


def layer(p, c, k):
    return jnp.tanh(c @ p["W"] + p["b"]) + 0.1 * jax.random.normal(k, c.shape)


def repeat_case(strategy, ckpt):
    def fn(p, x, d, k):
        return dd.repeat(lambda c, kk: layer(p, c, kk), x, d, max_depth=MAX, key=k,
                         strategy=strategy, checkpoints=ckpt)  # fmt: skip

    def ref(p, x, d, k):
        return reference_repeat(lambda c, kk: layer(p, c, kk), x, int(d), key=k)

    return fn, ref


def scan_case(strategy, ckpt):
    def body(p, c, s, k):
        c = layer(p, c, k) * s
        return c, jnp.sum(c * s)

    def fn(p, x, d, k, seq):
        return dd.scan(lambda c, s, kk: body(p, c, s, kk), x, seq, depth=d, key=k,
                       strategy=strategy, checkpoints=ckpt)  # fmt: skip

    def ref(p, x, d, k, seq):
        return reference_scan(lambda c, s, kk: body(p, c, s, kk), x, seq, int(d), MAX, key=k)

    return fn, ref


def while_case(strategy, ckpt):
    # The stop rule reads the carry (a step counter) and a per-sample depth it closes over.
    def cond(d):
        return lambda s: (s[1] < d) & (jnp.max(jnp.abs(s[0])) < 50.0)

    def body(p):
        return lambda s, kk: (layer(p, s[0], kk), s[1] + 1)

    def fn(p, x, d, k):
        return dd.while_loop(cond(d), body(p), (x, jnp.int32(0)), max_steps=MAX, key=k,
                             strategy=strategy, checkpoints=ckpt)[0]  # fmt: skip

    def ref(p, x, d, k):
        return reference_while(cond(int(d)), body(p), (x, jnp.int32(0)), MAX, key=k)[0][0]

    return fn, ref


def layer_drop_case(strategy, ckpt):
    stack = {"W": jnp.stack([PARAMS["W"], PARAMS["W"].T, -PARAMS["W"], PARAMS["W"] * 0.5])}

    def lay(q, x):
        return x + jnp.tanh(x @ q["W"])

    # The per-sample depth picks the rate: depth 0 drops nothing, larger depths drop more.
    def rate(d):
        return 0.2 * d.astype(jnp.float32) / MAX if hasattr(d, "astype") else 0.2 * d / MAX

    def fn(p, x, d, k):
        s = {"W": stack["W"] + p["W"]}
        return dd.nn.layer_drop(lay, s, x, k, rate(d), strategy=strategy, checkpoints=ckpt)

    def ref(p, x, d, k):
        s = {"W": stack["W"] + p["W"]}
        keep = jax.random.bernoulli(k, 1.0 - jnp.full((4,), rate(int(d)), jnp.float32))
        for i in range(4):
            if bool(keep[i]):
                x = lay({"W": s["W"][i]}, x)
        return x

    return fn, ref


def recurrent_case(strategy, ckpt):
    # n frozen iterations (no gradient), then k with gradient; n and k come from the depth.
    def core(p, s, x, kk):
        return layer(p, s + x, kk)

    def fn(p, x, d, k):
        n, kd = d // 2, d - d // 2
        return dd.nn.recurrent_depth(lambda s, xx, kk: core(p, s, xx, kk), x, x, n=n, k=kd,
                                     max_n=MAX // 2, max_k=MAX - MAX // 2, key=k,
                                     strategy=strategy, checkpoints=ckpt)  # fmt: skip

    def ref(p, x, d, k):
        d = int(d)
        n, kd = d // 2, d - d // 2
        s = x
        for j in range(n):
            s = core(
                jax.lax.stop_gradient(p), s, jax.lax.stop_gradient(x), jax.random.fold_in(k, j)
            )
        if n:
            s = jax.lax.stop_gradient(s)
        for j in range(kd):
            s = core(p, s, x, jax.random.fold_in(k, n + j))
        return s

    return fn, ref


CASES = {
    "repeat": repeat_case,
    "scan": scan_case,
    "while_loop": while_case,
    "layer_drop": layer_drop_case,
    "recurrent_depth": recurrent_case,
}


def sample_args(case, depths=DEPTHS):
    """Per-sample arguments after ``params``: (x, depth, key[, seq])."""
    if case == "scan":
        return (X, depths, KEYS, SEQ)
    return (X, depths, KEYS)


# ----------------------------------------------------------------------------- transforms
# Each transform: (vmap, fn, params, args) -> result; args are batched over G * B samples.


def first(args):
    return tuple(a[0] for a in args)


def head(args, n=B):
    return tuple(a[:n] for a in args)


def grouped(args):
    return tuple(a.reshape((G, B) + a.shape[1:]) for a in args)


def axes(args, batched=0):
    return (None,) + (batched,) * len(args)


def t_grad(vmap, fn, p, args):
    return jax.grad(lambda p: loss(fn(p, *first(args))))(p)


def t_vmap_grad(vmap, fn, p, args):
    g = jax.grad(lambda p, *a: loss(fn(p, *a)))
    return vmap(g, axes(args))(p, *head(args))


def t_grad_vmap(vmap, fn, p, args):
    return jax.grad(lambda p: loss(vmap(fn, axes(args))(p, *head(args))))(p)


def t_jacrev(vmap, fn, p, args):
    return jax.jacrev(fn, argnums=(0, 1))(p, *first(args))


def t_vmap_jacrev(vmap, fn, p, args):
    return vmap(jax.jacrev(fn, argnums=(0, 1)), axes(args))(p, *head(args))


def t_jacrev_vmap(vmap, fn, p, args):
    return jax.jacrev(lambda p: vmap(fn, axes(args))(p, *head(args)))(p)


def t_vmap_vmap_grad_cotangent(vmap, fn, p, args):
    """Per-sample gradients of several loss heads: the inner vmap batches only the head."""

    def per_head(hd, p, *a):
        return jax.grad(lambda p: jnp.sum(jnp.sin(jax.tree_util.tree_leaves(fn(p, *a))[0]) * hd))(p)

    def per_sample(p, *a):
        return vmap(per_head, (0, None) + (None,) * len(a))(HEADS, p, *a)

    return vmap(per_sample, axes(args))(p, *head(args))


def t_vmap_grad_vmap(vmap, fn, p, args):
    """Per-group gradients of a batched loss: vmap over groups of grad of vmap over samples."""

    def group_grad(p, *a):
        return jax.grad(lambda p: loss(vmap(fn, axes(a))(p, *a)))(p)

    return vmap(group_grad, axes(args))(p, *grouped(args))


def t_grad_vmap_vmap(vmap, fn, p, args):
    inner = lambda p, *a: vmap(fn, axes(a))(p, *a)  # noqa: E731
    return jax.grad(lambda p: loss(vmap(inner, axes(args))(p, *grouped(args))))(p)


def t_grad_shared_depth(vmap, fn, p, args):
    """Mixed batching: samples batched, one depth for all of them."""
    x, d, k, *rest = head(args)
    in_axes = (None, 0, None, 0) + (0,) * len(rest)
    return jax.grad(lambda p: loss(vmap(fn, in_axes)(p, x, d[2], k, *rest)))(p)


def t_vmap_grad_per_sample_params(vmap, fn, p, args):
    """Per-sample parameters (a batched closed-over weight) with a shared input."""
    ps = jax.tree_util.tree_map(lambda a: jnp.stack([a, -a, 0.5 * a]), p)
    x, d, k, *rest = head(args)
    in_axes = (0, None, 0, 0) + (0,) * len(rest)
    g = jax.grad(lambda p, *a: loss(fn(p, *a)))
    return vmap(g, in_axes)(ps, x[0], d, k, *rest)


def t_value_nested_vmap(vmap, fn, p, args):
    inner = lambda p, *a: vmap(fn, axes(a))(p, *a)  # noqa: E731
    return vmap(inner, axes(args))(p, *grouped(args))


def t_jvp_vmap(vmap, fn, p, args):
    tangent = jax.tree_util.tree_map(jnp.ones_like, p)
    return jax.jvp(lambda p: vmap(fn, axes(args))(p, *head(args)), (p,), (tangent,))


def t_jacfwd(vmap, fn, p, args):
    return jax.jacfwd(fn, argnums=(0, 1))(p, *first(args))


REVERSE = {
    "grad": t_grad,
    "vmap(grad)": t_vmap_grad,
    "grad(vmap)": t_grad_vmap,
    "jacrev": t_jacrev,
    "vmap(jacrev)": t_vmap_jacrev,
    "jacrev(vmap)": t_jacrev_vmap,
    "vmap(vmap(grad)) cotangent-only inner": t_vmap_vmap_grad_cotangent,
    "vmap(grad(vmap))": t_vmap_grad_vmap,
    "grad(vmap(vmap))": t_grad_vmap_vmap,
    "grad(vmap) shared depth": t_grad_shared_depth,
    "vmap(grad) per-sample params": t_vmap_grad_per_sample_params,
}
FORWARD = {
    "vmap(vmap)": t_value_nested_vmap,
    "jvp(vmap)": t_jvp_vmap,
    "jacfwd": t_jacfwd,
}
CONFIGS = [("masked", None), ("checkpointed", None), ("checkpointed", 2), ("auto", None),
           ("auto", 2), ("auto", 2, "within"), ("checkpointed", 2, "within"),
           ("while", None)]  # fmt: skip
# (those with reverse mode: "while" raises under every reverse-mode transformation)
REVERSE_CONFIGS = [c for c in CONFIGS if c[0] != "while"]


DEPTH_SETS = {"all": DEPTHS, "within": WITHIN}


def depth_set(cfg):
    """The name of a configuration's depths: its third entry, or ``"all"``."""
    return cfg[2] if cfg[2:] else "all"


def depths_of(cfg):
    return DEPTH_SETS[depth_set(cfg)]


@functools.cache
def expected(case, transform, depths="all"):
    """The reference result on a set of depths (it does not depend on the strategy: computed
    once per session)."""
    _, ref = CASES[case]("masked", None)
    return transform(python_vmap, ref, PARAMS, sample_args(case, DEPTH_SETS[depths]))


def check(case, cfg, transform, program=None):
    """The transformed dyndepth function against the reference; ``program``, if given, is
    called with the compiled program's text first."""
    fn, _ = CASES[case](*cfg[:2])
    args = sample_args(case, depths_of(cfg))
    compiled = jax.jit(lambda p, *a: transform(jax.vmap, fn, p, a)).lower(PARAMS, *args).compile()
    if program is not None:
        program(compiled.as_text())
    want = expected(case, transform, depth_set(cfg))
    tree_allclose(compiled(PARAMS, *args), want, **TOL,
                  err_msg=f"{case} {cfg_id(cfg)} {transform.__name__}")  # fmt: skip


def matrix(transforms, configs):
    """``(case, transform, config)`` triples. ``DYNDEPTH_FULL=1`` (``make test-full``):
    all of them. Otherwise a covering subset that keeps ``make test`` short: every case under
    every transform once, the configuration rotating, so that every case also meets every
    configuration (twice or more under the reverse transforms) and every transform meets
    several."""
    return covering(list(CASES), transforms, configs)


def ids(triple):
    case, name, cfg = triple
    return f"{case}-{name}-{cfg_id(cfg)}"


@pytest.mark.parametrize(
    ("case", "name", "cfg"),
    matrix(list(REVERSE), REVERSE_CONFIGS),
    ids=[ids(t) for t in matrix(list(REVERSE), REVERSE_CONFIGS)],
)
def test_reverse_mode_matrix(case, name, cfg):
    check(case, cfg, REVERSE[name])


@pytest.mark.parametrize(
    ("case", "name", "cfg"),
    matrix(list(FORWARD), CONFIGS),
    ids=[ids(t) for t in matrix(list(FORWARD), CONFIGS)],
)
def test_forward_matrix(case, name, cfg):
    check(case, cfg, FORWARD[name])


# A platform's kernels differ from this CPU's where it decides (dyndepth._cost): a TPU chains
# the slot counts' loops (keeps_loop_state_in_fast_memory) where this CPU and a GPU put them
# under one conditional; a GPU writes a thinned lockstep store without conditionals, and a
# wrap-around pass's store in schedule order only where the loop's shapes make it fit
# (conditionals_on_device). Emulated here by the platform the kernels are traced for, with the
# tests' iteration cost, under which a ladder has several counts. The loops that choose among
# slot counts (repeat, scan and recurrent_depth's), under the transforms that batch them per
# sample; under two levels the count is chosen once for every outer element, which keeps the
# conditionals (a choice per element would turn them into selects).
PLATFORMS = ["tpu", "cuda"]
PLATFORM_CASES = ["repeat", "scan", "recurrent_depth"]
BATCHED = [
    "vmap(grad)",
    "grad(vmap)",
    "vmap(jacrev)",
    "jacrev(vmap)",
    "vmap(vmap(grad)) cotangent-only inner",
    "vmap(grad(vmap))",
    "grad(vmap(vmap))",
    "vmap(grad) per-sample params",
    "vmap(vmap)",
    "jvp(vmap)",
]
PLATFORM_TRANSFORMS = {name: {**REVERSE, **FORWARD}[name] for name in BATCHED}
PLATFORM_CONFIGS = [c for c in CONFIGS if c[0] == "auto"]
PLATFORM_MATRIX = covering(PLATFORMS, list(PLATFORM_TRANSFORMS), PLATFORM_CASES, PLATFORM_CONFIGS)


def the_platforms_ladder(platform):
    """A check of the compiled program's ladder forward: B=3 samples make a ladder of three
    counts (3, 2, 1); a GPU chooses among them with one conditional of three branches, a TPU
    chains their loops, each count's set-up under a conditional of two (the set-up, or
    nothing). (A thinned store's backward passes are under conditionals on both.)"""

    def check_program(hlo):
        branches = conditional_branches(hlo, "dyndepth_forward")
        assert (3 not in branches and 2 in branches) if platform == "tpu" else 3 in branches, (
            branches
        )

    return check_program


@pytest.mark.parametrize(
    ("platform", "name", "case", "cfg"),
    PLATFORM_MATRIX,
    ids=[f"{p}-{ids((c, n, g))}" for p, n, c, g in PLATFORM_MATRIX],
)
def test_platform_kernels_matrix(trace_kernels_for, platform, name, case, cfg):
    trace_kernels_for(platform)
    check(case, cfg, PLATFORM_TRANSFORMS[name], program=the_platforms_ladder(platform))


@pytest.mark.parametrize("name", list(REVERSE))
def test_while_strategy_rejects_every_reverse_mode(name):
    fn, _ = repeat_case("while", None)
    with pytest.raises(TypeError, match="checkpointed"):
        jax.jit(lambda p, *a: REVERSE[name](jax.vmap, fn, p, a))(PARAMS, *sample_args("repeat"))


def test_the_guarantees_page_counts_this_matrix():
    """docs/guarantees.md gives the matrix's sizes under ``make test`` and ``make test-full``."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "guarantees.md").read_text()
    full = len(CASES) * (len(REVERSE) * len(REVERSE_CONFIGS) + len(FORWARD) * len(CONFIGS))
    covered = len(CASES) * (len(REVERSE) + len(FORWARD))  # (the first two axes crossed)
    platforms = len(PLATFORMS) * len(PLATFORM_TRANSFORMS)
    platforms_full = platforms * len(PLATFORM_CASES) * len(PLATFORM_CONFIGS)
    assert f"a covering subset ({covered}:" in page and f"runs all {full}." in page
    assert f"{platforms} in `make test`, {platforms_full} in `make test-full`" in page
