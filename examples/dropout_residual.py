"""A dropout residual layer applied a random number of times per sample, with dyndepth.

The README quickstart's program at a batch of 32, width 64 and depths uniform in [1, 100]: a
residual layer with dropout, a fresh key at every step, under jax.vmap and jax.jit. The usual
workaround (the scan + cond baseline) scans over all 100 steps with lax.cond; dyndepth.repeat
runs each sample's own depth and is reverse differentiable. The layer's weights are fixed and
its ReLU output grows with depth: a program to time, not to train (the README's quickstart
differentiates a bounded layer). `dyndepth demo --task dropout-residual` runs it and times it
against the scan + cond baseline.

    python examples/dropout_residual.py
"""

import jax
import jax.numpy as jnp

import dyndepth


def residual_layer(x, key, rate=0.5):
    h = jax.nn.relu(x @ jnp.ones((x.shape[-1], x.shape[-1])) / x.shape[-1])
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)  # dropout (JAX has no nn.dropout)
    h = jnp.where(keep, h / (1.0 - rate), 0.0)
    return x + h


def stochastic_depth_forward(x, depth, key, max_iters=100):
    return dyndepth.repeat(residual_layer, x, depth, max_depth=max_iters, key=key)


def main():
    max_iters, batch_size, input_shape = 100, 32, (64,)
    key = jax.random.PRNGKey(42)
    input_key, depth_key, batch_key = jax.random.split(key, 3)
    batch_x = jax.random.normal(input_key, (batch_size, *input_shape))
    batch_depths = jax.random.randint(depth_key, (batch_size,), 1, max_iters + 1)
    batch_keys = jax.random.split(batch_key, batch_size)
    forward = jax.jit(jax.vmap(stochastic_depth_forward, in_axes=(0, 0, 0, None)), static_argnums=3)
    batch_output = forward(batch_x, batch_depths, batch_keys, max_iters)
    print(batch_output.shape)  # (32, 64)
    return batch_output


if __name__ == "__main__":
    main()
