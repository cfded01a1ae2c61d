"""Side-by-side benchmarks: the scan + cond baseline, plain JAX loops and dyndepth, one run.

    dyndepth bench [WORKLOAD ...] [--quick] [--repeats 5] [--json FILE] [--plot PNG]
                   [--max-temp-gib 16]
    python benchmarks/bench.py ...   # the same

Each workload is a residual layer closing over a weight ``W`` (D x D), a batch of per-sample
depths, per-sample keys, ``jax.vmap`` + ``jax.jit``. For every contender: forward time and
value_and_grad time (the best of ``--repeats`` calls blocking on the result, taken in
interleaved rounds after every function of the workload is compiled and warmed up), compile time
apart, XLA temp memory of the compiled gradient, executed vs useful sample-steps, and the largest
difference of outputs and gradients relative to the scan + cond baseline (which equals the
plain-Python reference: tests check that). Ratios are against that baseline, the first row
("scan+cond": ``lax.scan`` over ``max_depth`` steps with ``lax.cond(step < depth, layer,
identity)``, the usual way to write a traced depth in JAX). A compiled function whose XLA
temp memory exceeds ``--max-temp-gib`` is not run; its row says so and still shows the memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import dyndepth

from .args import Parser, check_interrupt, int_at_least, positive_float, renamed

__all__ = ["WORKLOADS", "main", "plot", "run_workload", "scan_cond_baseline"]


# ----------------------------------------------------------------------------- contenders


def scan_cond_baseline(layer, x, depth, key, max_iters, *, remat=False):
    """The scan + cond baseline: scan over max_iters with lax.cond(step < depth, layer, identity).

    Step ``i`` gets ``fold_in(key, i)``, dyndepth's schedule, so that results compare exactly.
    With ``remat`` each scan step runs under ``jax.checkpoint`` (stores only the carry).
    """

    def scan_step(carry, i):
        current_x, step = carry
        new_x = lax.cond(
            step < depth,
            lambda: layer(current_x, jax.random.fold_in(key, i)),
            lambda: current_x,
        )
        return (new_x, step + 1), None

    step = jax.checkpoint(scan_step) if remat else scan_step
    (out, _), _ = lax.scan(step, (x, 0), jnp.arange(max_iters))
    return out


def vmapped_while(layer, x, depth, key):
    """A plain lax.while_loop (forward only: not reverse-differentiable)."""

    def body(s):
        i, c = s
        return i + 1, layer(c, jax.random.fold_in(key, i))

    return lax.while_loop(lambda s: s[0] < depth, body, (0, x))[1]


def remat_scan_cond_baseline(layer, x, depth, key, max_iters):
    """The scan + cond baseline with each scan step under ``jax.checkpoint``."""
    return scan_cond_baseline(layer, x, depth, key, max_iters, remat=True)


def equinox_checkpointed(layer, x, depth, key, max_iters):
    """Equinox's ``equinox.internal.while_loop(kind="checkpointed")`` with its default
    checkpoints (online treeverse), the strongest public differentiable dynamic loop."""
    import equinox.internal as eqxi

    def body(s):
        i, c = s
        return i + 1, layer(c, jax.random.fold_in(key, i))

    return eqxi.while_loop(
        lambda s: s[0] < depth, body, (jnp.int32(0), x), max_steps=max_iters, kind="checkpointed"
    )[1]


def equinox_available():
    try:
        import equinox.internal  # noqa: F401
    except ImportError:
        return False
    return True


def make_layer(W, kind):
    """``x + tanh(x @ W)``; (``dropout``) the dropout residual example's ReLU residual with
    dropout 0.5 on the step key; (``tanh-dropout``) ``x + dropout(tanh(x @ W))``, dropout 0.5 on
    the step key."""
    if kind in ("dropout", "tanh-dropout"):
        act = jax.nn.relu if kind == "dropout" else jnp.tanh

        def layer(x, key):
            h = act(x @ W)
            keep = jax.random.bernoulli(key, 0.5, h.shape)
            return x + jnp.where(keep, h * 2.0, 0.0)

        return layer

    def layer(x, key):
        del key
        return x + jnp.tanh(x @ W)

    return layer


@dataclass
class Contender:
    name: str
    fn: Callable  # (W, x, depth, key, max_depth, kind) -> x, one sample
    grad: bool  # reverse-differentiable?
    stats: bool = False  # reports executed sample-steps through repeat_batched
    batched: bool = False  # called on the whole batch (repeat_batched) instead of under vmap
    checkpoints: int | None = None  # (batched) repeat_batched's checkpoints
    full: bool = False  # runs all max_depth steps for every sample (scan + cond under vmap)


def _dd(strategy, checkpoints=None):
    def fn(W, x, d, k, max_depth, kind):
        return dyndepth.repeat(
            make_layer(W, kind),
            x,
            d,
            max_depth=max_depth,
            key=k,
            strategy=strategy,
            checkpoints=checkpoints,
        )

    return fn


def _wrap(method):
    def fn(W, x, d, k, max_depth, kind):
        return method(make_layer(W, kind), x, d, k, max_depth)

    return fn


CONTENDERS = [
    Contender("scan+cond", _wrap(scan_cond_baseline), True, full=True),
    Contender("jax.checkpoint scan+cond", _wrap(remat_scan_cond_baseline), True, full=True),
    Contender("lax.while_loop", _wrap(lambda f, x, d, k, m: vmapped_while(f, x, d, k)), False),
    Contender("equinox checkpointed", _wrap(equinox_checkpointed), True),
    Contender("dyndepth while", _dd("while"), False),
    Contender("dyndepth checkpointed", _dd("checkpointed"), True),
    Contender("dyndepth auto", _dd("auto"), True, stats=True),
    Contender("dyndepth repeat_batched", None, True, stats=True, batched=True),
]


# ----------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    batch: int
    dim: int
    max_depth: int
    depths: str  # "uniform" | "long-tail"
    layer: str  # "tanh" | "dropout" | "tanh-dropout"
    about: str
    # also list dyndepth auto / repeat_batched with checkpoints=K (separate rows)
    checkpoints: int | None = None
    notes: tuple[str, ...] = ()  # printed under the table


def checkpointed_contenders(k):
    """The ``checkpoints=k`` rows: ``vmap(repeat(strategy="auto"))`` and ``repeat_batched``."""
    return [
        Contender(f"dyndepth auto checkpoints={k}", _dd("auto", k), True, stats=True),
        Contender(
            f"dyndepth repeat_batched checkpoints={k}",
            None,
            True,
            stats=True,
            batched=True,
            checkpoints=k,
        ),
    ]


def contenders_for(w: Workload):
    """Every contender that runs on ``w``: ``CONTENDERS``, then its ``checkpoints=K`` rows."""
    extra = [] if w.checkpoints is None else checkpointed_contenders(w.checkpoints)
    return CONTENDERS + extra


def quick(w: Workload) -> Workload:
    """``w`` at tiny shapes (B=8, D=8, max_depth=12), for tests."""
    return dataclasses.replace(
        w,
        batch=8,
        dim=8,
        max_depth=12,
        about="quick",
        checkpoints=None if w.checkpoints is None else 4,
        notes=(),
    )


WORKLOADS = {
    "dropout-residual": Workload(
        "dropout-residual",
        32,
        64,
        100,
        "uniform",
        "dropout",
        "the README quickstart's sizes, its dropout layer",
    ),
    "core": Workload("core", 256, 64, 100, "uniform", "tanh", "B=256, D=64 tanh residual"),
    "per-sample": Workload(
        "per-sample",
        256,
        256,
        100,
        "uniform",
        "dropout",
        "the quickstart's dropout layer, larger: B=256, D=256",
    ),
    "long-tail": Workload(
        "long-tail",
        256,
        64,
        256,
        "long-tail",
        "tanh",
        "1 + Poisson(LogNormal), mean 32",
        checkpoints=16,
        notes=(
            "With `checkpoints=None` the dyndepth rows store max_depth = 256 carries per sample; "
            "the `checkpoints=16` rows store at most 16 + 16 (checkpoints + recompute buffer) and "
            "recompute between checkpoints. Their backward pass runs masked over the batch "
            "(B x max(depth) sample-steps, like `dyndepth checkpointed`), not scheduled: the "
            "executed / useful column counts their (scheduled) forward pass only.",
        ),
    ),
    "big-params": Workload(
        "big-params",
        32,
        1024,
        16,
        "uniform",
        "tanh-dropout",
        "a layer closing over a 1024 x 1024 weight (4 MiB)",
        notes=(
            "W is shared by the batch. Under vmap the baseline's `lax.cond` becomes a select over "
            "the batch and W is broadcast to every sample (B x 4 MiB, in the forward pass too), "
            "and the gradient keeps such a copy for every step; `jax.checkpoint` drops the "
            "stored copies but still computes with them. Equinox's loop keeps a W gradient per "
            "sample (B x 4 MiB); the dyndepth loops under `grad` of `vmap` (and "
            "`repeat_batched`) sum the W gradient inside their backward loop.",
            "Sizes are kept small (B=32, max_depth=16) so that the scan + cond baseline still "
            "runs: "
            "at B=64, max_depth=32 its value_and_grad took 34-56 s per call on the 2-core "
            "development machine and needed 10.5 GiB of XLA temp memory.",
            "rel. diff is about 5e-6 here, not 1e-7: float32 rounding of 1024-term dot "
            "products. The scan + cond baseline and `repeat_batched` are both 5-6e-6 away from a "
            "float64 plain-Python loop with the same dropout masks.",
        ),
    ),
}


def draw_depths(key, w: Workload):
    if w.depths == "uniform":
        return jax.random.randint(key, (w.batch,), 1, w.max_depth + 1)
    k1, k2 = jax.random.split(key)
    sigma = 0.5
    tau = jnp.exp(jnp.log(32.0) - sigma**2 / 2 + sigma * jax.random.normal(k1, (w.batch,)))
    return jnp.clip(1 + jax.random.poisson(k2, tau), 1, w.max_depth).astype(jnp.int32)


# ----------------------------------------------------------------------------- measuring


def compile_fn(fn, args):
    """(compiled, compile seconds, XLA temp bytes or None) of ``jax.jit(fn)`` on ``args``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
    return compiled, compile_s, temp


