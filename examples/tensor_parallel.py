"""Data and tensor parallelism together: a recurrent-depth transformer block in Equinox on a
4 x 2 mesh of devices (``data`` x ``model``).

The recurrent core is a pre-norm transformer block built from ``eqx.nn.Linear`` layers, split
Megatron-style over ``model``: the attention's query, key and value projections and the MLP's
first layer by output features (each ``model`` device holds half of the heads and half of the
hidden units), the attention's output projection and the MLP's second layer by input features,
their partial products summed over ``model`` with ``jax.lax.psum``. The batch is split over
``data``. Everything runs in one ``jax.shard_map`` manual over both axes, under ``jax.jit``:
every device runs ``dyndepth.nn.recurrent_depth`` on its shard of the batch with its half of
the weights, so the weights stay split inside the loops, the only collectives inside a loop
are the step's sums over ``model`` (the two ``model`` devices of a ``data`` shard run the same
number of steps), and the gradient of a weight is summed over ``data`` once, after the loops.

Every sample draws its own ``(n, k)`` (``dyndepth.nn.sample_nk``; ``--shared-depth``: one for
the whole batch). The script trains a few SGD steps on a toy task (a running mean of a random
sequence), then checks that the loss and every gradient equal the same computation on one
device (the weights whole, no ``psum``).

    python examples/tensor_parallel.py [--steps 20] [--shared-depth]

On a CPU it simulates the 8 devices itself (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before JAX starts, unless the flag is already there).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
from collections.abc import Callable  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dyndepth.nn as dnn  # noqa: E402

HEAD = 4  # features per attention head


def no_sum(h: jax.Array) -> jax.Array:  # one device holds every head and hidden unit
    return h


def model_sum(h: jax.Array) -> jax.Array:  # inside shard_map: the partial products, summed
    return jax.lax.psum(h, "model")


class Block(eqx.Module):
    """A pre-norm transformer block on one sample's ``(length, width)`` state. The row-parallel
    layers (``out``, ``down``) have no bias inside the split: theirs is added once, after the
    sum over ``model``."""

    norm1: eqx.nn.LayerNorm
    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    out: eqx.nn.Linear
    out_bias: jax.Array
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    down_bias: jax.Array

    def __init__(self, width: int, hidden: int, *, key: jax.Array):
        ks = jax.random.split(key, 6)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(width), eqx.nn.LayerNorm(width)
        self.q, self.k, self.v = (eqx.nn.Linear(width, width, key=kk) for kk in ks[:3])
        # the residual branches start small
        small = lambda lin: eqx.tree_at(lambda m: m.weight, lin, lin.weight * 0.1)
        self.out = small(eqx.nn.Linear(width, width, use_bias=False, key=ks[3]))
        self.up = eqx.nn.Linear(width, hidden, key=ks[4])
        self.down = small(eqx.nn.Linear(hidden, width, use_bias=False, key=ks[5]))
        self.out_bias = jnp.zeros(width)
        self.down_bias = jnp.zeros(width)

    def __call__(self, state: jax.Array, x: jax.Array, reduce: Callable = no_sum) -> jax.Array:
        s = state
        h = jax.vmap(self.norm1)(s + x)  # the input, injected at every iteration
        # this device's heads: (length, heads, HEAD)
        q, k, v = (
            jax.vmap(lin)(h).reshape(h.shape[0], -1, HEAD) for lin in (self.q, self.k, self.v)
        )
        attn = jax.nn.softmax(jnp.einsum("shd,thd->hst", q, k) / HEAD**0.5, axis=-1)
        o = jnp.einsum("hst,thd->shd", attn, v).reshape(h.shape[0], -1)
        s = s + reduce(jax.vmap(self.out)(o)) + self.out_bias
        u = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(s + x)))
        return s + reduce(jax.vmap(self.down)(u)) + self.down_bias


def specs(block: Block) -> Block:
    """The block's ``PartitionSpec`` per leaf: column-parallel layers (``q``, ``k``, ``v``,
    ``up``: an ``eqx.nn.Linear`` weight is ``(out, in)``) split by output features, row-parallel
    ones (``out``, ``down``) by input features, the rest replicated."""
    tree = jax.tree_util.tree_map(lambda _: P(), block)
    cols = lambda b: (b.q.weight, b.q.bias, b.k.weight, b.k.bias, b.v.weight, b.v.bias,
                      b.up.weight, b.up.bias)  # fmt: skip
    tree = eqx.tree_at(cols, tree, (P("model", None), P("model")) * 4)
    return eqx.tree_at(lambda b: (b.out.weight, b.down.weight), tree, (P(None, "model"),) * 2)


def forward(block: Block, xs, n, k, *, max_n: int, reduce: Callable) -> jax.Array:
    """The final states of a batch: ``n + k`` iterations of the block per sample, the last
    ``k`` differentiated."""

    def one(x, n, k):
        core = lambda s, x: block(s, x, reduce)
        return dnn.recurrent_depth(core, jnp.zeros_like(x), x, n=n, k=k, max_n=max_n, max_k=max_n)

    depth_axis = None if jnp.ndim(n) == 0 else 0  # one depth for the batch, or one per sample
    return jax.vmap(one, in_axes=(0, depth_axis, depth_axis))(xs, n, k)


def loss_fn(block: Block, xs, targets, n, k, *, max_n: int, reduce: Callable) -> jax.Array:
    out = forward(block, xs, n, k, max_n=max_n, reduce=reduce)
    # the mean squared error of each of this device's rows, summed (over data by the caller)
    return jnp.sum(jnp.mean((out - targets) ** 2, axis=(1, 2)))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--shared-depth", action="store_true", help="one (n, k) for the whole batch")
    args = p.parse_args(argv)

    length, width, hidden, max_n = 4, 16, 32, 4
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    block = Block(width, hidden, key=jax.random.key(0))
    spec = specs(block)
    place = lambda tree, s: jax.device_put(tree, jax.tree_util.tree_map(
        lambda q: NamedSharding(mesh, q), s, is_leaf=lambda q: isinstance(q, P)))  # fmt: skip

    def sharded_loss(block, xs, targets, n, k):
        def local(block, xs, targets, n, k):
            part = loss_fn(block, xs, targets, n, k, max_n=max_n, reduce=model_sum)
            return jax.lax.psum(part, "data")

        depth = P() if args.shared_depth else P("data")
        run = jax.shard_map(local, mesh=mesh, out_specs=P(),
                            in_specs=(spec, P("data"), P("data"), depth, depth))  # fmt: skip
        return run(block, xs, targets, n, k) / xs.shape[0]

    def one_device_loss(block, xs, targets, n, k):
        return loss_fn(block, xs, targets, n, k, max_n=max_n, reduce=no_sum) / xs.shape[0]

    @jax.jit
    def train_step(block, xs, targets, n, k):
        loss, grads = eqx.filter_value_and_grad(sharded_loss)(block, xs, targets, n, k)
        # SGD on the gradient clipped to norm 1
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(grads)))
        scale = 0.1 / jnp.maximum(1.0, norm)
        return jax.tree_util.tree_map(lambda w, g: w - scale * g, block, grads), loss, grads

    def batch(key):
        kx, kn = jax.random.split(key)
        xs = jax.random.normal(kx, (args.batch, length, width))
        targets = jnp.cumsum(xs, axis=1) / jnp.arange(1, length + 1)[:, None]  # running mean
        shape = () if args.shared_depth else (args.batch,)
        n, k = dnn.sample_nk(kn, shape, max_iters=max_n)
        return xs, targets, n, k

    sharded = place(block, spec)
    losses, worst = [], 0.0
    for i in range(args.steps):
        xs, targets, n, k = batch(jax.random.key(i + 1))
        depth = P() if args.shared_depth else P("data")
        ops = (place(xs, P("data")), place(targets, P("data")), place(n, depth), place(k, depth))
        new, loss, grads = train_step(sharded, *ops)
        if i in (0, args.steps - 1):  # the same step on one device: the whole weights, no psum
            want, want_g = eqx.filter_value_and_grad(one_device_loss)(
                jax.device_get(sharded), xs, targets, n, k
            )
            # |difference| relative to the largest |gradient| entry (some entries are 0 exactly:
            # the key projection's bias does not change the softmax)
            got_l, want_l = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want_g)
            scale = max(float(jnp.max(jnp.abs(w))) for w in want_l)
            diffs = [float(jnp.max(jnp.abs(g - w))) for g, w in zip(got_l, want_l, strict=True)]
            worst = max(
                worst, abs(float(loss) - float(want)) / abs(float(want)), max(diffs) / scale
            )
        sharded = new
        losses.append(float(loss))
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}")
    hlo = train_step.lower(sharded, *ops).compile().as_text()
    gathers = hlo.count("all-gather")
    print(f"largest relative difference to one device: {worst:.1e}; all-gathers: {gathers}")
    return dict(losses=losses, worst=worst, all_gathers=gathers,
                q_weight_shard=sharded.q.weight.addressable_shards[0].data.shape)  # fmt: skip


if __name__ == "__main__":
    main()
