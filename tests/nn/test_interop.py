"""Equinox modules and Flax NNX modules as the step of dyndepth's loops and layers.

Runs both interop examples on tiny settings, and checks that gradients reaching the modules'
parameters through the loops equal those of plain-Python loops (same depths, same step keys).
Equinox and Flax are optional extras: without them this module is skipped.
"""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Counter, tree_allclose
from shared_lists import CHECKPOINTING_STRATEGIES, STRATEGIES

import dyndepth
import dyndepth.nn as dnn

eqx = pytest.importorskip("equinox")
pytest.importorskip("flax")
from flax import nnx  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GTOL = dict(rtol=2e-5, atol=2e-5)


def load_example(name: str) -> dict:
    return runpy.run_path(str(EXAMPLES / name), run_name="not_main")


@pytest.fixture(scope="module")
def eqx_example():
    return load_example("equinox_recurrent_depth.py")


@pytest.fixture(scope="module")
def nnx_example():
    return load_example("flax_nnx_stochastic_depth.py")


def assert_trained(res: dict) -> None:
    losses = np.asarray(res["losses"])
    assert np.all(np.isfinite(losses)), losses
    assert math.isfinite(res["final_loss"])
    assert res["final_loss"] < res["initial_loss"], (res["initial_loss"], res["final_loss"])


# ----------------------------------------------------------------------------- examples


@pytest.mark.slow
def test_equinox_example_trains(eqx_example, capsys):
    argv = ["--steps", "30", "--batch", "8", "--width", "8", "--length", "6", "--max-iters", "6"]
    res = eqx_example["main"](argv)
    assert_trained(res)
    out = capsys.readouterr().out
    assert "step   29  loss" in out and "accuracy" in out
    for acc in res["accuracy"].values():
        assert len(acc) == 12 and all(0.0 <= a <= 1.0 for a in acc)


@pytest.mark.parametrize(
    "method", ["layer_drop", pytest.param("stochastic_residual", marks=pytest.mark.slow)]
)
def test_flax_nnx_example_trains(nnx_example, method, capsys):
    argv = ["--steps", "30", "--depth", "4", "--dim", "8", "--hidden", "16", "--batch", "32"]
    res = nnx_example["main"]([*argv, "--method", method])
    assert_trained(res)
    assert math.isfinite(res["eval_final_loss"])
    assert res["eval_final_loss"] < res["eval_initial_loss"]
    out = capsys.readouterr().out
    assert f"{method}: train loss" in out and "deterministic=True" in out


# ----------------------------------------------------------------------------- Equinox


class EqxCore(eqx.Module):
    """A recurrent step with dropout: ``core(state, x, key) -> state``."""

    lin: eqx.nn.Linear
    mlp: eqx.nn.MLP
    drop: eqx.nn.Dropout

    def __init__(self, dim: int, key):
        k1, k2 = jax.random.split(key)
        self.lin = eqx.nn.Linear(2 * dim, dim, key=k1)
        self.mlp = eqx.nn.MLP(dim, dim, 8, 1, activation=jnp.tanh, key=k2)
        self.drop = eqx.nn.Dropout(0.3)

    def __call__(self, s, x, key):
        h = jnp.tanh(self.lin(jnp.concatenate([s, x])))
        return s + self.drop(self.mlp(h), key=key)


DIM = 3
CORE = EqxCore(DIM, jax.random.PRNGKey(0))
S0 = jax.random.normal(jax.random.PRNGKey(1), (DIM,))
XIN = jax.random.normal(jax.random.PRNGKey(2), (DIM,))
KEY = jax.random.PRNGKey(3)


def python_recurrent_depth(core, s, x, n: int, k: int, key):
    """The docstring of ``recurrent_depth``, as a Python loop."""
    for j in range(n):
        s = core(s, x, dyndepth.step_key(key, j))
    if n > 0:
        s = jax.lax.stop_gradient(s)
    for j in range(k):
        s = core(s, x, dyndepth.step_key(key, n + j))
    return s