def warm_up(compiled, args, repeats, budget_s=3.0):
    """(result, timed calls to make): one untimed call; then ``repeats`` timed ones, fewer for
    a slow function (at most ``budget_s`` seconds of them)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    warm = time.perf_counter() - t0
    return out, max(1, min(repeats, int(budget_s / max(warm, 1e-9))))


def _timed_call(compiled, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - t0


def time_in_rounds(calls):
    """Best seconds of each ``(compiled, args, n)`` in ``calls`` over its ``n`` timed calls, the
    calls taking turns: round ``r`` calls each function that has more than ``r`` calls to make,
    so that load on a shared machine falls on all of them alike rather than on whichever ran
    during it, and the best of the rounds is what the code itself costs. Round ``r`` starts at
    the ``r``-th function (in rotation), so that none always runs first, after the previous
    round's last one has filled the caches with its own data."""
    times = [[] for _ in calls]
    for r in range(max((n for _, _, n in calls), default=0)):
        for j in range(len(calls)):
            k = (r + j) % len(calls)
            compiled, args, n = calls[k]
            if r < n:
                times[k].append(_timed_call(compiled, args))
    return [min(ts) for ts in times]


def _time_rows(timed) -> None:
    """Time every ``(row, key, compiled, args, n)`` of ``timed`` in interleaved rounds and write
    each best time into its row under ``key``."""
    seconds = time_in_rounds([(compiled, args, n) for _, _, compiled, args, n in timed])
    for (row, key, *_), t in zip(timed, seconds, strict=True):
        row[key] = t


