"""Tensor-parallel weights on an ``Explicit`` mesh: which loop forms keep them split.

A 4x2 ``("data", "model")`` mesh with ``Explicit`` axes under ``jax.set_mesh``, a Megatron MLP
step (``W1`` split by columns, ``W2`` by rows over ``model``, the second product typed like the
carry), per-sample depths, ``jit(value_and_grad)``: the compiled program's all-gathers are
found by the weights' shapes (``D != H``, so no other operand has them).

The control, a masked ``lax.fori_loop`` under ``vmap``, gathers no weight. So does the form
docs/scaling.md gives for tensor parallelism, a ``jax.shard_map`` manual over every axis with
the step's own ``lax.psum``. The dyndepth loops under plain ``jit`` (``vmap`` of ``repeat``,
``scan``, ``while_loop``, nested ``vmap``, ``repeat_batched``, ``nn.recurrent_depth``) run in a
``shard_map`` manual over ``data`` only, whose boundary JAX lowers replicated over ``model``:
they gather both weights, and each says so at trace time with a ``UserWarning`` naming them.
Any all-gather of a weight without that warning fails the test, as does a warning where no
weight is gathered.

The checks run in a subprocess with 8 simulated CPU devices.
"""

import textwrap

from helpers import run_on_eight_devices

SCRIPT = textwrap.dedent(
    """
    import json, re, warnings
    import jax, jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P, AxisType
    import dyndepth as dd

    B, D, H, T = 16, 16, 32, 6
    k = jax.random.split(jax.random.key(0), 4)
    W1 = jax.random.normal(k[0], (D, H)) / 3
    W2 = jax.random.normal(k[1], (H, D)) / 4
    xs = jax.random.normal(k[2], (B, D))
    ds = jax.random.randint(k[3], (B,), 0, T + 1)

    def block(W, c):
        W1, W2 = W
        h = jax.nn.gelu(c @ W1)
        return c + jnp.matmul(h, W2, out_sharding=jax.typeof(c).sharding.spec)

    def fori(W, xs, ds):
        one = lambda x, n: lax.fori_loop(0, T, lambda i, c: jnp.where(i < n, block(W, c), c), x)
        return jax.vmap(one)(xs, ds)

    def vmap_repeat(W, xs, ds):
        return jax.vmap(lambda x, n: dd.repeat(lambda c: block(W, c), x, n, max_depth=T))(xs, ds)

    def vmap_scan(W, xs, ds):
        def one(x, n):
            c, ys = dd.scan(lambda c, _: (block(W, c), jnp.sum(c)), x, length=T, depth=n)
            return c + jnp.sum(ys)
        return jax.vmap(one)(xs, ds)

    def vmap_while(W, xs, ds):
        one = lambda x: dd.while_loop(lambda c: jnp.sum(c ** 2) < 6.0, lambda c: block(W, c), x,
                                      max_steps=T)
        return jax.vmap(one)(xs * 0.3)

    def nested_vmap(W, xs, ds):
        one = lambda x, n: dd.repeat(lambda c: block(W, c), x, n, max_depth=T)
        return jax.vmap(jax.vmap(one))(xs.reshape(4, 4, D), ds.reshape(4, 4))

    def repeat_batched(W, xs, ds):
        return dd.repeat_batched(lambda c: block(W, c), xs, ds, max_depth=T)

    def recurrent_depth(W, xs, ds):
        core = lambda s, x: block(W, s) + x
        run = lambda x, n, m: dd.nn.recurrent_depth(core, x, x, n=n, k=m, max_n=T, max_k=T)
        return jax.vmap(run)(xs, ds // 2, ds - ds // 2)

    def shard_map_manual(W, xs, ds):  # docs/scaling.md: manual over every axis, the psum written
        def local(W1, W2, xs, ds):
            step = lambda c: c + lax.psum(jax.nn.gelu(c @ W1) @ W2, "model")
            out = jax.vmap(lambda x, n: dd.repeat(step, x, n, max_depth=T))(xs, ds)
            return out
        return jax.shard_map(local, in_specs=(P(None, "model"), P("model", None), P("data"),
                                              P("data")), out_specs=P("data"))(*W, xs, ds)

    FORMS = dict(fori=fori, vmap_repeat=vmap_repeat, vmap_scan=vmap_scan, vmap_while=vmap_while,
                 nested_vmap=nested_vmap, repeat_batched=repeat_batched,
                 recurrent_depth=recurrent_depth, shard_map_manual=shard_map_manual)
    WEIGHT_SHAPES = (f"f32[{D},{H}]", f"f32[{H},{D}]")

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    out = {}
    with jax.set_mesh(mesh):
        put = lambda a, *spec: jax.device_put(a, P(*spec))
        args = ((put(W1, None, "model"), put(W2, "model", None)), put(xs, "data"),
                put(ds, "data"))
        for name, run in FORMS.items():
            loss = lambda W, xs, ds: jnp.sum(run(W, xs, ds) ** 2)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hlo = jax.jit(jax.value_and_grad(loss)).lower(*args).compile().as_text()
            gathered = re.findall(r"= (f32\\[[0-9,]+\\])\\S* all-gather\\(", hlo)
            out[name] = dict(
                weight_gathers=sum(g in WEIGHT_SHAPES for g in gathered),
                warnings=[str(w.message) for w in caught if "all-gathered" in str(w.message)],
            )
    print("RESULT" + json.dumps(out))
    """
)

# The forms that keep both weights split on an Explicit mesh (docs/scaling.md says the same).
KEPT = {"fori", "shard_map_manual"}
GATHERED = {"vmap_repeat", "vmap_scan", "vmap_while", "nested_vmap", "repeat_batched",
            "recurrent_depth"}  # fmt: skip


def test_tensor_parallel_weights_on_an_explicit_mesh():
    results = run_on_eight_devices(SCRIPT)
    assert set(results) == KEPT | GATHERED
    for name, r in results.items():
        # an all-gather of a weight comes with the trace-time warning, and only then
        assert (r["weight_gathers"] > 0) == bool(r["warnings"]), (name, r)
        for message in r["warnings"]:
            assert "float32[16,32@model]" in message and "float32[32@model,16]" in message
            assert "jax.shard_map manual over every mesh axis" in message
    for name in KEPT:
        assert results[name]["weight_gathers"] == 0, (name, results[name])
    for name in GATHERED:
        assert results[name]["weight_gathers"] > 0, (name, results[name])