@pytest.mark.parametrize(
    "strategy, n, k", [("auto", 0, 3), ("auto", 2, 3), ("checkpointed", 2, 3), ("masked", 2, 3)]
)
def test_equinox_module_as_recurrent_depth_core_matches_python_loop(strategy, n, k):
    # Differentiate with respect to the module and the input x that the core sees at every step.
    def loss(core_and_x):
        core, x = core_and_x
        s = dnn.recurrent_depth(core, S0, x, n=n, k=k, max_n=3, max_k=4, key=KEY, strategy=strategy)
        return jnp.sum(s**2)

    def ref(core_and_x):
        core, x = core_and_x
        return jnp.sum(python_recurrent_depth(core, S0, x, n, k, KEY) ** 2)

    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))((CORE, XIN))
    want = eqx.filter_value_and_grad(ref)((CORE, XIN))
    tree_allclose(got, want, **GTOL)
    assert float(jnp.sum(jnp.abs(got[1][0].lin.weight))) > 0


def test_equinox_module_repeat_per_sample_depths_matches_python_loop():
    """vmap(repeat) with per-sample depths from sample_depth, and repeat_batched, against a
    per-sample Python loop; gradients of the shared module summed over the batch."""
    B, max_depth = 6, 5
    inits = jax.random.normal(jax.random.PRNGKey(4), (B, DIM))
    depths = dnn.sample_depth(jax.random.PRNGKey(5), (B,), dist="uniform", low=0, high=max_depth)
    keys = jax.random.split(jax.random.PRNGKey(6), B)

    def step(core):
        return lambda s, key: core(s, XIN, key)

    def loss_vmap(core):
        out = jax.vmap(
            lambda s, d, kk: dyndepth.repeat(step(core), s, d, max_depth=max_depth, key=kk)
        )(inits, depths, keys)
        return jnp.sum(out**2)

    def loss_batched(core):
        out = dyndepth.repeat_batched(step(core), inits, depths, max_depth=max_depth, keys=keys)
        return jnp.sum(out**2)

    def ref(core):
        total = 0.0
        for b in range(B):
            s = inits[b]
            for i in range(int(depths[b])):
                s = core(s, XIN, dyndepth.step_key(keys[b], i))
            total = total + jnp.sum(s**2)
        return total

    want = eqx.filter_value_and_grad(ref)(CORE)
    for loss in (loss_vmap, loss_batched):
        got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(CORE)
        tree_allclose(got, want, **GTOL, err_msg=loss.__name__)


def test_equinox_example_loss_gradient_matches_python_loop(eqx_example):
    """The example's own loss (per-sample (n, k), progressive loss) against Python loops."""
    B, width, length, max_iters = 3, 4, 5, 3
    model = eqx_example["RecallNet"](width, 0.2, key=jax.random.PRNGKey(7))
    bits, target = eqx_example["make_batch"](jax.random.PRNGKey(8), B, length)
    key = jax.random.PRNGKey(9)

    # The example's draws, made concrete for the Python loops.
    k_nk, k_drop = jax.random.split(key)
    ns, ks = (np.asarray(a) for a in dnn.sample_nk(k_nk, (B,), max_iters=max_iters))
    keys = jax.random.split(k_drop, B)
    assert ns.max() > 0  # some iterations run without gradient

    def ref(model):
        total = 0.0
        for b in range(B):
            n, k = int(ns[b]), int(ks[b])
            emb = model.embed(bits[b][None, :].astype(jnp.float32))
            s = jnp.zeros((width, length), jnp.float32)
            for j in range(n):
                s = model.core(s, emb, dyndepth.step_key(keys[b], j))
            if n > 0:
                s = jax.lax.stop_gradient(s)
            per_step = []
            for j in range(k):
                s = model.core(s, emb, dyndepth.step_key(keys[b], n + j))
                y = target[b].astype(jnp.float32)
                per_step.append(jnp.mean(bce_with_logits(model.logits(s), y)))
            total = total + sum(per_step) / k
        return total / B

    got = eqx.filter_jit(eqx.filter_value_and_grad(eqx_example["loss_fn"]))(
        model, bits, target, key, max_iters
    )
    want = eqx.filter_value_and_grad(ref)(model)
    tree_allclose(got, want, **GTOL)


