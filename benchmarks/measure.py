"""What the kernel meters share (``tpu_compile.py``, ``iteration_overhead.py``,
``recurrent_transformer.py``, ``memory_pressure.py``; ``scheduler.py`` takes its transformer
block from here): the machine line, compile time of distinct programs, temp memory, run time in
interleaved rounds, Markdown tables and the transformer block.

Everything here uses the public ``jax`` and ``dyndepth`` APIs only, so that the meters keep
measuring while the loop kernels change under them. Not a script: the meters import it (a
script's folder is first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dyndepth
from dyndepth import _budget as dd_budget
from dyndepth import _cost as dd_cost
from dyndepth_app.bench import time_in_rounds


def source_revision() -> str:
    """The git commit of the source tree the meters run (``+changes`` when ``src`` differs from
    it), so that a table says which kernels it measured; ``unknown`` outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    git = lambda *a: subprocess.run(["git", "-C", here, *a], capture_output=True, text=True)  # noqa: E731
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--", os.path.join(here, "..", "src")).stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def machine_line() -> str:
    """JAX, device, date and the load average: a meter's table is read against them (the
    development machine is shared, so the load says how much to trust a time)."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    dev = jax.devices()[0]
    return (
        f"jax {jax.__version__}, dyndepth {dyndepth.__version__} at {source_revision()}, "
        f"{dev.platform} "
        f"({dev.device_kind}, {jax.device_count()} device(s)), "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}; load average {load}"
    )


def uniform_depths(seed: int, batch: int, hi: int) -> jax.Array:
    """``batch`` int32 depths uniform in ``[1, hi]``."""
    return jax.random.randint(jax.random.PRNGKey(seed), (batch,), 1, hi + 1, dtype=jnp.int32)


def masked_scan(step: Callable, xs, depths, length: int, remat: bool = False,
                hoisted: bool = False):  # fmt: skip
    """The baseline every meter compares with: a ``lax.scan`` over ``length`` steps of a batch
    ``xs`` whose sample ``b`` keeps ``step``'s output while ``i < depths[b]`` and its carry after
    (a select, as the seed's ``lax.cond`` becomes under ``vmap``); with ``remat``, the step under
    ``jax.checkpoint`` (its residuals recomputed in the backward pass). ``hoisted``: the depths
    broadcast to the carry's shape before the scan, the mask then compared at that shape (on
    XLA's CPU backend, vector code for rows of a few elements where the broadcast row mask is
    scalar code: ``benchmarks/cpu_row_mask.py``)."""
    body = jax.checkpoint(step) if remat else step
    rows = depths.reshape((-1,) + (1,) * (xs.ndim - 1))
    bound = jnp.broadcast_to(rows, xs.shape) if hoisted else rows
    keep = lambda i: i < bound  # noqa: E731

    def one(c, i):
        return jnp.where(keep(i), body(c), c), None

    return jax.lax.scan(one, xs, jnp.arange(length))[0]


def compile_times(make: Callable[[int], Callable], args: Sequence, repeats: int):
    """Lower and compile ``jax.jit(make(i))`` for ``i = 0 .. repeats``: each ``make(i)`` must be a
    distinct program (e.g. a constant that depends on ``i``), so that no cache answers. The first
    (``i = 0``) fills JAX's own caches for these shapes and is discarded when ``repeats > 1``.

    Returns ``(lower_s, compile_s, compiled)``: the medians, and the last compiled program."""
    lower, comp = [], []
    for i in range(repeats + (repeats > 1)):
        t0 = time.perf_counter()
        lowered = jax.jit(make(i)).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        lower.append(t1 - t0)
        comp.append(time.perf_counter() - t1)
    skip = 1 if repeats > 1 else 0
    return statistics.median(lower[skip:]), statistics.median(comp[skip:]), compiled


def trace_as(platform: str) -> None:
    """Trace dyndepth's loops from now on as for ``platform`` (its decisions, such as a TPU's
    chain of the slot counts' loops or a GPU's stores), under this host's time model and
    stored-carry budget, so that every program chooses among the same counts and stores as
    many carries; they still run here. A private hook (``dyndepth._cost.current_platform``),
    for measurements only."""
    host = jax.default_backend()
    dd_cost.current_platform = lambda: host  # (the host's budget, whatever an earlier call set)
    dyndepth.set_stored_carry_budget(None if platform == host else dd_budget.default_budget())
    dd_cost.current_platform = lambda: platform
    dyndepth.set_iteration_cost(platform, dd_cost.backend_cost(host))


def temp_mib(compiled) -> float:
    """XLA's temp buffer size of a compiled program (its memory analysis), in MiB."""
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def best_seconds(calls: dict, rounds: int, warm_up: bool = True) -> dict:
    """Best seconds of each ``label: (compiled, args)`` over ``rounds`` rounds in which the calls
    take turns (``dyndepth bench``'s ``time_in_rounds``: load on a shared machine then falls on
    all of them alike), after one warm-up call each (unless ``warm_up`` is False: a quick run of
    calls that take seconds each)."""
    for fn, args in calls.values() if warm_up else ():
        jax.block_until_ready(fn(*args))
    seconds = time_in_rounds([(fn, args, rounds) for fn, args in calls.values()])
    return dict(zip(calls, seconds, strict=True))


def table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# The transformer block: a heavier step (attention and an MLP on one sample's (SEQ, D)
# activations), whose compiled copies, not the loop around them, dominate compile time.
SEQ, HEADS = 16, 4


def block(p, x):
    """A pre-norm transformer block on one sample's ``(SEQ, D)`` activations."""

    def norm(v):
        return (v - v.mean(-1, keepdims=True)) / jnp.sqrt(v.var(-1, keepdims=True) + 1e-5)

    h = norm(x)
    q, k, v = ((h @ p[w]).reshape(SEQ, HEADS, -1) for w in ("q", "k", "v"))
    att = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    x = x + jnp.einsum("hqk,khd->qhd", att, v).reshape(x.shape) @ p["o"]
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]


def block_shapes(width: int) -> dict:
    """The block's parameter shapes at model width ``width``."""
    square = (width, width)
    return dict(q=square, k=square, v=square, o=square, up=(width, 4 * width),
                down=(4 * width, width))  # fmt: skip
