"""Every public loop lowers for TPU, CUDA and ROCm, forward and value_and_grad, on this CPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=(p,))`` lowers for platform ``p`` without its
plugin: it fails if a primitive the loop emits has no lowering there (a host-only op, a CPU-only
custom call) or if tracing depends on the host backend in a way that breaks. Nothing is compiled
or run. The scheduled cases fix ``slots`` (wrap-around and lockstep), so that the scheduled
kernels are lowered whatever the time model would choose on the target.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import dyndepth as dd
import dyndepth.nn as dnn
from dyndepth import _cost as dd_cost

PLATFORMS = ("tpu", "cuda", "rocm")
B, D, M = 4, 3, 5  # batch, width, max depth


def _w():
    return jnp.eye(D) * 0.5


def _step(W):
    return lambda c: c + 0.1 * jnp.tanh(c @ W)


def _key_step(W):
    return lambda c, k: c + 0.1 * jnp.tanh(c @ W) * jax.random.uniform(k, c.shape)


_XS = jnp.linspace(-1.0, 1.0, B * D, dtype=jnp.float32).reshape(B, D)
_DS = jnp.array([0, 2, 5, 3], jnp.int32)
_KEYS = jax.random.split(jax.random.key(0), B)


def repeat_vmap(strategy="auto", slots=None, checkpoints=None):
    def run(W):
        one = lambda x, d: dd.repeat(  # noqa: E731
            _step(W), x, d, max_depth=M, strategy=strategy, slots=slots, checkpoints=checkpoints
        )
        return jax.vmap(one)(_XS, _DS)

    return run


def repeat_keyed(W):
    one = lambda x, d, k: dd.repeat(_key_step(W), x, d, max_depth=M, key=k)  # noqa: E731
    return jax.vmap(one)(_XS, _DS, _KEYS)


def repeat_single(W):
    return dd.repeat(_step(W), _XS[0], _DS[2], max_depth=M)


def scan_vmap(W):
    def one(x, d):
        f = lambda c, t: (_step(W)(c) + t, jnp.sum(c))  # noqa: E731
        return dd.scan(f, x, jnp.ones((M, D)), depth=d)

    carry, ys = jax.vmap(one)(_XS, _DS)
    return carry, ys


def while_vmap(W):
    def one(x, d):
        body = lambda s: (_step(W)(s[0]), s[1] + 1)  # noqa: E731
        return dd.while_loop(lambda s: s[1] < d, body, (x, 0), max_steps=M)[0]

    return jax.vmap(one)(_XS, _DS)


def batched(slots=None, shared=False):
    def run(W):
        depths = _DS[3] if shared else _DS
        return dd.repeat_batched(_step(W), _XS, depths, max_depth=M, slots=slots)

    return run


def recurrent_vmap(W):
    n, k = dnn.sample_nk(jax.random.key(1), (B,), max_iters=M)

    def one(x, n, k):
        core = lambda s, x: jnp.tanh(s @ W + x)  # noqa: E731
        return dnn.recurrent_depth(core, jnp.zeros(D), x, n=n, k=k, max_n=M - 1, max_k=M)

    return jax.vmap(one)(_XS, n, k)


def halting_vmap(W):
    def one(x):
        def step(s):
            s = _step(W)(s)
            return s, jax.nn.sigmoid(jnp.sum(s)), jnp.sum(s**2)

        r = dnn.halting(step, x, max_steps=M)
        return dnn.ponder_loss(r.outputs, r.p, prior_lambda=0.3, beta=0.01)

    return jax.vmap(one)(_XS)


def layer_drop_vmap(W):
    stack = jnp.stack([W * (i + 1) for i in range(M)])
    layer = lambda p, x: x + 0.1 * jnp.tanh(x @ p)  # noqa: E731
    one = lambda x, k: dnn.layer_drop(layer, stack, x, k, 0.5)  # noqa: E731
    return jax.vmap(one)(_XS, _KEYS)


def residual_and_drop_path(W):
    branch = lambda x: jnp.tanh(x @ W)  # noqa: E731
    k1, k2 = jax.random.split(jax.random.key(2))
    y = dnn.stochastic_residual(branch, _XS, k1, 0.5)
    return dnn.drop_path(y, k2, 0.25)


CASES = {
    "repeat, unbatched": repeat_single,
    "vmap(repeat), default": repeat_vmap(),
    "vmap(repeat), slots=2 (wrap-around)": repeat_vmap(slots=2),
    "vmap(repeat), checkpoints=2": repeat_vmap(slots=2, checkpoints=2),
    "vmap(repeat), checkpointed": repeat_vmap("checkpointed"),
    "vmap(repeat), masked": repeat_vmap("masked"),
    "vmap(repeat), with keys": repeat_keyed,
    "vmap(scan)": scan_vmap,
    "vmap(while_loop)": while_vmap,
    "repeat_batched, default": batched(),
    "repeat_batched, slots=2": batched(slots=2),
    "repeat_batched, slots=B (lockstep)": batched(slots=B),
    "repeat_batched, one depth": batched(shared=True),
    "vmap(nn.recurrent_depth)": recurrent_vmap,
    "vmap(nn.halting)": halting_vmap,
    "vmap(nn.layer_drop)": layer_drop_vmap,
    "nn.stochastic_residual + nn.drop_path": residual_and_drop_path,
}


def _value_and_grad(fn):
    def loss(W):
        leaves = jax.tree_util.tree_leaves(fn(W))
        return sum(jnp.sum(jnp.asarray(x, jnp.float32) ** 2) for x in leaves)

    return jax.value_and_grad(loss)


@pytest.mark.parametrize("mode", ["forward", "value_and_grad"])
@pytest.mark.parametrize("name", list(CASES))
def test_lowers_for_every_platform(name, mode):
    fn = CASES[name] if mode == "forward" else _value_and_grad(CASES[name])
    traced = jax.jit(fn).trace(_w())
    expected = jax.tree_util.tree_structure(jax.eval_shape(fn, _w()))
    for platform in PLATFORMS:
        lowered = traced.lower(lowering_platforms=(platform,))
        assert jax.tree_util.tree_structure(lowered.out_info) == expected
        text = lowered.as_text()
        # a loop stays a loop (only the drop layers without a depth loop may have none)
        if name != "nn.stochastic_residual + nn.drop_path":
            assert "stablehlo.while" in text, (name, mode, platform)
        # nothing that only the host runs
        assert "xla_python_cpu_callback" not in text, (name, mode, platform)


def test_a_store_the_host_would_thin_lowers_for_every_platform():
    """A step so small that on this CPU recomputing it is cheaper than writing its carry:
    the host stores at most ``SMALL_STORE`` carries per sample, below ``max_depth``. Lowered for
    an accelerator (which writes memory at speed), the store keeps that shape: the loop's
    abstract evaluation, traced on the host, and its lowering agree (they disagreed: the
    lowering failed to verify, a store of 64 carries against one of every carry)."""
    from dyndepth import _budget

    W = jnp.eye(16) * 0.1
    xs, depths = jnp.ones((64, 16)), jnp.arange(64) % 7

    def loss(W):
        one = lambda x, d: dd.repeat(lambda c: c + jnp.tanh(c @ W), x, d, max_depth=100)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths) ** 2)

    host = dd_cost.backend_cost("cpu")
    dd.set_iteration_cost("cpu", None)  # (the suite's own cost counts every step as free)
    try:
        traced = jax.jit(jax.value_and_grad(loss)).trace(W)
        loop = next(e.params["loop"] for e in traced.jaxpr.eqns if "loop" in e.params)
        assert _budget.checkpoints_for(loop, 64) == _budget.SMALL_STORE
        assert _budget.checkpoints_for(loop, 64, "tpu") is None
        for platform in PLATFORMS:
            assert "stablehlo.while" in traced.lower(lowering_platforms=(platform,)).as_text()
    finally:
        dd.set_iteration_cost("cpu", host)


def vmapped_repeat_loss(batch: int, depths):
    """``W -> sum(vmap(repeat(tanh(c @ W))))`` over ``batch`` rows of ones, per-sample
    ``depths``."""
    xs = jnp.ones((batch, 4))

    def loss(W):
        one = lambda x, d: dd.repeat(lambda c: jnp.tanh(c @ W), x, d, max_depth=8)  # noqa: E731
        return jnp.sum(jax.vmap(one)(xs, depths))

    return loss


def test_profiles_name_the_loops():
    """The batched loop's kernels carry named scopes (``jax.named_scope``) in the compiled
    program's metadata, as profilers show them: forward, backward and each slot count's
    branch."""
    loss = vmapped_repeat_loss(8, jnp.arange(8))
    text = jax.jit(jax.grad(loss)).lower(jnp.eye(4) * 0.5).as_text(debug_info=True)
    for scope in ("dyndepth_forward", "dyndepth_backward", "dyndepth_slots_8"):
        assert scope in text, scope


def test_slot_counts_follow_the_lowering_platform():
    """A program lowered for another platform than the host's takes that platform's time
    model: here the host's iteration is free (every slot count a candidate, one branch each)
    and the TPU's costs a second (lockstep alone: no branch)."""
    W = jnp.eye(4) * 0.5
    loss = vmapped_repeat_loss(64, jnp.arange(64) % 7)
    host = dd_cost.backend_cost("cpu")
    free = dd.IterationCost(fixed_seconds=0.0, flops_per_second=1e12, row_floor_seconds=1e-9)
    dear = dd.IterationCost(fixed_seconds=1.0, flops_per_second=1e12, row_floor_seconds=1e-9)
    dd.set_iteration_cost("cpu", free)
    dd.set_iteration_cost("tpu", dear)
    try:
        traced = jax.jit(jax.grad(loss)).trace(W)
        branches = {
            platform: set(re.findall(r"dyndepth_slots_\d+", lowered.as_text(debug_info=True)))
            for platform in ("tpu", "cpu")
            for lowered in [traced.lower(lowering_platforms=(platform,))]
        }
    finally:
        dd.set_iteration_cost("tpu", None)
        dd.set_iteration_cost("cpu", host)
    assert branches["tpu"] == set(), branches
    assert len(branches["cpu"]) >= 3, branches