def bce_with_logits(logits, y):
    """Binary cross-entropy with logits, written independently of the example."""
    return -(y * jax.nn.log_sigmoid(logits) + (1.0 - y) * jax.nn.log_sigmoid(-logits))


def test_equinox_stacked_modules_in_layer_drop():
    """A stack built with eqx.filter_vmap, partitioned into arrays + static for layer_drop;
    dropped layers get exactly zero gradient."""
    L = 5
    stack = eqx.filter_vmap(lambda k: eqx.nn.MLP(DIM, DIM, 6, 1, key=k))(
        jax.random.split(jax.random.PRNGKey(10), L)
    )
    params, static = eqx.partition(stack, eqx.is_array)
    key, rate = jax.random.PRNGKey(11), 0.5
    keep = np.asarray(jax.random.bernoulli(key, 1 - rate, (L,)))
    assert 0 < keep.sum() < L

    def layer(p, x):
        return x + eqx.combine(p, static)(x)

    def loss(params):
        return jnp.sum(dnn.layer_drop(layer, params, XIN, key, rate) ** 2)

    def ref(params):
        x = XIN
        for i in range(L):
            if keep[i]:
                x = layer(jax.tree_util.tree_map(lambda a, i=i: a[i], params), x)
        return jnp.sum(x**2)

    got = jax.jit(jax.value_and_grad(loss))(params)
    tree_allclose(got, jax.value_and_grad(ref)(params), **GTOL)
    for g in jax.tree_util.tree_leaves(got[1]):
        assert np.all(np.asarray(g)[~keep] == 0.0)
        assert np.any(np.asarray(g)[keep] != 0.0)


# ----------------------------------------------------------------------------- Flax NNX


class NnxStep(nnx.Module):
    """``step(x, key) -> x``: a residual MLP with dropout driven by the step key."""

    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.fc2 = nnx.Linear(2 * dim, dim, rngs=rngs)
        self.drop = nnx.Dropout(0.3)

    def __call__(self, x, key):
        return x + jnp.tanh(self.fc2(self.drop(nnx.gelu(self.fc1(x)), rngs=key)))


@pytest.mark.parametrize("strategy", CHECKPOINTING_STRATEGIES)
def test_nnx_module_as_repeat_step_matches_python_loop(strategy):
    model = NnxStep(DIM, nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(12), (4, DIM))
    depth = 4

    def loss(model, x):
        # The NNX module itself is the step function f(carry, key).
        return jnp.sum(dyndepth.repeat(model, x, depth, max_depth=6, key=KEY, strategy=strategy))

    def ref(model, x):
        for i in range(depth):
            x = model(x, dyndepth.step_key(KEY, i))
        return jnp.sum(x)

    got = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(model, x)
    want = nnx.value_and_grad(ref, argnums=(0, 1))(model, x)
    tree_allclose(got, want, **GTOL)


def test_nnx_module_repeat_per_sample_depths_matches_python_loop():
    model = NnxStep(DIM, nnx.Rngs(1))
    B, max_depth = 5, 4
    xs = jax.random.normal(jax.random.PRNGKey(13), (B, DIM))
    depths = dnn.sample_depth(jax.random.PRNGKey(14), (B,), dist="uniform", low=0, high=max_depth)
    keys = jax.random.split(jax.random.PRNGKey(15), B)

    def loss(model):
        out = jax.vmap(lambda x, d, k: dyndepth.repeat(model, x, d, max_depth=max_depth, key=k))(
            xs, depths, keys
        )
        return jnp.sum(out**2)

    def ref(model):
        total = 0.0
        for b in range(B):
            x = xs[b]
            for i in range(int(depths[b])):
                x = model(x, dyndepth.step_key(keys[b], i))
            total = total + jnp.sum(x**2)
        return total

    tree_allclose(nnx.jit(nnx.value_and_grad(loss))(model), nnx.value_and_grad(ref)(model), **GTOL)


