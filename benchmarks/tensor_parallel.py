"""Can a Megatron-split step keep its weights split over ``model`` inside a dyndepth loop on an
``Auto`` 4x2 mesh, with per-device trip counts over ``data``?

Run: ``python benchmarks/tensor_parallel.py`` (it starts 8 simulated CPU devices itself).

For each approach it compiles ``jit(value_and_grad(loss))`` of a Megatron MLP step
(``c + tanh(c @ W1) @ W2``, ``W1`` split by columns and ``W2`` by rows over ``model``, the batch
and the per-sample depths split over ``data``) and prints:

- ``weight_gathers``: all-gathers whose result is a whole model-split weight (the weight
  replicated: tensor parallelism dropped);
- ``in_loops``: every collective inside a while loop's body or condition, with its device
  groups, and whether a group spans several ``data`` shards (``spans_data``: with trip counts
  that differ per ``data`` shard such a collective never completes) or is a collective-permute
  (on the CPU runtime its rendezvous takes every device of the program, whatever its pairs:
  the same hang);
- ``err``: max |diff| of the value and the gradients vs the same computation on one device, or
  why the program was not run (a program that can hang is only compiled).

Approaches:

1. ``library``: dyndepth as it is, plain ``jit`` (``custom_partitioning``, per device over
   ``data``; the model-split weights are gathered before the loop).
2. ``lax_lockstep``: the reference Equinox-style loop: ``vmap(lax.while_loop)``, every sample
   runs until the batch's longest is done (one trip count for every device). XLA keeps the
   weights split and runs the matmul's all-reduce over ``model`` inside the loop, and an
   all-reduce over the whole batch (``data``) in the loop condition: right only because every
   device runs the same number of steps.
3. ``partial_manual_lax``: a ``shard_map`` manual over ``data`` only (``model`` left ``Auto``),
   ``vmap(lax.while_loop)`` inside: per-device trip counts over ``data``.
4. ``partial_manual_dyndepth``: the same with ``vmap(dyndepth.repeat)`` (dyndepth refuses this at
   trace time; the check is switched off here to see what XLA would compile).
5. ``partial_manual_dyndepth_pinned``: 4 with the step's carry pinned as replicated over
   ``model`` (``with_sharding_constraint``), to keep XLA from splitting the loop state over
   ``model``.
6. ``full_manual``: a ``shard_map`` manual over both axes with the step's ``psum`` over
   ``model`` written out: the form that works.

A ``custom_partitioning`` rule that keeps the ``model`` sharding is not among them: its lowering
function is traced on each device's shards and lowered manual over *every* mesh axis, so the
step would see half of ``W1`` and ``W2`` with no ``psum`` over ``model`` (it was traced on the
whole weights, without one): a manual region cannot hand the ``model`` axis back to XLA's
partitioner. Keeping it would mean rewriting the user's step with collectives (a partitioner of
our own).

What it showed (JAX 0.10.2, CPU; ``err`` relative to the largest value; see the printout):

- ``library`` gathers every model-split weight once before the loop (2 for the MLP, 6 for the
  block), nothing inside the loops, err ~1e-7: right, but tensor parallelism is dropped.
- ``lax_lockstep`` keeps the weights split (0 gathers) with the all-reduces over ``model``
  inside the loop, and one all-reduce spanning the ``data`` shards inside it too: safe only
  because every device runs ``T`` steps.
- ``partial_manual_*`` (lax and dyndepth, pinned or not): 0 gathers, every in-loop collective an
  all-reduce within a ``model`` pair ({0,1},{2,3},...), and the program runs with per-device
  trip counts and equals one device (err ~1e-7), for this MLP and this block. The same held in
  a side probe for ``repeat`` with keys, ``while_loop`` and ``nn.recurrent_depth`` on a block
  with Equinox-style per-row linears, biases and a norm gain (64 rows, scheduler slots on).
  But nothing makes it hold in general: which collectives the partitioner puts in the loop is
  XLA's choice after dyndepth has lowered the program (an earlier session saw
  collective-permutes in a transformer block's gradient, whose CPU rendezvous takes every
  device: the process aborted), and no public API lets the library see or forbid them before
  the program runs. So dyndepth keeps refusing that form at trace time and does not adopt it.
- ``full_manual`` (the step's ``psum`` over ``model`` written out): 0 gathers, only the
  all-reduces the step asks for inside the loop, err ~1e-7: the form dyndepth documents.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

CHILD = "DYNDEPTH_TP_CHILD"


def main() -> None:
    if os.environ.get(CHILD) != "1":
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
        flags.append("--xla_force_host_platform_device_count=8")
        env = dict(os.environ, XLA_FLAGS=" ".join(flags), **{CHILD: "1"})
        sys.exit(subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env).returncode)
    experiment()


def experiment() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    B, S, D, H = 16, 4, 8, 24
    k = jax.random.split(jax.random.PRNGKey(0), 10)
    # per-sample depths, every data shard's longest one different
    ds = jnp.array([1, 2, 0, 1, 3, 2, 1, 0, 4, 1, 2, 3, 6, 5, 1, 2], jnp.int32)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    cols, rows = P(None, "model"), P("model", None)  # Megatron: split by columns, then rows

    def mlp(params, reduce=lambda h: h):
        W1, W2 = params
        return lambda c: c + reduce(jnp.tanh(c @ W1) @ W2)

    def norm(h):
        h = h - h.mean(-1, keepdims=True)
        return h * lax.rsqrt((h * h).mean(-1, keepdims=True) + 1e-5)

    def block(params, reduce=lambda h: h):  # a transformer block; the heads split over model
        Wq, Wk, Wv, Wo, W1, W2 = params

        def step(c):  # c: one sample's (S, D) sequence
            h = norm(c)
            heads = lambda W: (h @ W).reshape(S, -1, 4)  # head dim 4
            q, kk, v = heads(Wq), heads(Wk), heads(Wv)
            a = jax.nn.softmax(jnp.einsum("shd,thd->hst", q, kk) / 2.0, axis=-1)
            o = jnp.einsum("hst,thd->shd", a, v).reshape(S, -1)
            c = c + reduce(o @ Wo)
            return c + reduce(jnp.tanh(norm(c) @ W1) @ W2)

        return step

    def weights(shapes):
        return [
            jax.random.normal(kk, sh) / (2 * sh[0] ** 0.5)
            for kk, sh in zip(k, shapes, strict=False)
        ]

    cases = {  # name: (step, weights, their specs, one sample's carry shape)
        "mlp": (mlp, weights([(D, H), (H, D)]), [cols, rows], (D,)),
        "block": (block, weights([(D, D)] * 3 + [(D, D), (D, H), (H, D)]),
                  [cols] * 3 + [rows, cols, rows], (S, D)),
    }  # fmt: skip

    for case, (step_of, params, specs, carry) in cases.items():
        xs = jax.random.normal(k[9], (B, *carry))
        args = ([put(w, s) for w, s in zip(params, specs, strict=True)], put(xs, P("data")),
                put(ds, P("data")))  # fmt: skip
        shapes = {f"f32[{','.join(map(str, w.shape))}]" for w in params}
        print(f"== {case}: weights {sorted(shapes)}, batch {xs.shape} over data", flush=True)
        compare(case, step_of, params, specs, xs, args, shapes)


def compare(case, step_of, params, specs, xs, args, weight_shapes):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import dyndepth as dd

    mesh = args[1].sharding.mesh
    data_of = {int(d.id): i for i, row in enumerate(mesh.devices) for d in row}
    T = 6
    ds_host = np.asarray(args[2])

    def dd_vmap(step):
        def run(params, xs, ds):
            return jax.vmap(lambda x, d: dd.repeat(step(params), x, d, max_depth=T))(xs, ds)

        return run

    def lax_lockstep(params, xs, ds):
        # T steps, each sample's carry frozen after its depth (reverse-differentiable, as
        # Equinox's checkpointed while loop is; one trip count for every device)
        def one(x, d):
            body = lambda i, c: jnp.where(i < d, step_of(params)(c), c)
            return lax.fori_loop(0, T, body, x)

        return jax.vmap(one)(xs, ds)

    def lax_per_device(params, xs, ds):  # forward only: a while loop's trip count is traced
        def one(x, d):
            body = lambda s: (s[0] + 1, step_of(params)(s[1]))
            return lax.while_loop(lambda s: s[0] < d, body, (jnp.int32(0), x))[1]

        return jax.vmap(one)(xs, ds)

    def partial_manual(run):
        return jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                             out_specs=P("data"), axis_names={"data"})  # fmt: skip

    def pinned(params):
        inner = step_of(params)
        return lambda c: lax.with_sharding_constraint(inner(c), P())

    full_manual = jax.shard_map(
        dd_vmap(lambda p: step_of(p, lambda h: lax.psum(h, "model"))), mesh=mesh,
        in_specs=(list(specs), P("data"), P("data")), out_specs=P("data"),
    )  # fmt: skip

    approaches = {  # name: (program, differentiated)
        "library": (dd_vmap(step_of), True),
        "lax_lockstep": (lax_lockstep, True),
        "partial_manual_lax": (partial_manual(lax_per_device), False),
        "partial_manual_dyndepth": (partial_manual(dd_vmap(step_of)), True),
        "partial_manual_dyndepth_pinned": (partial_manual(dd_vmap(pinned)), True),
        "full_manual": (full_manual, True),
    }

    loss = lambda run: lambda *a: jnp.sum(run(*a) ** 2)
    one_device = (params, xs, jnp.asarray(ds_host))
    want_grad = jax.value_and_grad(loss(dd_vmap(step_of)), (0, 1))(*one_device)
    want_fwd = dd_vmap(step_of)(*one_device)

    def groups(line: str) -> list[list[int]]:
        m = re.search(r"source_target_pairs=\{([^ ]*)\}", line)
        if m:
            return [
                [int(a) for a in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))
            ]
        m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        if m:
            shape = [int(v) for v in m.group(1).split(",")]
            ids = np.arange(int(np.prod([int(v) for v in m.group(2).split(",")])))
            ids = ids.reshape([int(v) for v in m.group(2).split(",")])
            if m.group(3):
                ids = ids.transpose([int(v) for v in m.group(3).split(",")])
            return ids.reshape(shape).tolist()
        m = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        if m:
            return [
                [int(v) for v in g.split(",") if v] for g in re.findall(r"\{([\d,]*)\}", m.group(1))
            ]
        return [sorted(data_of)]  # no groups written: every device

    def in_loops(hlo: str) -> list[dict]:
        loops = set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", hlo))
        found = []
        for comp in hlo.split("\n\n"):
            head = comp.strip().split("\n", 1)[0]
            if not head or head.split()[0].lstrip("%") not in loops:
                continue
            for line in comp.splitlines():
                op = re.search(r"\b(all-reduce|all-gather|collective-permute|all-to-all|"
                               r"reduce-scatter)(-start)?\(", line)  # fmt: skip
                if not op:
                    continue
                gs = groups(line)
                spans = any(len({data_of[d] for d in g}) > 1 for g in gs)
                found.append(dict(op=op.group(1), groups=gs, spans_data=spans))
        return found

    def weight_gathers(hlo: str) -> int:
        found = re.findall(r"=\s*(\S+)\s+all-gather(?:-start)?\(", hlo)
        return sum(1 for shape in found if shape.split("{")[0] in weight_shapes)

    def err(got, ref) -> float:  # the largest |diff| relative to the largest |value|, per leaf
        leaves = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref), strict=True)
        return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in leaves)

    for name, (run, differentiated) in approaches.items():
        rec: dict = {}
        fn = jax.jit(jax.value_and_grad(loss(run), (0, 1)) if differentiated else run)
        want = want_grad if differentiated else want_fwd
        module, check_name = partial_manual_check()
        check = getattr(module, check_name)
        try:
            if name.startswith("partial_manual_dyndepth"):  # see what XLA would compile
                setattr(module, check_name, lambda *a: None)
            try:
                hlo = fn.lower(*args).compile().as_text()
            finally:
                setattr(module, check_name, check)
        except Exception as e:  # noqa: BLE001 (reported)
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"{case}/{name}", json.dumps(rec), flush=True)
            continue
        loops = in_loops(hlo)
        rec["weight_gathers"] = weight_gathers(hlo)
        where = lambda c: f"SPANS DATA {c['groups']}" if c["spans_data"] else "within model"
        rec["in_loops"] = dict(Counter(f"{c['op']} {where(c)}" for c in loops))
        hangs = [c for c in loops if c["spans_data"] or c["op"] == "collective-permute"]
        lockstep = name == "lax_lockstep"  # one trip count for every device: safe to run
        if hangs and not lockstep:
            rec["err"] = (f"not run: {len(hangs)} in-loop collective(s) spanning data shards "
                          "or permuting (would hang with per-device trip counts)")  # fmt: skip
        else:
            rec["err"] = err(fn(*args), want)
        print(f"{case}/{name}", json.dumps(rec), flush=True)


def partial_manual_check():
    """(module, name) of dyndepth's trace-time refusal of a partial-manual ``shard_map`` around
    a loop with per-device trip counts (private; it moved between modules)."""
    import importlib

    places = (
        ("dyndepth._collectives", "_no_auto_axes_around_uneven_trip_counts"),
        ("dyndepth._loop", "_check_no_auto_axes_around_uneven_trip_counts"),
    )
    for module, name in places:
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(found, name):
            return found, name
    raise RuntimeError("dyndepth's partial-manual check was not found: update this script")


if __name__ == "__main__":
    main()