def test_the_ladders_form_follows_the_lowering_platform():
    """The same traced program lowered for each platform: a TPU runs the slot counts' loops one
    after another (each in its count's scope directly), a CPU and a GPU choose among them under
    one conditional (each in a branch of it), forward and backward. Every platform's iteration
    is free here, so each has the same ladder of several counts."""
    W = jnp.eye(4) * 0.5
    loss = vmapped_repeat_loss(64, jnp.arange(64) % 7)
    free = dd.IterationCost(fixed_seconds=0.0, flops_per_second=1e12, row_floor_seconds=1e-9)
    platforms = ("cpu", "tpu", "cuda")
    before = {p: dd_cost.backend_cost(p) for p in platforms}
    for p in platforms:
        dd.set_iteration_cost(p, free)
    try:
        traced = jax.jit(jax.grad(loss)).trace(W)
        texts = {p: traced.lower(lowering_platforms=(p,)).as_text(debug_info=True)
                 for p in platforms}  # fmt: skip
    finally:
        for p in platforms:
            dd.set_iteration_cost(p, before[p])
    scope = r"dyndepth_(forward|backward)/(cond/branch_\d+_fun/)?dyndepth_slots_\d+"
    for p, text in texts.items():
        found = {(m.group(1), bool(m.group(2))) for m in re.finditer(scope, text)}
        under_conditional = p != "tpu"
        assert found == {("forward", under_conditional), ("backward", under_conditional)}, p
        assert len(set(re.findall(r"dyndepth_slots_\d+", text))) >= 3, p