def small_nnx_model(nnx_example, depth=4, final_rate=0.5, seed=0):
    model = nnx_example["StochasticDepthMLP"](3, 4, 8, 1, depth, final_rate, rngs=nnx.Rngs(seed))
    # The example zero-initialises the blocks' last layer; make it nonzero so that every
    # parameter of a kept block gets a nonzero gradient.
    fc2 = model.blocks.fc2.kernel
    fc2[...] = 0.3 * jax.random.normal(jax.random.PRNGKey(seed), fc2[...].shape)
    return model


def python_stochastic_depth(model, x, key, method, deterministic=False):
    """The example's forward pass as a Python loop over the blocks, with the documented draws:
    layer_drop: ``keep = bernoulli(key, 1 - rates)``; stochastic_residual: block ``l`` draws
    ``bernoulli(step_key(key, l), 1 - rate_l, (1, 1))``."""
    graphdef, params = nnx.split(model.blocks)
    rates = model.rates
    if not deterministic and method == "layer_drop":
        keep = np.asarray(jax.random.bernoulli(key, 1.0 - jnp.asarray(rates)))
    h = model.stem(x)
    for i, r in enumerate(rates):
        block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], params))
        if deterministic:
            h = block(h)
        elif method == "layer_drop":
            if keep[i]:
                h = h + block.branch(h) / (1.0 - r)
        else:
            keep_i = jax.random.bernoulli(dyndepth.step_key(key, i), 1.0 - r, (1, 1))
            h = h + jnp.where(keep_i, block.branch(h) / (1.0 - r), 0.0)
    return model.head(h)


NNX_DEPTH = 6
NNX_KEY = jax.random.PRNGKey(18)


@pytest.fixture(scope="module", params=["layer_drop", "stochastic_residual"])
def nnx_grads(request, nnx_example):
    """The example's model (6 blocks) differentiated through dyndepth and through a Python loop:
    ``(method, model, x, keep, got, want)``, ``keep`` the blocks that the key keeps."""
    method = request.param
    model = small_nnx_model(nnx_example, depth=NNX_DEPTH, final_rate=0.6, seed=1)
    rates = model.rates
    if method == "layer_drop":
        keep = np.asarray(jax.random.bernoulli(NNX_KEY, 1.0 - jnp.asarray(rates)))
    else:
        keep = np.array(
            [
                bool(jax.random.bernoulli(dyndepth.step_key(NNX_KEY, i), 1 - r))
                for i, r in enumerate(rates)
            ]
        )
    assert 0 < keep.sum() < NNX_DEPTH, keep  # some blocks kept, some dropped
    x = jax.random.normal(jax.random.PRNGKey(16), (5, 3))
    y = jax.random.normal(jax.random.PRNGKey(17), (5, 1))

    def loss(model):
        return jnp.mean((model(x, key=NNX_KEY, method=method) - y) ** 2)

    def ref(model):
        return jnp.mean((python_stochastic_depth(model, x, NNX_KEY, method) - y) ** 2)

    got = nnx.jit(nnx.value_and_grad(loss))(model)
    want = nnx.value_and_grad(ref)(model)
    return method, model, x, keep, got, want


def test_nnx_example_model_gradients_match_python_loop(nnx_grads):
    method, model, x, _, got, want = nnx_grads
    tree_allclose(got, want, **GTOL)
    # Evaluation runs every block, with no key.
    out = nnx.jit(lambda m: m(x, deterministic=True, method=method))(model)
    tree_allclose(out, python_stochastic_depth(model, x, None, method, True), **GTOL)


