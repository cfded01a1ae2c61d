"""Stochastic depth in a Flax NNX model, with dropped residual blocks really skipped.

A residual MLP (``nnx.Module``: a stem, ``L`` pre-norm residual blocks, a head) is trained on a
small synthetic regression task with stochastic depth (Huang et al., 2016): block ``l`` is
dropped with probability ``rates[l]``, linearly increasing with depth
(``dyndepth.nn.survival_schedule``), and kept updates are rescaled so that evaluation
(``deterministic=True``: every block runs) matches the training-time expectation.

The blocks are created once with ``nnx.vmap`` (the "stacked layers" pattern of ``nnx.scan``), so
their parameters carry a leading layer axis. ``nnx.split`` turns the stack into a ``graphdef``
and a ``State`` of stacked arrays; ``nnx.merge(graphdef, params_l)`` rebuilds block ``l`` from
its slice. Two ways to drop blocks, both with one decision per block for the whole batch
(``mode="batch"``), so a dropped block costs nothing, forward or backward:

- ``--method layer_drop`` (default): ``dyndepth.nn.layer_drop`` over the stacked ``State``. It
  gathers the indices of the kept blocks and runs a ``dyndepth.scan`` of that many steps, each
  step indexing its block's parameters out of the stack.
- ``--method stochastic_residual``: a Python loop over the blocks with
  ``dyndepth.nn.stochastic_residual(block.branch, h, key_l, rate_l)``, a ``lax.cond`` that runs
  the branch only when the block is kept. Block ``l`` gets ``dyndepth.step_key(key, i)``.

Training uses ``nnx.Optimizer`` with optax's RMSProp (optax comes with flax) and
``nnx.value_and_grad``, so gradients reach the NNX parameters through the dyndepth loop. (Not
Adam: optax's bias correction computes ``decay ** count`` with an int32 ``count``, which fails
under ``jax_numpy_dtype_promotion="strict"``, the setting of this project's tests.)

    python examples/flax_nnx_stochastic_depth.py [--steps 300] [--seed 0]
        [--method layer_drop|stochastic_residual]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import dyndepth
import dyndepth.nn as dnn

METHODS = ("layer_drop", "stochastic_residual")


class Block(nnx.Module):
    """``x + branch(x)`` with ``branch = fc2(gelu(fc1(layer_norm(x))))``."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        # Zero-initialised last layer: every block starts as the identity ("zero-init residual").
        self.fc2 = nnx.Linear(hidden, dim, kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

    def branch(self, x: jax.Array) -> jax.Array:
        return self.fc2(nnx.gelu(self.fc1(self.norm(x))))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.branch(x)


def stacked_blocks(depth: int, dim: int, hidden: int, rngs: nnx.Rngs) -> Block:
    """``depth`` blocks as one ``Block`` whose parameters have a leading layer axis."""

    @nnx.split_rngs(splits=depth)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Block:
        return Block(dim, hidden, rngs=rngs)

    return make(rngs)


class StochasticDepthMLP(nnx.Module):
    def __init__(
        self,
        in_dim: int,
        dim: int,
        hidden: int,
        out_dim: int,
        depth: int,
        final_rate: float,
        *,
        rngs: nnx.Rngs,
    ):
        self.stem = nnx.Linear(in_dim, dim, rngs=rngs)
        self.blocks = stacked_blocks(depth, dim, hidden, rngs)
        self.head = nnx.Linear(dim, out_dim, rngs=rngs)
        # Static drop rates (Python floats, not NNX state): rates[l] = (l + 1) / L * final_rate.
        self.rates = tuple(float(r) for r in np.asarray(dnn.survival_schedule(depth, final_rate)))

    def __call__(
        self,
        x: jax.Array,
        *,
        key: jax.Array | None = None,
        deterministic: bool = False,
        method: str = "layer_drop",
    ) -> jax.Array:
        h = self.stem(x)
        # A pure function of stacked parameters: graphdef (static) + State (arrays, axis 0 = layer).
        graphdef, params = nnx.split(self.blocks)
        if method == "layer_drop":
            h = dnn.layer_drop(
                lambda p, h: nnx.merge(graphdef, p)(h),
                params,
                h,
                key,
                jnp.asarray(self.rates),
                mode="batch",
                scale=True,  # stochastic depth: rescale the kept residual updates
                deterministic=deterministic,
            )
        elif method == "stochastic_residual":
            for i, rate in enumerate(self.rates):
                block = nnx.merge(graphdef, jax.tree_util.tree_map(lambda a, i=i: a[i], params))
                h = dnn.stochastic_residual(
                    block.branch,
                    h,
                    None if deterministic else dyndepth.step_key(key, i),
                    rate,
                    mode="batch",
                    deterministic=deterministic,
                )
        else:
            raise ValueError(f"`method` must be one of {METHODS}, got {method!r}")
        return self.head(h)


def make_data(teacher_key: jax.Array, key: jax.Array, n: int, in_dim: int):
    """Gaussian inputs and a smooth nonlinear target (a random teacher drawn from
    ``teacher_key``)."""
    k_w1, k_w2 = jax.random.split(teacher_key)
    x = jax.random.normal(key, (n, in_dim))
    w1 = jax.random.normal(k_w1, (in_dim, 16)) / np.sqrt(in_dim)
    w2 = jax.random.normal(k_w2, (16, 1)) / 4.0
    y = jnp.sin(2.0 * x @ w1) @ w2 + 0.25 * jnp.sum(x[:, :2] ** 2, axis=1, keepdims=True)
    return x, y


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", choices=METHODS, default="layer_drop")
    p.add_argument("--depth", type=int, default=8, help="number of residual blocks")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--final-rate", type=float, default=0.5, help="drop rate of the last block")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--in-dim", type=int, default=8)
    p.add_argument("--log-every", type=int, default=0, help="0: about ten lines")
    args = p.parse_args(argv)

    key = jax.random.PRNGKey(args.seed)
    k_model, k_teacher, k_data, k_test, k_batch, k_train = jax.random.split(key, 6)
    model = StochasticDepthMLP(
        args.in_dim,
        args.dim,
        args.hidden,
        1,
        args.depth,
        args.final_rate,
        rngs=nnx.Rngs(int(jax.random.randint(k_model, (), 0, 2**30))),
    )
    optimizer = nnx.Optimizer(model, optax.rmsprop(args.lr), wrt=nnx.Param)
    x_train, y_train = make_data(k_teacher, k_data, 4096, args.in_dim)
    x_test, y_test = make_data(k_teacher, k_test, 1024, args.in_dim)

    def mse(model, x, y, key, deterministic):
        pred = model(x, key=key, deterministic=deterministic, method=args.method)
        return jnp.mean((pred - y) ** 2)

    @nnx.jit
    def train_step(model, optimizer, x, y, key):
        loss, grads = nnx.value_and_grad(mse)(model, x, y, key, False)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def eval_loss(model, x, y):
        return mse(model, x, y, None, True)

    log_every = args.log_every or max(1, args.steps // 10)
    losses = []
    eval_initial = float(eval_loss(model, x_test, y_test))
    t0 = time.perf_counter()
    for step in range(args.steps):
        idx = jax.random.randint(jax.random.fold_in(k_batch, step), (args.batch,), 0, 4096)
        loss = train_step(
            model, optimizer, x_train[idx], y_train[idx], dyndepth.step_key(k_train, step)
        )
        losses.append(float(loss))
        if step % log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  train loss {losses[-1]:.4f}")
    train_s = time.perf_counter() - t0
    eval_final = float(eval_loss(model, x_test, y_test))

    k = max(1, len(losses) // 10)
    initial, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
    kept = sum(1.0 - r for r in model.rates)
    print(
        f"{args.method}: train loss {initial:.4f} -> {final:.4f} (mean of the first/last {k} "
        f"steps), {train_s:.1f} s; {kept:.1f} of {args.depth} blocks run per step on average"
    )
    print(
        f"test loss (deterministic=True, all blocks): {eval_initial:.4f} -> {eval_final:.4f} "
        f"(target variance {float(jnp.var(y_test)):.4f})"
    )
    return {
        "losses": losses,
        "initial_loss": initial,
        "final_loss": final,
        "eval_initial_loss": eval_initial,
        "eval_final_loss": eval_final,
        "model": model,
        "train_seconds": train_s,
    }


if __name__ == "__main__":
    main()