def rel_err(a, b):
    """max |a - b| / max |b| over all leaves: the correctness column."""
    num = max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True))
    den = max(float(jnp.max(jnp.abs(y))) for y in b)
    return num / max(den, 1e-30)


def _measure(fn, args, repeats, max_temp_bytes):
    """Compile ``fn`` and warm it up unless its XLA temp memory exceeds ``max_temp_bytes``.

    Returns a dict: ``compile_s``, ``temp``, then ``compiled``, ``n`` (timed calls to make)
    and ``out``, or ``note`` (not run)."""
    compiled, compile_s, temp = compile_fn(fn, args)
    res = dict(compile_s=compile_s, temp=temp)
    if max_temp_bytes is not None and temp is not None and temp > max_temp_bytes:
        res["note"] = (
            f"not run: XLA temp {temp / 2**30:.1f} GiB > --max-temp-gib {max_temp_bytes / 2**30:g}"
        )
        return res
    res["out"], res["n"] = warm_up(compiled, args, repeats)
    res["compiled"] = compiled
    return res


def run_workload(w: Workload, repeats: int, contenders=None, progress=print, max_temp_bytes=None):
    """Measure every contender on ``w``; returns a list of row dicts.

    Every function is compiled and warmed up first; then they are timed in interleaved rounds
    (:func:`time_in_rounds`). The correctness columns compare with the first contender that ran
    (the scan + cond baseline unless ``max_temp_bytes`` kept it from running); each row names it in
    ``fwd_ref`` / ``grad_ref``."""
    k_w, k_x, k_d, k_k = jax.random.split(jax.random.PRNGKey(0), 4)
    W = jax.random.normal(k_w, (w.dim, w.dim)) / jnp.sqrt(w.dim)
    xs = jax.random.normal(k_x, (w.batch, w.dim))
    ds = draw_depths(k_d, w)
    ks = jax.random.split(k_k, w.batch)
    args = (W, xs, ds, ks)
    rows, timed, refs = [], [], {}
    for c in contenders if contenders is not None else contenders_for(w):
        check_interrupt(f"interrupted during the {w.name} workload; nothing was written")
        if c.name.startswith("equinox") and not equinox_available():
            rows.append(
                dict(
                    workload=w.name, contender=c.name, missing="not installed (pip install equinox)"
                )
            )
            continue
        run = _Run(w, c, args, repeats, max_temp_bytes, progress)
        rows.append(run.row(refs, timed))
    check_interrupt(f"interrupted during the {w.name} workload; nothing was written")
    progress(f"  [{w.name}] timing, {repeats} interleaved rounds", flush=True)
    _time_rows(timed)
    return rows


