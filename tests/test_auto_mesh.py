"""Plain ``jit`` on meshes as users build them: ``jax.sharding.Mesh`` (``Auto`` axes), 1-D and
2-D, data-parallel and tensor-parallel weights.

Every batched loop is a partitioned call that runs on each device's shard of the batch, so the
compiled program gathers no carries, permutes nothing and puts no collective inside a loop; the
gradient of a replicated weight is summed by one all-reduce after the loops. A weight sharded on
``model`` is gathered once, before the loops (the only all-gathers allowed, checked by shape).

The checks run in a subprocess with 8 simulated CPU devices (the device count is fixed when JAX
starts).
"""

import textwrap

from test_shard import run_on_eight_devices

SCRIPT = textwrap.dedent(
    """
    import json, os, re
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

    def step(W):
        return lambda c, k: c + jnp.tanh(c @ W) * jax.random.bernoulli(k, 0.9, c.shape)

    def vmap_repeat(W, xs, ds, ks):
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k)
        return jax.vmap(one)(xs, ds, ks)

    def vmap_repeat_checkpoints(W, xs, ds, ks):
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k, checkpoints=3)
        return jax.vmap(one)(xs, ds, ks)

    def repeat_batched(W, xs, ds, ks):
        return dd.repeat_batched(step(W), xs, ds, max_depth=T, keys=ks)

    def vmap_scan(W, xs, ds, ks):
        def one(x, s, d):
            f = lambda c, xi: (jnp.tanh(c @ W + xi), jnp.sum(c))
            c, ys = dd.scan(f, x, s, depth=d)
            return c + jnp.sum(ys)
        return jax.vmap(one)(xs, seq, ds)

    def vmap_while(W, xs, ds, ks):
        def one(x, k):
            return dd.while_loop(lambda c: jnp.sum(c ** 2) < 4.0, step(W), x, max_steps=T, key=k)
        return jax.vmap(one)(xs * 0.3, ks)

    def recurrent_depth(W, xs, ds, ks):
        core = lambda s, x, k: jnp.tanh(s @ W + x) * jax.random.bernoulli(k, 0.9, s.shape)
        one = lambda x, d, k: dd.nn.recurrent_depth(core, x, x, n=d // 2, k=d - d // 2,
                                                    max_n=T, max_k=T, key=k)
        return jax.vmap(one)(xs, ds, ks)

    LOOPS = dict(vmap_repeat=vmap_repeat, vmap_repeat_checkpoints=vmap_repeat_checkpoints,
                 repeat_batched=repeat_batched, vmap_scan=vmap_scan, vmap_while=vmap_while,
                 recurrent_depth=recurrent_depth)

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
        return sum(1 for c in seen for ln in comps[c] for op in ops if op in ln)

    def lax_while(xs):  # the control: a loop whose predicate reduces over the sharded batch
        return jax.lax.while_loop(lambda x: jnp.sum(x) < 1e4, lambda x: x * 1.5 + 1, xs)

    mesh = Mesh(np.array(jax.devices()), ("data",))
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    control = jax.jit(lax_while).lower(put(xs, "data")).compile().as_text()
    out = {"control": dict(in_loops=collectives_in_loops(control))}

    ref = {name: jax.jit(jax.value_and_grad(loss_of(run)))(W, xs, ds, ks)
           for name, run in LOOPS.items()}
    for layout in ("1d", "2d-ddp", "2d-tp"):
        shape, names = ((8,), ("data",)) if layout == "1d" else ((4, 2), ("data", "model"))
        mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
        w_spec = (None, "model") if layout == "2d-tp" else ()
        args = (put(W, *w_spec), put(xs, "data"), put(ds, "data"), put(ks, "data"))
        for i, (name, run) in enumerate(LOOPS.items()):
            if layout != "1d" and not FULL and i % 2 != (layout == "2d-tp"):
                continue  # make test: each loop on one of the 2-D layouts
            g = jax.jit(jax.value_and_grad(loss_of(run))).lower(*args).compile()
            v, gw = g(*args)
            hlo = g.as_text()
            gathers = [ln for ln in hlo.splitlines() if "all-gather(" in ln]
            out[f"{layout} {name}"] = dict(
                value_err=float(abs(v - ref[name][0]) / abs(ref[name][0])),
                grad_err=float(jnp.max(jnp.abs(gw - ref[name][1])) /
                               jnp.max(jnp.abs(ref[name][1]))),
                gathers_not_of_W=sum(f"f32[{D},{D}]" not in ln for ln in gathers),
                gathers=len(gathers),
                permutes=hlo.count("collective-permute("),
                in_loops=collectives_in_loops(hlo),
            )
    print("RESULT" + json.dumps(out))
    """
)


LOOPS = ("vmap_repeat", "vmap_repeat_checkpoints", "repeat_batched", "vmap_scan", "vmap_while",
         "recurrent_depth")  # fmt: skip


def test_auto_mesh_per_device_loops():
    """One test (one 8-device run, not one per pytest-xdist worker): every loop on the 1-D
    mesh, data-parallel and tensor-parallel weights on the 2-D mesh (all of them with
    DYNDEPTH_FULL=1, half of them each in `make test`), and the control."""
    results = run_on_eight_devices(SCRIPT)
    # the check of the compiled programs finds a collective inside a loop when there is one
    assert results.pop("control")["in_loops"] > 0
    assert {k.split()[0] for k in results} == {"1d", "2d-ddp", "2d-tp"}
    assert all(f"1d {loop}" in results for loop in LOOPS)
    for name, r in results.items():
        layout = name.split()[0]
        assert r["value_err"] < 1e-5 and r["grad_err"] < 1e-5, (name, r)
        assert r["permutes"] == 0 and r["in_loops"] == 0, (name, r)
        # Only a tensor-parallel weight is gathered (over `model`, once, before the loops).
        assert r["gathers_not_of_W"] == 0, (name, r)
        if layout != "2d-tp":
            assert r["gathers"] == 0, (name, r)