def test_nnx_dropped_blocks_get_exactly_zero_gradient(nnx_grads):
    """Batch mode (layer_drop, and stochastic_residual's lax.cond): a dropped block's
    parameters get exactly zero gradient, a kept block's do not."""
    _, _, _, keep, (_, grads), _ = nnx_grads
    for path, g in jax.tree_util.tree_leaves_with_path(grads.blocks):
        g = np.asarray(g)
        name = jax.tree_util.keystr(path)
        assert np.all(g[~keep] == 0.0), name  # exactly zero, not merely small
        assert np.all(np.any(g[keep].reshape(int(keep.sum()), -1) != 0.0, axis=1)), name
    assert np.any(np.asarray(grads.stem.kernel[...]) != 0.0)


def test_nnx_stacked_blocks_run_only_when_kept(nnx_example):
    """Batch mode really skips: the blocks' compute runs once per kept block (layer_drop, and
    stochastic_residual's lax.cond), counted with a host callback."""
    depth, key = 6, jax.random.PRNGKey(21)
    model = small_nnx_model(nnx_example, depth=depth, final_rate=0.6, seed=2)
    rates = model.rates
    keep_ld = np.asarray(jax.random.bernoulli(key, 1.0 - jnp.asarray(rates)))
    keep_sr = [
        bool(jax.random.bernoulli(dyndepth.step_key(key, i), 1 - r)) for i, r in enumerate(rates)
    ]
    assert 0 < keep_ld.sum() < depth and 0 < sum(keep_sr) < depth, (keep_ld, keep_sr)
    graphdef, params = nnx.split(model.blocks)
    h = jax.random.normal(jax.random.PRNGKey(22), (5, 4))
    counter = Counter()

    def layer(p, h):
        counter.tick()
        return nnx.merge(graphdef, p)(h)

    run_ld = jax.jit(lambda p, h: dnn.layer_drop(layer, p, h, key, jnp.asarray(rates)))
    assert counter.run(run_ld, params, h) == keep_ld.sum()

    def run_sr(p, h):
        for i, r in enumerate(rates):
            block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], p))

            def branch(h, block=block):
                counter.tick()
                return block.branch(h)

            h = dnn.stochastic_residual(branch, h, dyndepth.step_key(key, i), r)
        return h

    assert counter.run(jax.jit(run_sr), params, h) == sum(keep_sr)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_equinox_state_in_the_carry(strategy):
    """An ``eqx.nn.State`` in the carry, updated by the step with ``state.set`` (which makes the
    step's input state unusable): the loop runs, under vmap, and counts each sample's steps as a
    Python loop does."""

    class Counted(eqx.Module):
        linear: eqx.nn.Linear
        count: eqx.nn.StateIndex

        def __init__(self, key):
            self.linear = eqx.nn.Linear(3, 3, key=key)
            self.count = eqx.nn.StateIndex(jnp.zeros((), jnp.int32))

        def __call__(self, x, state):
            return jnp.tanh(self.linear(x)), state.set(self.count, state.get(self.count) + 1)

    module, state = eqx.nn.make_with_state(Counted)(jax.random.key(0))

    def run(x, depth):
        step = lambda carry: module(*carry)
        return dyndepth.repeat(step, (x, state), depth, max_depth=4, strategy=strategy)

    xs = jax.random.normal(jax.random.key(1), (3, 3))
    depths = jnp.array([0, 2, 4])
    out, states = jax.vmap(run)(xs, depths)
    assert jax.vmap(lambda s: s.get(module.count))(states).tolist() == [0, 2, 4]
    for x, d, o in zip(xs, depths.tolist(), out, strict=True):
        expected = x
        for _ in range(d):
            expected = jnp.tanh(module.linear(expected))
        tree_allclose(o, expected, rtol=1e-5, atol=1e-6)
