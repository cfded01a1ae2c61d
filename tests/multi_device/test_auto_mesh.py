"""Plain ``jit`` on meshes as users build them: ``jax.sharding.Mesh`` (``Auto`` axes), 1-D and
2-D, data-parallel and tensor-parallel weights, and ``jax.make_mesh`` (``Explicit`` axes).

Every batched loop runs on each device's shard of the batch (a partitioned call on ``Auto``
meshes, a ``shard_map`` over the batch axes on ``Explicit`` ones), so the compiled program
gathers no carries, permutes nothing and puts no collective over the batch axis inside a loop;
the gradient of a replicated weight is summed by one all-reduce after the loops. A weight sharded
on ``model`` is gathered once, before the loops, on an ``Auto`` mesh (the only all-gathers
allowed there, checked by shape); on an ``Explicit`` mesh the step's own collectives over
``model`` run inside the loop, but the weight is gathered on entry to it too (JAX's boundary of
a ``shard_map`` manual over ``data`` alone; tests/multi_device/test_explicit_tp_weights.py
counts those all-gathers by shape, which this test, counting all-gathers over ``model`` groups as
tensor parallelism, does not see).

The checks run in a subprocess with 8 simulated CPU devices (the device count is fixed when JAX
starts).
"""

import textwrap

import jax.numpy as jnp
from helpers import run_on_eight_devices
from test_shard import LOOP_HLO

from dyndepth import _slots

