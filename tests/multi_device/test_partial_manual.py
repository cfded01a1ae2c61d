"""A ``jax.shard_map`` manual over ``data`` only, the weights split over ``model`` (left ``Auto``),
per-sample depths: XLA partitions the step over ``model`` itself and may put collectives whose
rendezvous takes every device inside the loop, which the devices that stop early never join (the
process hung or aborted). dyndepth raises at trace time instead, with what to write: the
``shard_map`` manual over every axis with the step's ``model`` reductions written out, which
runs, and equals one device.

The checks run in a subprocess with 8 simulated CPU devices and a timeout, so that a regression
that hangs fails this test instead of hanging the suite.
"""

import textwrap

from helpers import run_on_eight_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd

    B, D, H, T = 16, 8, 16, 6
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    W1 = jax.random.normal(k[0], (D, H)) / 3
    W2 = jax.random.normal(k[1], (H, D)) / 4
    xs = jax.random.normal(k[2], (B, D))
    ds = jax.random.randint(k[3], (B,), 0, T + 1).at[0].set(T)
    ks = jax.random.split(k[4], B)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    put = lambda a, *s: jax.device_put(a, NamedSharding(mesh, P(*s)))

    def mlp(W1, W2, reduce=lambda h: h):  # Megatron: W1 split by columns, W2 by rows
        return lambda c: c + reduce(jnp.tanh(c @ W1) @ W2)

    def vmap_repeat(W1, W2, xs, ds, ks):
        return jax.vmap(lambda x, d: dd.repeat(mlp(W1, W2), x, d, max_depth=T))(xs, ds)

    def repeat_batched(W1, W2, xs, ds, ks):
        f = lambda c, kk: mlp(W1, W2)(c) * jax.random.bernoulli(kk, 0.9, c.shape)
        return dd.repeat_batched(f, xs, ds, max_depth=T, keys=ks)

    def vmap_while(W1, W2, xs, ds, ks):
        one = lambda x: dd.while_loop(lambda c: jnp.sum(c ** 2) < 6.0, mlp(W1, W2), x,
                                      max_steps=T)
        return jax.vmap(one)(xs * 0.3)

    def recurrent_depth(W1, W2, xs, ds, ks):
        core = lambda s, x: mlp(W1, W2)(s) + x
        one = lambda x, d: dd.nn.recurrent_depth(core, x, x, n=d // 2, k=d - d // 2,
                                                 max_n=T, max_k=T)
        return jax.vmap(one)(xs, ds)

    def shared_depth(W1, W2, xs, ds, ks):  # one depth for every device: no uneven trip count
        return jax.vmap(lambda x: dd.repeat(mlp(W1, W2), x, 4, max_depth=T))(xs)

    out = {}
    args = (put(W1, None, "model"), put(W2, "model", None), put(xs, "data"), put(ds, "data"),
            put(ks, "data"))
    partial = lambda run: jax.shard_map(run, mesh=mesh, in_specs=(P(),) * 2 + (P("data"),) * 3,
                                        out_specs=P("data"), axis_names={"data"})
    for name, run in dict(vmap_repeat=vmap_repeat, repeat_batched=repeat_batched,
                          vmap_while=vmap_while, recurrent_depth=recurrent_depth).items():
        try:
            jax.jit(partial(run)).trace(*args)  # tracing only: nothing compiled or run
            out[name] = "traced"
        except ValueError as e:
            out[name] = str(e)

    # The control: a shared depth on the same partial-manual shard_map runs.
    v = jax.jit(partial(shared_depth))(*args)
    out["shared_depth_err"] = float(jnp.max(abs(v - shared_depth(W1, W2, xs, ds, ks))))

    # What the error says to write: manual over every axis, the reduction over `model` explicit.
    def full(W1, W2, xs, ds):
        f = mlp(W1, W2, lambda h: lax.psum(h, "model"))
        return jax.vmap(lambda x, d: dd.repeat(f, x, d, max_depth=T))(xs, ds)

    sm = jax.shard_map(full, mesh=mesh, in_specs=(P(None, "model"), P("model", None),
                                                  P("data"), P("data")), out_specs=P("data"))
    loss = lambda run: lambda a, b, x, d: jnp.sum(run(a, b, x, d) ** 2)
    v, g = jax.jit(jax.value_and_grad(loss(sm), argnums=(0, 1)))(*args[:4])
    one = lambda a, b, x, d: vmap_repeat(a, b, x, d, None)
    v0, g0 = jax.value_and_grad(loss(one), argnums=(0, 1))(W1, W2, xs, ds)
    out["full_manual"] = dict(
        value_err=float(abs(v - v0) / abs(v0)),
        grad_err=max(float(jnp.max(abs(a - b)) / jnp.max(abs(b))) for a, b in zip(g, g0)),
    )
    print("RESULT" + json.dumps(out))
    """
)


def test_partial_manual_shard_map_raises_at_trace_time():
    out = run_on_eight_devices(SCRIPT)
    for name in ("vmap_repeat", "repeat_batched", "vmap_while", "recurrent_depth"):
        message = out[name]
        # the argument, the axes, the cause and what to write instead
        assert "runs inside a jax.shard_map that is manual over ['data'] only" in message, name
        assert "other mesh axes ['model'] (Auto)" in message, name
        assert "varies over 'data'" in message, name
        assert "make the shard_map manual over every mesh axis" in message, name
        assert "lax.psum" in message and "Explicit" in message, name
    assert out["shared_depth_err"] < 1e-5, out
    assert out["full_manual"]["value_err"] < 1e-5, out
    assert out["full_manual"]["grad_err"] < 1e-5, out
