"""Shared test helpers: one tolerance helper, plain-Python references, the seed's method.

The references are eager Python loops written from the docstrings of ``dyndepth.repeat``,
``dyndepth.scan`` and ``dyndepth.while_loop``; they use ``jax.random.fold_in`` directly (the
documented key schedule) and nothing from dyndepth, so a test comparing the library against them
can fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from shared_lists import CHECKPOINTING_STRATEGIES

# ----------------------------------------------------------------------------- compiled loops


def dyndepth_loops(hlo: str) -> dict[str, int]:
    """How many while loops of a compiled program's text dyndepth's batched kernels make,
    forward and backward (named in the ``dyndepth_forward`` / ``dyndepth_backward`` scope, or a
    slot count's within it, under a conditional over the counts or not; loops in their bodies,
    such as a step's own, left out)."""
    name = r"dyndepth_(forward|backward)(?:/cond/branch_\d+_fun)?(?:/dyndepth_slots_\d+)?/while\""
    loops = re.findall(r"= \(.*\) while\(.*op_name=\"[^\"]*" + name, hlo)
    return {d: loops.count(d) for d in ("forward", "backward")}


def conditional_branches(hlo: str, scope: str = "") -> list[int]:
    """The number of branches of each conditional in a compiled program's text (those traced
    in the named ``scope`` if given, such as ``"dyndepth_forward"``)."""
    lines = [line for line in hlo.splitlines() if scope in line]
    found = (re.search(r"branch_computations=\{([^}]*)\}", line) for line in lines)
    return [len(m.group(1).split(",")) for m in found if m]


# ----------------------------------------------------------------------------- subprocesses


def simulated_devices_env(count: int, **extra: str) -> dict[str, str]:
    """The environment for a child process with ``count`` simulated CPU devices: this process's,
    its ``XLA_FLAGS`` kept (tests/conftest.py sets the compiler's level there)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    flags.append(f"--xla_force_host_platform_device_count={count}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), **extra)


def run_on_eight_devices(script: str, timeout: int = 600) -> Any:
    """Run ``script`` in a fresh process with 8 simulated CPU devices: the JSON of the line it
    prints after ``RESULT``. A hang fails the calling test after ``timeout`` seconds rather
    than the suite."""
    proc = subprocess.run([sys.executable, "-c", script], env=simulated_devices_env(8),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


# ----------------------------------------------------------------------------- comparison


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def tree_allclose(
    actual: Any,
    expected: Any,
    rtol: float = 1e-5,
    atol: float = 1e-5,
    *,
    err_msg: str = "",
    check_dtype: bool = True,
) -> bool:
    """Assert two pytrees match: same structure, shapes and dtypes; floats within tolerance.

    Integer, bool and PRNG-key leaves must be exactly equal. Every failure names the leaf path
    (``['a']``, ``[0]``, ...). Returns True so it can also be used as ``assert tree_allclose(...)``.
    """
    prefix = f"{err_msg}: " if err_msg else ""
    leaves_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
    leaves_b, tree_b = jax.tree_util.tree_flatten_with_path(expected)
    assert tree_a == tree_b, f"{prefix}pytree structures differ: {tree_a} vs {tree_b}"
    for (path, a), (_, b) in zip(leaves_a, leaves_b, strict=True):
        name = jax.tree_util.keystr(path) or "<root>"
        if _is_key(a) or _is_key(b):
            assert _is_key(a) and _is_key(b), f"{prefix}leaf {name}: only one side is a key"
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, f"{prefix}leaf {name}: shape {a.shape} != {b.shape}"
        if check_dtype:
            assert a.dtype == b.dtype, f"{prefix}leaf {name}: dtype {a.dtype} != {b.dtype}"
        msg = f"{prefix}leaf {name}"
        if np.issubdtype(a.dtype, np.inexact) or np.issubdtype(b.dtype, np.inexact):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=msg)
        else:
            np.testing.assert_array_equal(a, b, err_msg=msg)
    return True


def tree_equal(actual: Any, expected: Any, *, err_msg: str = "") -> bool:
    """``tree_allclose`` with zero tolerance (bitwise-equal values)."""
    return tree_allclose(actual, expected, rtol=0.0, atol=0.0, err_msg=err_msg)


def expect_errors(cases, names, call):
    """Each named case ``cases[name] = (overrides, exc, match)`` must make ``call(overrides)``
    raise ``exc`` with a message matching ``match``; a failure names the case."""
    assert names
    for name in names:
        overrides, exc, match = cases[name]
        try:
            with pytest.raises(exc, match=match):
                call(overrides)
        except BaseException as e:  # pytest's "DID NOT RAISE" is not an Exception
            raise AssertionError(f"error case {name!r}: {e}") from e


def applicable(strategy: str, checkpoints=None, slots=None) -> dict:
    """The options a strategy takes: ``checkpoints`` for the reverse-mode strategies, ``slots``
    for "auto" (the others reject them)."""
    out = {}
    if strategy in CHECKPOINTING_STRATEGIES:
        out["checkpoints"] = checkpoints
    if strategy == "auto":
        out["slots"] = slots
    return out


# ----------------------------------------------------------------------------- references


def _fold(key: Any, i: int) -> Any:
    return jax.random.fold_in(key, i)


def reference_repeat(f, init, depth: int, key=None):
    """``for i in range(depth): carry = f(carry[, fold_in(key, i)])`` with a Python-int depth."""
    carry = init
    for i in range(int(depth)):
        carry = f(carry) if key is None else f(carry, _fold(key, i))
    return carry


def reference_scan(f, init, xs, depth: int, length: int, key=None):
    """The docstring's loop: ``length`` rows of ``ys``; rows at steps ``>= depth`` are zeros."""

    def x_at(i):
        return None if xs is None else jax.tree_util.tree_map(lambda a: a[i], xs)

    def call(c, x, i):
        return f(c, x) if key is None else f(c, x, _fold(key, i))

    x_example = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
    y_shape = jax.eval_shape(lambda c, x: call(c, x, 0)[1], init, x_example)
    zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), y_shape)
    carry, ys = init, []
    for i in range(length):
        if i < depth:
            carry, y = call(carry, x_at(i), i)
        else:
            y = zeros
        ys.append(y)
    if not ys:
        return carry, jax.tree_util.tree_map(lambda s: jnp.zeros((0,) + s.shape, s.dtype), y_shape)
    return carry, jax.tree_util.tree_map(lambda *rows: jnp.stack(rows), *ys)


