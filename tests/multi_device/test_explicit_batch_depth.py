"""Per-batch and per-sample depth on an ``Explicit`` 2-D mesh under ``jax.set_mesh``.

A batch split over ``data`` of a 4x2 ``("data", "model")`` mesh, an MLP step whose weights are
split Megatron-style over ``model``, and one depth for the whole batch (a Python int or a traced
scalar, the batch's ``vmap`` not mapping it) or one per sample: values and gradients equal those
of one device. (A shared depth used to fail inside dyndepth: taking the steps of the batch's first
row is a slice JAX refuses on a batch typed as split over ``data``.)

The checks run in a subprocess with 8 simulated CPU devices (the device count is fixed when JAX
starts).
"""

import textwrap

from helpers import run_on_eight_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P, AxisType
    import dyndepth as dd

    B, D, H, T = 16, 8, 16, 6
    k = jax.random.split(jax.random.key(0), 6)
    W1 = jax.random.normal(k[0], (D, H)) / 3
    W2 = jax.random.normal(k[1], (H, D)) / 4
    xs = jax.random.normal(k[2], (B, D))
    ds = jax.random.randint(k[3], (B,), 0, T + 1).at[0].set(T)
    ks = jax.random.split(k[4], B)
    d = jnp.int32(4)  # the batch's one depth, traced

    def rows(h, W2, c):  # h @ W2, contracted over `model`: on the mesh, typed like the carry
        if not ON_MESH:
            return h @ W2
        return jnp.matmul(h, W2, out_sharding=jax.typeof(c).sharding.spec)

    def block(W, c, key=None):  # an MLP: W1 split by columns, W2 by rows (Megatron)
        W1, W2 = W
        h = jax.nn.gelu(c @ W1)
        if key is not None:
            h = h * jax.random.bernoulli(key, 0.9, h.shape)
        return c + rows(h, W2, c)

    def vmap_repeat(W, xs, ds, d, ks):
        shared = jax.vmap(lambda x, k: dd.repeat(lambda c, k: block(W, c, k), x, d,
                                                 max_depth=T, key=k))(xs, ks)
        python_int = jax.vmap(lambda x: dd.repeat(lambda c: block(W, c), x, 3,
                                                  max_depth=T))(xs)
        per_sample = jax.vmap(lambda x, n: dd.repeat(lambda c: block(W, c), x, n,
                                                     max_depth=T))(xs, ds)
        return shared + python_int + per_sample

    def vmap_scan(W, xs, ds, d, ks):
        def one(x, n):
            c, ys = dd.scan(lambda c, _: (block(W, c), jnp.sum(c)), x, length=T, depth=n)
            return c + jnp.sum(ys)
        return jax.vmap(one, in_axes=(0, None))(xs, d) + jax.vmap(one)(xs, ds)

    def repeat_batched(W, xs, ds, d, ks):
        f = lambda c, k: block(W, c, k)
        return (dd.repeat_batched(f, xs, ds, max_depth=T, keys=ks)
                + dd.repeat_batched(f, xs, ds * 0 + d, max_depth=T, keys=ks))

    def vmap_while(W, xs, ds, d, ks):
        one = lambda x: dd.while_loop(lambda c: jnp.sum(c ** 2) < 6.0, lambda c: block(W, c),
                                      x, max_steps=T)
        return jax.vmap(one)(xs * 0.3)

    def recurrent_depth(W, xs, ds, d, ks):
        core = lambda s, x, k: block(W, s, k) + x
        run = lambda x, n, m, k: dd.nn.recurrent_depth(core, x, x, n=n, k=m, max_n=T, max_k=T,
                                                       key=k)
        per_batch = jax.vmap(run, in_axes=(0, None, None, 0))(xs, d // 2, d - d // 2, ks)
        per_sample = jax.vmap(run)(xs, ds // 2, ds - ds // 2, ks)
        return per_batch + per_sample

    LOOPS = dict(vmap_repeat=vmap_repeat, vmap_scan=vmap_scan, repeat_batched=repeat_batched,
                 vmap_while=vmap_while, recurrent_depth=recurrent_depth)

    def loss_of(run):
        return lambda W, *a: jnp.sum(run(W, *a) ** 2)

    ON_MESH = False
    ref = {name: jax.jit(jax.value_and_grad(loss_of(run)))((W1, W2), xs, ds, d, ks)
           for name, run in LOOPS.items()}

    ON_MESH = True
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    out = {}
    with jax.set_mesh(mesh):
        put = lambda a, *spec: jax.device_put(a, P(*spec))
        W = (put(W1, None, "model"), put(W2, "model", None))
        args = (W, put(xs, "data"), put(ds, "data"), put(d), put(ks, "data"))
        for name, run in LOOPS.items():
            v, (g1, g2) = jax.jit(jax.value_and_grad(loss_of(run)))(*args)
            v0, (r1, r2) = ref[name]
            out[name] = dict(
                value_err=float(abs(v - v0) / abs(v0)),
                grad_err=max(float(jnp.max(abs(g - r)) / jnp.max(abs(r)))
                             for g, r in ((g1, r1), (g2, r2))),
                w1_spec=str(g1.sharding.spec),
            )
    print("RESULT" + json.dumps(out))
    """
)


def test_explicit_mesh_per_batch_and_per_sample_depth():
    results = run_on_eight_devices(SCRIPT)
    assert set(results) == {"vmap_repeat", "vmap_scan", "repeat_batched", "vmap_while",
                            "recurrent_depth"}  # fmt: skip
    for name, r in results.items():
        assert r["value_err"] < 1e-5 and r["grad_err"] < 1e-5, (name, r)
        # the gradient of a weight split over `model` is split like the weight
        assert "model" in r["w1_spec"], (name, r)