SCRIPT = textwrap.dedent(
    """
    import contextlib, json, os, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd

    FULL = os.environ.get("DYNDEPTH_FULL") == "1"
    B, D, T = 32, 8, 10
    W = jax.random.normal(jax.random.PRNGKey(0), (D, D)) / 3
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, D))
    ds = jax.random.randint(jax.random.PRNGKey(2), (B,), 0, T + 1).at[0].set(T)
    ks = jax.random.split(jax.random.PRNGKey(3), B)
    seq = jax.random.normal(jax.random.PRNGKey(4), (B, T, D))

    RESHARD = False

    def mm(c, W):
        # c @ W; on an Explicit mesh with W split over `model`, resharded like c: a loop's
        # carry keeps its type (as lax.fori_loop requires too)
        h = c @ W
        return jax.sharding.reshard(h, jax.typeof(c).sharding.spec) if RESHARD else h

    def step(W):
        return lambda c, k: c + jnp.tanh(mm(c, W)) * jax.random.bernoulli(k, 0.9, c.shape)

    def vmap_repeat(W, xs, ds, ks):
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k)
        return jax.vmap(one)(xs, ds, ks)

    def vmap_repeat_checkpoints(W, xs, ds, ks):
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k, checkpoints=3)
        return jax.vmap(one)(xs, ds, ks)

    def vmap_repeat_within(W, xs, ds, ks):  # every depth within the 3 carries stored
        one = lambda x, d, k: dd.repeat(step(W), x, jnp.minimum(d, 3), max_depth=T, key=k,
                                        checkpoints=3)
        return jax.vmap(one)(xs, ds, ks)

    def repeat_batched(W, xs, ds, ks):
        return dd.repeat_batched(step(W), xs, ds, max_depth=T, keys=ks)

    def vmap_scan(W, xs, ds, ks):
        def one(x, s, d):
            f = lambda c, xi: (jnp.tanh(mm(c, W) + xi), jnp.sum(c))
            c, ys = dd.scan(f, x, s, depth=d)
            return c + jnp.sum(ys)
        # per-sample inputs placed like the batch (vmap on an Explicit mesh requires it)
        return jax.vmap(one)(xs, placed_seq, ds)

    def vmap_while(W, xs, ds, ks):
        def one(x, k):
            return dd.while_loop(lambda c: jnp.sum(c ** 2) < 4.0, step(W), x, max_steps=T, key=k)
        return jax.vmap(one)(xs * 0.3, ks)

    def recurrent_depth(W, xs, ds, ks):
        core = lambda s, x, k: jnp.tanh(mm(s, W) + x) * jax.random.bernoulli(k, 0.9, s.shape)
        one = lambda x, d, k: dd.nn.recurrent_depth(core, x, x, n=d // 2, k=d - d // 2,
                                                    max_n=T, max_k=T, key=k)
        return jax.vmap(one)(xs, ds, ks)

    def nested_vmap(W, xs, ds, ks):  # a 2-D batch whose outer axis is the sharded one
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k)
        split = lambda a: a.reshape(8, B // 8, *a.shape[1:])
        return jax.vmap(jax.vmap(one))(split(xs), split(ds), split(ks)).reshape(B, D)

    def layer_drop(W, xs, ds, ks):
        stack = jnp.stack([W, W * W, -W, 0.5 * W])
        f = lambda p, h: h + jnp.tanh(mm(h, p))
        return jax.vmap(lambda x, k: dd.nn.layer_drop(f, stack, x, k, 0.5))(xs, ks)

    def halting(W, xs, ds, ks):
        def f(s):
            s = jnp.tanh(mm(s, W))
            return s, jax.nn.sigmoid(jnp.sum(s)), s
        return jax.vmap(lambda x: dd.nn.halting(f, x, max_steps=T).state)(xs)

    def stochastic_residual(W, xs, ds, ks):  # its branch skipped per sample (lax.cond)
        f = lambda h: jnp.tanh(mm(h, W))
        return jax.vmap(lambda x, k: dd.nn.stochastic_residual(f, x, k, 0.5))(xs, ks)

    LOOPS = dict(vmap_repeat=vmap_repeat, vmap_repeat_checkpoints=vmap_repeat_checkpoints,
                 repeat_batched=repeat_batched, vmap_scan=vmap_scan, vmap_while=vmap_while,
                 recurrent_depth=recurrent_depth, nested_vmap=nested_vmap,
                 layer_drop=layer_drop, stochastic_residual=stochastic_residual,
                 halting=halting, vmap_repeat_within=vmap_repeat_within)

    def loss_of(run):
        return lambda W, xs, ds, ks: jnp.sum(run(W, xs, ds, ks) ** 2)

    def computations(hlo):
        comps, name = {}, None
        for line in hlo.splitlines():
            m = re.match(r"^(?:ENTRY )?%?([\\w.\\-]+) .*\\{$", line)
            if m:
                name = m.group(1)
                comps[name] = []
            elif name is not None:
                comps[name].append(line)
        return comps

    def collectives_in_loops(hlo):
        comps = computations(hlo)
        todo = [b for lines in comps.values() for ln in lines
                for b in re.findall(r"(?:body|condition)=%?([\\w.\\-]+)", ln)]
        seen = set()
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for ln in comps[c]:
                todo += re.findall(r"(?:calls|to_apply|body|condition|branch_computations)="
                                   r"\\{?%?([\\w.\\-]+)", ln)
                todo += re.findall(r"%([\\w.\\-]+)(?=[,}])", ln.split("branch_computations=")[-1]
                                   if "branch_computations=" in ln else "")
        ops = ("all-gather(", "all-reduce(", "collective-permute(", "all-to-all(")
        # the replica groups of each collective found inside a loop
        return [replica_groups(ln) for c in seen for ln in comps[c] for op in ops if op in ln]

    MODEL_GROUPS = ("{{0,1},{2,3},{4,5},{6,7}}", "[4,2]<=[8]")

    def lax_while(xs):  # the control: a loop whose predicate reduces over the sharded batch
        return jax.lax.while_loop(lambda x: jnp.sum(x) < 1e4, lambda x: x * 1.5 + 1, xs)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    control = jax.jit(lax_while).lower(put(xs, "data")).compile().as_text()
    out = {"control": dict(in_loops=collectives_in_loops(control))}

    placed_seq = seq
    ref = {name: jax.jit(jax.value_and_grad(loss_of(run)))(W, xs, ds, ks)
           for name, run in LOOPS.items()}
    # Auto axes (jax.sharding.Mesh's default) and Explicit axes (jax.make_mesh's, under
    # jax.set_mesh), 1-D and 2-D, with data-parallel and tensor-parallel weights.
    LAYOUTS = ("1d", "2d-ddp", "2d-tp", "2d-explicit", "2d-explicit-tp")

    def mesh_of(layout):
        if "explicit" in layout:
            return jax.make_mesh((4, 2), ("data", "model"),
                                 axis_types=(jax.sharding.AxisType.Explicit,) * 2)
        shape, names = ((8,), ("data",)) if layout == "1d" else ((4, 2), ("data", "model"))
        return Mesh(np.array(jax.devices()).reshape(shape), names)

    for j, layout in enumerate(LAYOUTS):
        explicit = "explicit" in layout
        mesh = mesh_of(layout)
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
        w_spec = (None, "model") if layout.endswith("tp") else ()
        RESHARD = layout == "2d-explicit-tp"
        args = (put(W, *w_spec), put(xs, "data"), put(ds, "data"), put(ks, "data"))
        placed_seq = put(seq, "data")
        for i, (name, run) in enumerate(LOOPS.items()):
            if not FULL and i % len(LAYOUTS) != j:
                continue  # make test: each loop on one layout
            if layout == "2d-explicit-tp" and name == "stochastic_residual":
                # JAX's vmap of lax.cond (a select) refuses a branch split over `model` on an
                # Explicit mesh, with or without dyndepth
                continue
            with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
                g = jax.jit(jax.value_and_grad(loss_of(run))).lower(*args).compile()
                v, gw = jax.tree.map(np.asarray, g(*args))
            hlo = g.as_text()
            # an all-gather over `model` (groups of a data shard's two devices) belongs to
            # tensor parallelism; any other must be of W, before the loops
            gathers = [ln for ln in hlo.splitlines() if "all-gather(" in ln
                       and replica_groups(ln) not in MODEL_GROUPS]
            out[f"{layout} {name}"] = dict(
                value_err=float(abs(v - ref[name][0]) / abs(ref[name][0])),
                grad_err=float(jnp.max(jnp.abs(gw - ref[name][1])) /
                               jnp.max(jnp.abs(ref[name][1]))),
                # W, or a stack of it
                gathers_not_of_W=sum(f"{D},{D}]" not in ln for ln in gathers),
                gathers=len(gathers),
                permutes=hlo.count("collective-permute("),
                in_loops=collectives_in_loops(hlo),
            )
    # The work of repeat_batched's scheduler on each layout (forward, return_stats): under
    # plain jit the stats are summed over the devices; the test checks that the sum is that
    # of one scheduler per device, each on its own rows.
    def stats(W, xs, ds):
        return dd.repeat_batched(lambda c: jnp.tanh(c @ W), xs, ds, max_depth=T,
                                 slots="work", return_stats=True)[1]

    work_ds = jax.random.randint(jax.random.PRNGKey(6), (256,), 0, T + 1)
    work_xs = jax.random.normal(jax.random.PRNGKey(7), (256, D))
    out["work"] = {"depths": work_ds.tolist()}
    for layout in LAYOUTS:
        mesh = mesh_of(layout)
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
        st = jax.jit(stats)(put(W), put(work_xs, "data"), put(work_ds, "data"))
        out["work"][layout] = dict(devices=mesh.shape["data"],
                                   **{k: np.asarray(v).tolist() for k, v in st.items()})

    # An Equinox model as its users shard it: eqx.filter_shard and eqx.filter_jit, rows that
    # eqx.nn.Linear and LayerNorm are vmapped over inside the step, a 2-D Auto mesh.
    import equinox as eqx

    class Block(eqx.Module):
        lin: eqx.nn.Linear
        norm: eqx.nn.LayerNorm

        def __call__(self, h, k):
            keep = jax.random.bernoulli(k, 0.9, h.shape)
            new = jnp.tanh(jax.vmap(self.lin)(jax.vmap(self.norm)(h)))
            return h + jnp.where(keep, new, 0.0)

    def eqx_loss(model, rows, ds, ks):
        one = lambda x, d, k: dd.repeat(model, x, d, max_depth=T, key=k)
        return jnp.sum(jax.vmap(one)(rows, ds, ks) ** 2)

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    @eqx.filter_jit
    def eqx_sharded(model, rows, ds, ks):
        model = eqx.filter_shard(model, rep)
        rows, ds, ks = eqx.filter_shard((rows, ds, ks), split)
        return eqx.filter_value_and_grad(eqx_loss)(model, rows, ds, ks)

    model = Block(eqx.nn.Linear(D, D, key=jax.random.PRNGKey(5)), eqx.nn.LayerNorm(D))
    rows = seq[:, :3]
    v0, g0 = eqx.filter_jit(eqx.filter_value_and_grad(eqx_loss))(model, rows, ds, ks)
    placed = eqx.filter_shard((model, rows, ds, ks), (rep, split, split, split))
    v, g = eqx_sharded(*placed)
    hlo = eqx_sharded.lower(*placed).compile().compiled.as_text()
    gw, gw0 = g.lin.weight, g0.lin.weight
    out["equinox"] = dict(
        value_err=float(abs(v - v0) / abs(v0)),
        grad_err=float(jnp.max(jnp.abs(gw - gw0)) / jnp.max(jnp.abs(gw0))),
        gathers_not_of_W=hlo.count("all-gather("), gathers=hlo.count("all-gather("),
        permutes=hlo.count("collective-permute("), in_loops=collectives_in_loops(hlo),
    )
    print("RESULT" + json.dumps(out))
    """
)