@dataclass(frozen=True)
class _Run:
    """One contender on one workload: its forward and value_and_grad functions."""

    w: Workload
    c: Contender
    args: tuple
    repeats: int
    max_temp_bytes: int | None
    progress: Callable

    def batched(self, W, xs, ds, ks, **kw):
        layer = make_layer(W, self.w.layer)
        return dyndepth.repeat_batched(
            layer, xs, ds, max_depth=self.w.max_depth, keys=ks, checkpoints=self.c.checkpoints,
            **kw,
        )  # fmt: skip

    def fwd(self, W, xs, ds, ks):
        c, w = self.c, self.w
        if c.batched:
            return self.batched(W, xs, ds, ks)
        return jax.vmap(lambda x, d, k: c.fn(W, x, d, k, w.max_depth, w.layer))(xs, ds, ks)

    def loss(self, W, xs, ds, ks):
        return jnp.mean(self.fwd(W, xs, ds, ks) ** 2)

    def row(self, refs: dict, timed: list) -> dict:
        """The row without its times; appends ``(row, key, compiled, args, n)`` to ``timed`` for
        each function to time, and records in ``refs`` the first outputs (the reference)."""
        w, c = self.w, self.c
        row = dict(workload=w.name, contender=c.name)
        for kind, fn in (("fwd", self.fwd), ("grad", jax.value_and_grad(self.loss, (0, 1)))):
            if kind == "grad" and not c.grad:
                continue
            label = "forward" if kind == "fwd" else "value_and_grad"
            self.progress(f"  [{w.name}] {c.name}: {label}", flush=True)
            m = _measure(fn, self.args, self.repeats, self.max_temp_bytes)
            row[f"{kind}_compile_s"] = m["compile_s"]
            if kind == "grad":
                row["grad_temp_bytes"] = m["temp"]
            if "note" in m:
                row[f"{kind}_note"] = m["note"]
                continue
            out = [m["out"]] if kind == "fwd" else list(m["out"][1])
            refs.setdefault(kind, (c.name, out))
            row[f"{kind}_rel_err"] = rel_err(out, refs[kind][1])
            row[f"{kind}_ref"] = refs[kind][0]
            timed.append((row, f"{kind}_s", m["compiled"], self.args, m["n"]))
        row["executed"] = self.executed()
        row["useful"] = int(self.args[2].sum())
        return row

    def executed(self) -> int:
        w, c, (W, xs, ds, ks) = self.w, self.c, self.args
        if c.full:
            return w.batch * w.max_depth
        if c.stats:
            return int(self.batched(W, xs, ds, ks, return_stats=True)[1]["executed_sample_steps"])
        return w.batch * int(ds.max())


