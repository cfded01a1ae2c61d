"""Reliability repros of issue 29: no crash, no recompilation, errors that say what happened.

- A step with ``jax.debug.print`` in a vmapped loop on an ``Auto`` mesh (the partitioned call
  crashed the process with SIGSEGV): it now runs unpartitioned, printing, with the values and
  gradients of ``lax.fori_loop``.
- ``jax.export`` of a loop whose batch is sharded on an ``Auto`` mesh (the partitioner's host
  callback could not be serialized): it exports without one and the exported call agrees.
- Per-sample reverse mode over a cotangent basis (the inside of ``vmap(jacrev)``) with the batch
  sharded on an ``Explicit`` mesh (a replicated cotangent against a varying pullback failed).
- ``checked=True`` out of range on a mesh: the error carries the library's message.
- A second un-jitted call compiles nothing.

The mesh checks run in one subprocess with 8 simulated CPU devices.
"""

from __future__ import annotations

import logging
import textwrap

import jax
import jax.numpy as jnp
import pytest
from helpers import reference_repeat, run_on_eight_devices, tree_allclose

import dyndepth as dd

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd

    out = {}
    auto = Mesh(np.array(jax.devices()), ("data",))
    explicit = jax.make_mesh((8,), ("data",))
    W = jnp.eye(3) * 0.5 + 0.1
    xs = np.linspace(0.1, 1.0, 24, dtype=np.float32).reshape(8, 3)
    ds = np.array([0, 1, 2, 3, 3, 2, 1, 0], np.int32)

    def put(a, mesh):
        return jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("data")))

    def noisy(W):
        def step(c):
            jax.debug.print("step sees {v}", v=c[0])
            return jnp.tanh(c @ W)
        return step

    def lax_ref(W, x, d):  # a scan over max_depth steps, masked past d
        def body(c, i):
            return jnp.where(i < d, jnp.tanh(c @ W), c), None
        return jax.lax.scan(body, x, jnp.arange(3))[0]

    # 1. jax.debug.print in the step, vmapped, batch sharded on an Auto mesh
    x, d = put(xs, auto), put(ds, auto)
    ref_v = jax.vmap(lambda x, d: lax_ref(W, x, d))(xs, ds)
    ref_g = jax.grad(lambda W: jnp.sum(jax.vmap(lambda x, d: lax_ref(W, x, d))(xs, ds)))(W)
    for strategy in ("auto", "checkpointed", "while", "masked"):
        f = lambda W, x, d: dd.repeat(noisy(W), x, d, max_depth=3, strategy=strategy)
        v = jax.jit(jax.vmap(f, (None, 0, 0)))(W, x, d)
        err = float(np.max(np.abs(np.asarray(v) - np.asarray(ref_v))))
        if strategy != "while":
            g = jax.jit(jax.grad(lambda W: jnp.sum(jax.vmap(f, (None, 0, 0))(W, x, d))))(W)
            err = max(err, float(np.max(np.abs(np.asarray(g) - np.asarray(ref_g)))))
        out["debug_print_" + strategy] = err
    jax.effects_barrier()

    # 2. jax.export with the batch sharded on an Auto mesh
    sh = NamedSharding(auto, P("data"))
    f = jax.jit(jax.vmap(lambda x, d: dd.repeat(lambda c: jnp.tanh(c @ W), x, d, max_depth=3)),
                in_shardings=(sh, sh), out_shardings=sh)
    exported = jax.export.export(f)(x, d)
    out["export"] = float(np.max(np.abs(np.asarray(exported.call(x, d)) - np.asarray(f(x, d)))))
    out["export_host_callbacks"] = exported.mlir_module().count("host_callback")

    # 3. vjp per sample over a cotangent basis, batch sharded on an Explicit mesh
    def per_sample(x, d):
        _, pullback = jax.vjp(lambda W, x: dd.repeat(lambda c: jnp.tanh(c @ W), x, d,
                                                     max_depth=3), W, x)
        return jax.vmap(pullback)(jnp.eye(3))
    got = jax.jit(jax.vmap(per_sample))(put(xs, explicit), put(ds, explicit))
    got = [np.asarray(g) for g in got]
    ref = [jax.jacrev(lambda W, x: lax_ref(W, x, int(ds[b])), argnums=(0, 1))(W, xs[b])
           for b in range(8)]
    out["explicit_jacobians"] = max(float(np.max(np.abs(got[i][b] - np.asarray(ref[b][i]))))
                                    for b in range(8) for i in range(2))

    # 4. checked=True out of range, batch sharded on an Auto mesh
    bad = put(np.array([1, 2, 3, 9, 0, 1, 2, 3], np.int32), auto)
    g = jax.jit(jax.vmap(lambda x, d: dd.repeat(lambda c: c * 2, x, d, max_depth=3,
                                                checked=True)))
    try:
        jax.block_until_ready(g(x, bad))
        out["checked"] = "no error"
    except Exception as e:
        out["checked"] = str(e)
    print("RESULT" + json.dumps(out))
    """
)


def test_debug_print_export_and_mesh_errors_on_eight_devices():
    res = run_on_eight_devices(SCRIPT)
    for strategy in ("auto", "checkpointed", "while", "masked"):
        assert res["debug_print_" + strategy] < 1e-5, (strategy, res)
    assert res["export"] < 1e-6 and res["export_host_callbacks"] == 0, res
    assert res["explicit_jacobians"] < 1e-5, res
    assert "`depth` must lie in [0, max_depth] = [0, 3], got 9 at batch index 3" in res["checked"]


# ----------------------------------------------------------------------------- recompilation


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Compiling"):
            self.names.append(message.split(" with ")[0])


W = jnp.eye(3) * 0.5 + 0.1
X = jnp.linspace(0.1, 0.9, 3)


def step(c):
    return jnp.tanh(c @ W)


def cond(c):
    return c[0] > 0.05


def body(c, x):
    return step(c) + x, jnp.sum(c)


def loss(x):
    return jnp.sum(dd.repeat(step, x, 2, max_depth=4))


grad_loss = jax.grad(loss)
vmapped = jax.vmap(lambda x, d: dd.repeat(step, x, d, max_depth=4))

CALLS = {
    "repeat": lambda: dd.repeat(step, X, 2, max_depth=4),
    "masked": lambda: dd.repeat(step, X, 2, max_depth=4, strategy="masked"),
    "while_loop": lambda: dd.while_loop(cond, step, X, max_steps=4),
    "scan": lambda: dd.scan(body, X, jnp.ones((4, 3)), depth=3),
    "grad (stored residuals)": lambda: grad_loss(X),
    "vmap": lambda: vmapped(jnp.stack([X, X]), jnp.array([1, 3], jnp.int32)),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_second_eager_call_compiles_nothing(name):
    want = {
        "repeat": reference_repeat(step, X, 2),
        "masked": reference_repeat(step, X, 2),
        "grad (stored residuals)": jax.grad(lambda x: jnp.sum(reference_repeat(step, x, 2)))(X),
    }
    handler = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            first = jax.block_until_ready(CALLS[name]())
            handler.names.clear()
            second = jax.block_until_ready(CALLS[name]())
    finally:
        logger.removeHandler(handler)
    assert handler.names == [], f"{name}: the second call compiled {handler.names}"
    tree_allclose(second, first)
    if name in want:
        tree_allclose(second, want[name])