LOOPS = ("vmap_repeat", "vmap_repeat_checkpoints", "repeat_batched", "vmap_scan", "vmap_while",
         "recurrent_depth", "nested_vmap", "layer_drop", "stochastic_residual",
         "halting", "vmap_repeat_within")  # fmt: skip


MODEL_GROUPS = ("{{0,1},{2,3},{4,5},{6,7}}", "[4,2]<=[8]")  # each data shard's two devices


def test_auto_mesh_per_device_loops():
    """One test (one 8-device run, not one per pytest-xdist worker): every loop and ``nn``
    layer on the 1-D and 2-D ``Auto`` meshes and the 2-D ``Explicit`` mesh, with data-parallel
    and (2-D) tensor-parallel weights: each on one of these layouts in `make test`, on all of
    them with DYNDEPTH_FULL=1; the scheduler's work per device; an Equinox model under
    ``eqx.filter_shard``; and the control."""
    results = run_on_eight_devices(LOOP_HLO + SCRIPT)
    # the check of the compiled programs finds a collective inside a loop when there is one
    assert results.pop("control")["in_loops"]
    _check_work_per_device(results.pop("work"))
    assert results["equinox"]  # eqx.filter_shard + eqx.filter_jit, checked below as the rest
    loops = {k: r for k, r in results.items() if k != "equinox"}
    assert {k.split()[0] for k in loops} == {
        "1d",
        "2d-ddp",
        "2d-tp",
        "2d-explicit",
        "2d-explicit-tp",
    }
    assert {k.split()[1] for k in loops} == set(LOOPS)
    for name, r in results.items():
        layout = name.split()[0]
        assert r["value_err"] < 1e-5 and r["grad_err"] < 1e-5, (name, r)
        assert r["permutes"] == 0, (name, r)
        if layout == "2d-explicit-tp":
            # tensor parallelism kept inside the step: its collectives over `model` (groups of
            # the two devices of one data shard) run inside the loop, none over `data`
            assert all(g in MODEL_GROUPS for g in r["in_loops"]), (name, r)
        else:
            assert r["in_loops"] == [], (name, r)
        # Only a tensor-parallel weight is gathered (over `model`, once, before the loops).
        assert r["gathers_not_of_W"] == 0, (name, r)
        if not layout.endswith("tp"):
            assert r["gathers"] == 0, (name, r)