def shared_depth_rows(repeats, quick, progress=print):
    """One depth for the whole batch, swept: the cost must follow the depth."""
    B, D, M = (8, 8, 12) if quick else (256, 64, 100)
    sweep = (3, 12) if quick else (10, 25, 50, 100)
    k_w, k_x, k_k = jax.random.split(jax.random.PRNGKey(1), 3)
    W = jax.random.normal(k_w, (D, D)) / jnp.sqrt(D)
    xs = jax.random.normal(k_x, (B, D))
    ks = jax.random.split(k_k, B)
    rows, timed = [], []
    for c in [c for c in CONTENDERS if c.grad]:
        if c.name.startswith("equinox") and not equinox_available():
            continue
        for depth in sweep:
            check_interrupt("interrupted during the shared-depth sweep; nothing was written")

            def fwd(W, xs, d, ks, c=c):
                if c.batched:  # the same depth for every sample
                    ds = jnp.full((B,), d, jnp.int32)
                    return dyndepth.repeat_batched(
                        make_layer(W, "tanh"), xs, ds, max_depth=M, keys=ks
                    )
                return jax.vmap(lambda x, k: c.fn(W, x, d, k, M, "tanh"))(xs, ks)

            def loss(W, xs, d, ks, fwd=fwd):
                return jnp.mean(fwd(W, xs, d, ks) ** 2)

            progress(f"  [shared-depth] {c.name} depth {depth}", flush=True)
            a = (W, xs, jnp.asarray(depth, jnp.int32), ks)
            row = dict(contender=c.name, depth=depth, batch=B, dim=D, max_depth=M)
            for key, fn in (("fwd_s", fwd), ("grad_s", jax.value_and_grad(loss))):
                compiled = compile_fn(fn, a)[0]
                timed.append((row, key, compiled, a, warm_up(compiled, a, repeats)[1]))
            rows.append(row)
    progress(f"  [shared-depth] timing, {repeats} interleaved rounds", flush=True)
    _time_rows(timed)
    return rows


# ----------------------------------------------------------------------------- reporting


def _ms(s):
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _x(base, v):
    return "" if (base is None or v is None) else f"{base / v:.1f}x"


def table(rows, notes=()):
    """The markdown table of ``run_workload``'s rows, then ``notes`` as a list."""
    base = rows[0]
    out = [
        "| contender | forward ms | vs scan+cond | value_and_grad ms | vs scan+cond "
        "| grad temp MiB | vs scan+cond | executed / useful sample-steps | compile fwd / grad s "
        "| rel. diff fwd / grad |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "missing" in r:
            out.append(f"| {r['contender']} | {r['missing']} |" + " |" * 8)
            continue
        mem = r.get("grad_temp_bytes")
        bmem = base.get("grad_temp_bytes")
        fwd_err = r.get("fwd_rel_err")
        grad_err = r.get("grad_rel_err")
        cells = [
            r["contender"],
            r.get("fwd_note") or _ms(r.get("fwd_s")),
            _x(base.get("fwd_s"), r.get("fwd_s")),
            r.get("grad_note") or _ms(r.get("grad_s")),
            _x(base.get("grad_s"), r.get("grad_s")),
            "n/a" if mem is None else f"{mem / 2**20:.2f}",
            "" if (mem is None or bmem is None) else f"{bmem / max(mem, 1):.0f}x",
            f"{r['executed']} / {r['useful']} ({r['executed'] / r['useful']:.2f}x)",
            f"{r['fwd_compile_s']:.2f} / "
            + ("-" if "grad_compile_s" not in r else f"{r['grad_compile_s']:.2f}"),
            ("-" if fwd_err is None else f"{fwd_err:.1e}")
            + " / "
            + ("-" if grad_err is None else f"{grad_err:.1e}"),
        ]
        out.append("| " + " | ".join(cells) + " |")
    notes = list(notes)
    for key, what in (("fwd_ref", "outputs"), ("grad_ref", "gradients")):
        refs = {r[key] for r in rows if key in r}
        if refs and refs != {base["contender"]}:
            notes.append(
                f"rel. diff of {what} is against `{', '.join(sorted(refs))}`: "
                f"`{base['contender']}` was not run."
            )
    if notes:
        out.append("")
        out.extend(f"- {n}" for n in notes)
    return "\n".join(out)


def shared_table(rows):
    out = ["| contender | depth | forward ms | value_and_grad ms |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['contender']} | {r['depth']} | {_ms(r['fwd_s'])} | {_ms(r['grad_s'])} |")
    by = {}
    for r in rows:
        by.setdefault(r["contender"], []).append(r)
    out.append("")
    for name, rs in by.items():
        lo, hi = rs[0], rs[-1]
        out.append(
            f"- {name}: depth {lo['depth']} costs {lo['fwd_s'] / hi['fwd_s']:.2f}x (forward) and "
            f"{lo['grad_s'] / hi['grad_s']:.2f}x (value_and_grad) of depth {hi['depth']}"
        )
    return "\n".join(out)


def header():
    return (
        f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}, "
        f"{jax.device_count()} device(s)), jax {jax.__version__}, dyndepth "
        f"{dyndepth.__version__}, python {platform.python_version()}, numpy {np.__version__}"
    )


