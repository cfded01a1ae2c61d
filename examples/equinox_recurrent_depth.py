"""Recurrent depth with an Equinox module as the recurrent core.

A small "Deep Thinking" network (Schwarzschild et al. 2021, Bansal et al. 2022) written with
Equinox learns prefix-OR on bit strings: output bit ``i`` is 1 when any of the input bits
``0..i`` is 1. The recurrent core is an ``eqx.Module`` built from ``eqx.nn.Conv1d`` layers and an
``eqx.nn.Dropout``. Its two 3-wide convolutions move information at most two positions per
iteration, so a string of ``L`` bits needs about ``L / 2`` iterations: the depth the network
needs grows with the input.

Every sample of a batch draws its own ``(n, k)`` with ``dyndepth.nn.sample_nk``: ``n`` iterations
without gradient, then ``k`` with gradient (truncated backpropagation), all run by
``dyndepth.nn.recurrent_depth`` under ``jax.vmap``. Every iteration gets its own dropout key,
``dyndepth.step_key(key, i)``. The loss is taken at every differentiated iteration (the
"progressive" loss). Gradients reach the module's parameters through ``eqx.filter_value_and_grad``
and a plain SGD-with-momentum update written with ``jax.tree_util.tree_map`` (no optax).

After training the script evaluates the accuracy for every iteration count, with dropout off,
on the training length and on strings twice as long.

    python examples/equinox_recurrent_depth.py [--steps 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import dyndepth
import dyndepth.nn as dnn


class RecurrentCore(eqx.Module):
    """One iteration: ``state + tanh(conv2(relu(conv1([state; embedding]))))``, with dropout on
    the update. Shapes are ``(width, length)`` for one sample (no batch axis)."""

    conv1: eqx.nn.Conv1d
    conv2: eqx.nn.Conv1d
    dropout: eqx.nn.Dropout

    def __init__(self, width: int, dropout: float, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.conv1 = eqx.nn.Conv1d(2 * width, width, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv1d(width, width, 3, padding=1, key=k2)
        self.dropout = eqx.nn.Dropout(dropout)

    def __call__(self, state: jax.Array, embedding: jax.Array, key: jax.Array | None = None):
        h = jax.nn.relu(self.conv1(jnp.concatenate([state, embedding], axis=0)))
        update = jnp.tanh(self.conv2(h))
        # key=None: evaluation, dropout off.
        update = self.dropout(update, key=key, inference=key is None)
        return state + update


class RecallNet(eqx.Module):
    """Embedding, recurrent core, readout; ``bits`` is one sample of shape ``(length,)``."""

    embed: eqx.nn.Conv1d
    core: RecurrentCore
    head: eqx.nn.Conv1d
    width: int = eqx.field(static=True)

    def __init__(self, width: int, dropout: float, *, key: jax.Array):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = eqx.nn.Conv1d(1, width, 3, padding=1, key=k1)
        self.core = RecurrentCore(width, dropout, key=k2)
        self.head = eqx.nn.Conv1d(width, 1, 1, key=k3)
        self.width = width

    def logits(self, state: jax.Array) -> jax.Array:
        return self.head(state)[0]  # (length,)

    def __call__(self, bits, *, n, k, max_n: int, max_k: int, key=None):
        """Per-iteration logits of the last ``k`` of ``n + k`` iterations: ``(max_k, length)``,
        rows ``>= k`` are zeros."""
        embedding = self.embed(bits[None, :].astype(jnp.float32))
        state = jnp.zeros((self.width, bits.shape[0]), jnp.float32)
        # The Equinox module itself is the step: core(state, x, key) -> state. Its parameters
        # are closed over by the loop and receive gradients from the last k iterations.
        _, logits = dnn.recurrent_depth(
            self.core,
            state,
            embedding,
            n=n,
            k=k,
            max_n=max_n,
            max_k=max_k,
            key=key,
            return_all=True,
            readout=self.logits,
        )
        return logits


def make_batch(key: jax.Array, batch: int, length: int):
    """Bit strings with about one 1 in ``length / 2`` positions, and their prefix-OR."""
    bits = jax.random.bernoulli(key, 2.0 / length, (batch, length)).astype(jnp.int32)
    return bits, jax.lax.cummax(bits, axis=1)


def progressive_loss(logits: jax.Array, target: jax.Array, k: jax.Array) -> jax.Array:
    """Mean binary cross-entropy over the ``k`` differentiated iterations of one sample."""
    y = target.astype(logits.dtype)
    bce = jnp.mean(jnp.maximum(logits, 0.0) - logits * y + jnp.log1p(jnp.exp(-jnp.abs(logits))), -1)
    valid = jnp.arange(logits.shape[0]) < k
    return jnp.sum(jnp.where(valid, bce, 0.0)) / jnp.maximum(k, 1).astype(bce.dtype)


def loss_fn(model: RecallNet, bits, target, key, max_iters: int):
    """Batch loss; every sample draws its own (n, k) and dropout keys."""
    batch = bits.shape[0]
    k_nk, k_drop = jax.random.split(key)
    n, k = dnn.sample_nk(k_nk, (batch,), max_iters=max_iters)
    keys = jax.random.split(k_drop, batch)

    def one(bits, target, n, k, key):
        logits = model(bits, n=n, k=k, max_n=max_iters - 1, max_k=max_iters, key=key)
        return progressive_loss(logits, target, k)

    return jnp.mean(jax.vmap(one)(bits, target, n, k, keys))


def accuracy_per_iteration(model: RecallNet, bits, target, iters: int) -> jax.Array:
    """Whole-string accuracy after 1..iters iterations (dropout off): shape ``(iters,)``."""

    def one(bits):
        return model(bits, n=0, k=iters, max_n=0, max_k=iters)

    logits = jax.vmap(one)(bits)  # (batch, iters, length)
    solved = jnp.all((logits > 0) == (target[:, None, :] > 0), axis=-1)
    return jnp.mean(solved.astype(jnp.float32), axis=0)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=8, help="training string length")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--max-iters", type=int, default=12, help="largest n + k in training")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--dropout", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=0, help="0: about ten lines")
    args = p.parse_args(argv)

    key = jax.random.PRNGKey(args.seed)
    k_model, k_data, k_train, k_eval = jax.random.split(key, 4)
    model = RecallNet(args.width, args.dropout, key=k_model)
    # Momentum buffers for the trainable leaves (the inexact arrays); None elsewhere.
    velocity = jax.tree_util.tree_map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def train_step(model, velocity, bits, target, key):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, bits, target, key, args.max_iters)
        velocity = jax.tree_util.tree_map(lambda v, g: args.momentum * v + g, velocity, grads)
        model = eqx.apply_updates(model, jax.tree_util.tree_map(lambda v: -args.lr * v, velocity))
        return model, velocity, loss

    log_every = args.log_every or max(1, args.steps // 10)
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        bits, target = make_batch(jax.random.fold_in(k_data, step), args.batch, args.length)
        model, velocity, loss = train_step(
            model, velocity, bits, target, dyndepth.step_key(k_train, step)
        )
        losses.append(float(loss))
        if step % log_every == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    train_s = time.perf_counter() - t0

    eval_iters = 2 * args.max_iters
    acc = {}
    for length in (args.length, 2 * args.length):
        bits, target = make_batch(jax.random.fold_in(k_eval, length), 256, length)
        acc[length] = [
            float(a)
            for a in eqx.filter_jit(accuracy_per_iteration)(model, bits, target, eval_iters)
        ]
    for length, a in acc.items():
        best = max(range(eval_iters), key=lambda i: a[i])
        print(
            f"length {length:3d}: accuracy {a[length - 1]:.1%} after {length} iterations, "
            f"best {a[best]:.1%} after {best + 1}, {a[-1]:.1%} after {eval_iters}"
        )
    k = max(1, len(losses) // 10)
    initial, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"loss {initial:.4f} -> {final:.4f} (mean of the first/last {k} steps), {train_s:.1f} s")
    return {
        "losses": losses,
        "initial_loss": initial,
        "final_loss": final,
        "accuracy": acc,
        "model": model,
        "train_seconds": train_s,
    }


if __name__ == "__main__":
    main()