def _check_work_per_device(work):
    """The scheduler ran once per device, each on its shard of the batch, within its work
    bound: the reported totals are the sums over the shards of what the scheduler's rule
    executes on each shard alone (one scheduler over the whole batch executes otherwise)."""
    depths = jnp.asarray(work.pop("depths"), jnp.int32)
    whole = _schedule_of(depths)
    assert set(work) == {"1d", "2d-ddp", "2d-tp", "2d-explicit", "2d-explicit-tp"}
    for layout, st in work.items():
        shards = jnp.split(depths, st["devices"])
        per_shard = [_schedule_of(d) for d in shards]
        assert st["useful_sample_steps"] == int(depths.sum()), layout
        assert st["executed_sample_steps"] == sum(e for e, _ in per_shard), (layout, st)
        assert st["iterations"] == max(c for _, c in per_shard), (layout, st)
        for d, (executed, _) in zip(shards, per_shard, strict=True):
            assert executed <= 1.15 * int(d.sum()), (layout, st)
    # a run over the whole batch would have reported other figures
    assert any(st["iterations"] != whole[1] for st in work.values()) or any(
        st["executed_sample_steps"] != whole[0] for st in work.values()
    )


def _schedule_of(depths):
    """(executed sample-steps, iterations) of the scheduler's rule on ``depths`` alone."""
    candidates = _slots.work_candidates(depths.shape[0])
    slots = candidates[int(_slots.choose_by_work(depths, candidates))]
    executed = int(_slots.executed_steps(depths, slots))
    return executed, executed // slots