# ----------------------------------------------------------------------------- plotting


def plot(report, path):
    """Draw ``main``'s report as a PNG at ``path`` (matplotlib, Agg; imported here only).

    ``shared-depth``: forward and value_and_grad time against the depth, one line per contender.
    Other workloads: grouped bars of value_and_grad time and of its XLA temp memory, one group per
    workload, one bar per differentiable contender. Log scales; rows that did not run are marked.
    """
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    wls = report["workloads"]
    shared = wls.get("shared-depth") or []
    # per-sample workloads: the differentiable contenders (and those not installed)
    groups = [
        (n, [r for r in rs if "grad_temp_bytes" in r or "missing" in r])
        for n, rs in wls.items()
        if n != "shared-depth"
    ]
    names = []
    for rs in [shared, *(g for _, g in groups)]:
        for r in rs:
            if r["contender"] not in names:
                names.append(r["contender"])

    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    color = {n: cmap(i % cmap.N) for i, n in enumerate(names)}

    nrows = int(bool(shared)) + int(bool(groups))
    fig = Figure(figsize=(14, 4.8 * max(nrows, 1) + 1.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(nrows, 1), 2, squeeze=False)
    row = 0
    if shared:
        by = {}
        for r in shared:
            by.setdefault(r["contender"], []).append(r)
        r0 = shared[0]
        for ax, key, what in (
            (axes[row][0], "fwd_s", "forward"),
            (axes[row][1], "grad_s", "value_and_grad"),
        ):
            for n, rs in by.items():
                ax.plot(
                    [r["depth"] for r in rs],
                    [r[key] * 1e3 for r in rs],
                    marker="o",
                    color=color[n],
                    label=n,
                )
            ax.set_yscale("log")
            ax.set_xticks(sorted({r["depth"] for r in shared}))
            ax.set_xlabel("depth (one for the whole batch)")
            ax.set_ylabel(f"{what} ms")
            ax.set_title(
                f"shared-depth: {what} (B={r0['batch']}, D={r0['dim']}, "
                f"max_depth={r0['max_depth']})"
            )
            ax.grid(True, which="both", alpha=0.3)
        row += 1
    if groups:
        width = 0.85 / max(max(len(g) for _, g in groups), 1)
        for ax, what in ((axes[row][0], "time"), (axes[row][1], "memory")):
            for gi, (_, rs) in enumerate(groups):
                x0 = gi - width * (len(rs) - 1) / 2
                for j, r in enumerate(rs):
                    x = x0 + j * width
                    if what == "time":
                        v = r.get("grad_s")
                        v = None if v is None else v * 1e3
                    else:
                        v = r.get("grad_temp_bytes")
                        v = None if v is None else v / 2**20
                    if v is None:
                        label = "n/i" if "missing" in r else "not run"
                        ax.text(
                            x,
                            0.02,
                            label,
                            rotation=90,
                            ha="center",
                            va="bottom",
                            fontsize=7,
                            color=color[r["contender"]],
                            transform=ax.get_xaxis_transform(),
                        )
                        continue
                    ax.bar(x, v, width=width, color=color[r["contender"]])
            ax.set_yscale("log")
            ax.set_xticks(range(len(groups)), [n for n, _ in groups])
            ax.set_ylabel("value_and_grad ms" if what == "time" else "grad XLA temp MiB")
            ax.set_title(
                "value_and_grad time (per-sample depths)"
                if what == "time"
                else "XLA temp memory of value_and_grad"
            )
            ax.grid(True, axis="y", which="both", alpha=0.3)
    handles = [Patch(color=color[n], label=n) for n in names]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(report.get("header", ""), fontsize=9)
    legend_rows = (len(names) + 3) // 4
    fig.tight_layout(rect=(0, 0.035 * legend_rows / max(nrows, 1), 1, 0.97))
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(path, dpi=100)


# ----------------------------------------------------------------------------- command line


# Old workload names, still accepted for one release.
RENAMED_WORKLOADS = {"seed": "dropout-residual"}


def main(argv=None):
    names = list(WORKLOADS) + ["shared-depth"]
    listing = [f"  {n:<17} {w.about}" for n, w in WORKLOADS.items()]
    listing.append(f"  {'shared-depth':<17} one depth for the whole batch, swept over 10..100")
    p = Parser(
        prog="dyndepth bench",
        description=__doc__.splitlines()[0],
        epilog="workloads:\n" + "\n".join(listing),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("workloads", nargs="*", help="workloads to run (default: all, listed below)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run at tiny shapes (its times say nothing about speed)",
    )
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="timing repeats (>= 1)")
    p.add_argument("--json", metavar="FILE", help="also write all rows as JSON")
    p.add_argument(
        "--plot",
        metavar="PNG",
        help="also draw the results as a PNG at this path (needs matplotlib; nothing is drawn "
        "without this option), e.g. benchmarks/bench.png: time vs depth for shared-depth, "
        "grouped bars of value_and_grad time and temp memory for the other workloads",
    )
    p.add_argument(
        "--max-temp-gib",
        type=positive_float,
        default=16.0,
        metavar="GIB",
        help="do not run a compiled function whose XLA temp memory exceeds this; its row says "
        "so and still shows the memory (default: %(default)s)",
    )
    a = p.parse_args(argv)
    a.workloads = [
        renamed(name, RENAMED_WORKLOADS, "dyndepth bench", "workload") for name in a.workloads
    ]
    for name in a.workloads:
        if name not in names:
            p.error(f"unknown workload {name!r}; choose from {names}")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("--plot needs matplotlib (pip install matplotlib)")
    chosen = a.workloads or names
    print(header())
    print(f"command: dyndepth bench {' '.join(argv if argv is not None else sys.argv[1:])}")
    if a.quick:
        print(
            "--quick: a smoke run at tiny shapes, to check that every contender runs; its "
            "times are noise and say nothing about speed (run without --quick for figures)"
        )
    report = {"header": header(), "workloads": {}, "meta": {}}
    max_temp = a.max_temp_gib * 2**30
    for name in chosen:
        if name == "shared-depth":
            rows = shared_depth_rows(a.repeats, a.quick, progress=_progress)
            print("\n### shared-depth: one depth for the whole batch\n")
            print(shared_table(rows), flush=True)
        else:
            w = WORKLOADS[name]
            if a.quick:
                w = quick(w)
            rows = run_workload(w, a.repeats, progress=_progress, max_temp_bytes=max_temp)
            print(
                f"\n### {w.name}: {w.about}; B={w.batch}, D={w.dim}, max_depth={w.max_depth}, "
                f"{w.depths} depths, {w.layer} layer\n"
            )
            print(table(rows, w.notes), flush=True)
            report["meta"][name] = dataclasses.asdict(w)
        report["workloads"][name] = rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if a.plot:
        plot(report, a.plot)
        print(f"\nplot: {a.plot}")
    return report


def _progress(msg, flush=True):
    print(msg, file=sys.stderr, flush=flush)


if __name__ == "__main__":
    main()