def reference_while(cond, body, init, max_steps: int, key=None):
    """Eager ``while i < max_steps and cond(carry)``; returns ``(carry, steps)``.

    Works under ``jax.grad``/``jax.jacfwd`` (Python control flow on concrete values), not under
    ``jit`` or ``vmap``.
    """
    carry, i = init, 0
    while i < max_steps and bool(cond(carry)):
        carry = body(carry) if key is None else body(carry, _fold(key, i))
        i += 1
    return carry, i


def reference_while_scan(cond, body, init, max_steps: int, key=None):
    """Traceable reference: ``lax.scan`` of length ``max_steps`` with ``lax.cond``.

    Returns ``(carry, steps)``; usable under jit, vmap and every autodiff mode.
    """

    def step(state, i):
        carry, alive, n = state
        alive = alive & cond(carry)
        if key is None:
            run = body
        else:

            def run(c):
                return body(c, _fold(key, i))

        carry = lax.cond(alive, run, lambda c: c, carry)
        return (carry, alive, n + alive.astype(jnp.int32)), None

    state = (init, jnp.array(True), jnp.zeros((), jnp.int32))
    (carry, _, n), _ = lax.scan(step, state, jnp.arange(max_steps, dtype=jnp.int32))
    return carry, n


def seed_method(f, init, depth, key, max_iters: int):
    """The seed's program: scan over ``max_iters`` with ``lax.cond(step < depth, layer, id)``.

    ``f(x, key)``, or ``f(x)`` when ``key`` is None; step ``i`` gets ``fold_in(key, i)``.
    """

    def scan_step(carry, i):
        current_x, step = carry

        def layer():
            return f(current_x) if key is None else f(current_x, _fold(key, i))

        new_x = lax.cond(step < depth, layer, lambda: current_x)
        return (new_x, step + 1), None

    (out, _), _ = lax.scan(scan_step, (init, 0), jnp.arange(max_iters))
    return out


# ----------------------------------------------------------------------------- counting


class Counter:
    """Counts host callbacks: ``counter.tick()`` inside a traced function adds one per run.

    ``jax.debug.callback`` with no operands is called once per execution of the enclosing
    primitive (under ``vmap`` once per batched iteration, not once per sample).
    """

    def __init__(self) -> None:
        self.n = 0

    def _bump(self) -> None:
        self.n += 1

    def tick(self) -> None:
        jax.debug.callback(self._bump)

    def run(self, fn, *args) -> int:
        """Reset, run ``fn(*args)`` to completion, and return the number of ticks."""
        self.n = 0
        jax.block_until_ready(fn(*args))
        jax.effects_barrier()
        return self.n
