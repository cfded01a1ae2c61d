"""dyndepth inside ``jax.shard_map``: every device schedules its own shard of the batch.

The checks run in a subprocess with 8 simulated CPU devices (the device count is fixed when JAX
starts, so it cannot be changed inside the test process).
"""

import textwrap

from helpers import run_on_eight_devices

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dyndepth

    B, D, M = 256, 8, 20
    W = jax.random.normal(jax.random.key(0), (D, D)) / 3
    x = jax.random.normal(jax.random.key(1), (B, D))
    depths = jax.random.randint(jax.random.key(2), (B,), 0, M + 1)

    def batched(W, x, d):
        out, st = dyndepth.repeat_batched(
            lambda c: jnp.tanh(c @ W), x, d, max_depth=M, slots="work", return_stats=True
        )
        return out, st["per_device_executed_sample_steps"], st["per_device_useful_sample_steps"]

    def vmapped(W, x, d):
        return jax.vmap(lambda xi, di: dyndepth.repeat(lambda c: jnp.tanh(c @ W), xi, di,
                                                       max_depth=M))(x, d)

    def loss_of(run):
        def loss(W, x, d):
            out = run(W, x, d)
            out = out[0] if isinstance(out, tuple) else out
            return jnp.sum(out ** 2)
        return loss

    ref = {name: jax.jit(jax.value_and_grad(loss_of(run)))(W, x, depths)
           for name, run in (("batched", batched), ("vmapped", vmapped))}
    results = {}
    for nd in (1, 2, 8):
        mesh = jax.make_mesh((nd,), ("data",), devices=jax.devices()[:nd])
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        args = (put(W, P()), put(x, P("data")), put(depths, P("data")))
        for name, run in (("batched", batched), ("vmapped", vmapped)):
            sm = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                               out_specs=P("data"))
            g = jax.jit(jax.value_and_grad(loss_of(sm))).lower(*args).compile()
            v, gw = g(*args)
            hlo = g.as_text()
            rec = dict(
                dv=float(abs(v - ref[name][0])),
                dg=float(jnp.max(abs(gw - ref[name][1]))),
                all_gather=hlo.count("all-gather"),
            )
            if name == "batched":
                _, ex, us = jax.jit(sm)(*args)
                rec.update(executed=ex.tolist(), useful=us.tolist(), per_device=B // nd)
            results[f"{name}-{nd}"] = rec
    print("RESULT" + json.dumps(results))
    """
)


def test_shard_map_per_device_scheduling():
    results = run_on_eight_devices(SCRIPT)
    assert len(results) == 6
    for name, rec in results.items():
        # Same values and gradients as one device.
        assert rec["dv"] < 1e-4 and rec["dg"] < 1e-4, (name, rec)
        # The carry is never gathered across devices: each device loops over its own shard.
        assert rec["all_gather"] == 0, (name, rec)
        if "executed" in rec:
            assert len(rec["executed"]) == int(name.split("-")[1])
            # 32 samples per device or more: the work rule (slots="work") keeps each device's
            # work within 1/16 of its sum of depths, whatever its share of the batch.
            assert rec["per_device"] >= 32
            for ex, us in zip(rec["executed"], rec["useful"], strict=True):
                assert us <= ex <= 1.15 * us, (name, rec)


# Prepended to the scripts that inspect compiled programs.
LOOP_HLO = textwrap.dedent(
    """
    import re


    def loop_computations(hlo):
        # (name, text) of every computation used as a while body or condition
        loops = set(re.findall(r"(?:body|condition)=%?([\\w.\\-]+)", hlo))
        for comp in hlo.split("\\n\\n"):
            head = comp.strip().split("\\n", 1)[0]
            name = head.split()[0].lstrip("%") if head else ""
            if name in loops:
                yield name, comp


    def replica_groups(line):
        # a collective's replica groups, as written ({{0,1},...} or the iota form [4,2]<=[8])
        m = re.search(r"replica_groups=(\\{[^ ]*\\}|\\[[\\d,]*\\]<=\\[\\d+\\])", line)
        return m.group(1) if m else line.strip()[:80]
    """
)


KEYED_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dyndepth
    import dyndepth.nn as dnn

    B, D, M = 32, 8, 12
    W = jax.random.normal(jax.random.key(0), (D, D)) / 3
    x = jax.random.normal(jax.random.key(1), (B, D))
    depths = jax.random.randint(jax.random.key(2), (B,), 0, M + 1)
    keys = jax.random.split(jax.random.key(3), B)

    def layer(W):
        # A fresh dropout mask per step (the key), constants made inside the step (0.5,
        # jnp.ones) and control flow on the carry: each of them once failed to type-check
        # inside shard_map, where the loop state varies over the mesh.
        def f(c, k):
            h = jnp.tanh(c @ W) * 0.5 + jnp.ones(D) / D
            # inner control flow that uses the replicated W (traced anew when W's type changes)
            h = lax.cond(jnp.sum(h) > 0, lambda: h @ W, lambda: -h)
            h = lax.fori_loop(0, 2, lambda i, h: h + 0.1 * jnp.tanh(h @ W), h)  # a scan
            return c + jnp.where(jax.random.bernoulli(k, 0.5, h.shape), 2 * h, 0.0)
        return f

    def batched(W, x, d, k):
        return dyndepth.repeat_batched(layer(W), x, d, max_depth=M, keys=k)

    def vmapped(W, x, d, k):
        return jax.vmap(lambda xi, di, ki: dyndepth.repeat(layer(W), xi, di, max_depth=M,
                                                           key=ki))(x, d, k)

    def masked(W, x, d, k):
        return jax.vmap(lambda xi, di, ki: dyndepth.repeat(
            layer(W), xi, di, max_depth=M, key=ki, strategy="masked"))(x, d, k)

    def layer_drop(W, x, d, k):
        # dyndepth.nn inside shard_map: LayerDrop with per-sample keys (the scheduler path)
        # and a recurrent-depth block with per-sample n and k (recall of x at every step).
        stack = jnp.stack([W, W.T, 0.5 * W, -W])
        y = jax.vmap(lambda xi, ki: dnn.layer_drop(
            lambda p, h: h + jnp.tanh(h @ p), stack, xi, ki, 0.5))(x, k)
        core = lambda s, xi, key: jnp.tanh(s @ W + xi) * jax.random.bernoulli(key, 0.9, s.shape)
        return jax.vmap(lambda yi, xi, di, ki: dnn.recurrent_depth(
            core, yi, xi, n=di // 2, k=di - di // 2, max_n=M, max_k=M, key=ki))(y, x, d, k)

    def out_and_grads(run):
        # one compiled program: the output and the gradients with respect to W and x
        def loss(W, x, d, k):
            out = run(W, x, d, k)
            return jnp.sum(out ** 2), out
        vg = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        return jax.jit(lambda *a: (lambda r: (r[0][1], r[1]))(vg(*a)))

    def collectives_in_loops(hlo):
        # computations used as a while body or condition must not hold a collective
        return [name for name, comp in loop_computations(hlo)
                if re.search(r"all-reduce|all-gather|collective-permute", comp)]

    def rel(a, b):
        return float(jnp.max(abs(a - b)) / jnp.max(abs(b)))

    results = {}
    runs = (("batched", batched), ("vmapped", vmapped), ("masked", masked), ("nn", layer_drop))
    ref = {n: out_and_grads(r)(W, x, depths, keys) for n, r in runs}
    for nd in (8,):  # test_shard_map_per_device_scheduling covers 1, 2 and 8 devices
        mesh = jax.make_mesh((nd,), ("data",), devices=jax.devices()[:nd])
        put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        args = (put(W, P()), put(x, P("data")), put(depths, P("data")), put(keys, P("data")))
        # ("masked" and "nn" inside shard_map: test_shard_map_on_a_two_dimensional_mesh)
        for name, run in runs[:2]:
            sm = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                               out_specs=P("data"))
            g = out_and_grads(sm).lower(*args).compile()
            out, (gw, gx) = g(*args)
            hlo = g.as_text()
            results[f"{name}-{nd}"] = dict(
                dout=rel(out, ref[name][0]),
                dgw=rel(gw, ref[name][1][0]),
                dgx=rel(gx, ref[name][1][1]),
                in_loops=collectives_in_loops(hlo),
                all_reduce=hlo.count("all-reduce("),
            )
    # Under plain jit, with the batch sharded over Explicit mesh axes (jax.make_mesh's
    # default): the loops run one per device (dyndepth enters shard_map itself), same values
    # and gradients, no all-gather, no collective inside a loop.
    def scanned(W, x, d, k):  # dyndepth.scan with per-step outputs
        f = layer(W)
        return jax.vmap(lambda xi, di, ki: dyndepth.scan(
            lambda c, t, kk: (f(c, kk), jnp.sum(c) * t), xi, jnp.arange(M, dtype=jnp.float32),
            depth=di, key=ki)[1])(x, d, k)

    def rowwise(W, x, d, k):  # a step that vmaps over rows with closed-over parameters,
        # as eqx.nn.Linear and LayerNorm are applied to a sequence
        def norm(r):
            return (r - r.mean()) / jnp.sqrt(((r - r.mean()) ** 2).mean() + 1e-5)
        step = lambda c: c + jnp.tanh(jax.vmap(lambda r: norm(r) @ W[:4, :4] + W[0, :4])(
            c.reshape(2, 4))).reshape(D)
        return jax.vmap(lambda xi, di: dyndepth.repeat(step, xi, di, max_depth=M))(x, d)

    ref["scan"] = out_and_grads(scanned)(W, x, depths, keys)
    ref["rows"] = out_and_grads(rowwise)(W, x, depths, keys)
    mesh = jax.make_mesh((8,), ("data",))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    args = (put(W, P()), put(x, P("data")), put(depths, P("data")), put(keys, P("data")))
    plain = {}
    # (not "masked": like JAX's own scan + cond under vmap, it does not trace there unless a
    # context mesh is set; README, "Scaling out")
    for name, run in [r for r in runs if r[0] != "masked"] + [("scan", scanned),
                                                                ("rows", rowwise)]:
        g = out_and_grads(run).lower(*args).compile()
        out, (gw, gx) = g(*args)
        hlo = g.as_text()
        plain[name] = dict(
            dout=rel(out, ref[name][0]), dgw=rel(gw, ref[name][1][0]),
            dgx=rel(gx, ref[name][1][1]), lead=str(out.sharding.spec[0]),
            all_gather=hlo.count("all-gather"), in_loops=collectives_in_loops(hlo),
        )
    results["plain_jit"] = plain
    # One depth for the whole batch, the batch in the carry (Huginn's lockstep draw): one loop,
    # its buffers typed like the sharded carry and the step outputs.
    lockstep = {
        "repeat": lambda W, x: dyndepth.repeat(layer(W), x, 7, max_depth=M, key=keys[0]),
        "scan": lambda W, x: dyndepth.scan(
            lambda c, t: (c + jnp.tanh(c @ W) * t, jnp.sum(c, -1)), x,
            jnp.linspace(0.0, 1.0, M), depth=7)[1],
        "scan_length_0": lambda W, x: dyndepth.scan(
            lambda c, t: (c @ W * t, jnp.sum(c, -1)), x, jnp.zeros((0,)), depth=0)[0] @ W,
        "layer_drop": lambda W, x: dnn.layer_drop(
            lambda p, h: h + jnp.tanh(h @ p), jnp.stack([W, W.T, -W]), x, keys[0], 0.5),
    }
    shared = {}
    for name, run in lockstep.items():
        loss = lambda W, x: jnp.sum(run(W, x) ** 2)
        want = (run(W, x), jax.grad(loss, argnums=(0, 1))(W, x))
        a = (put(W, P()), put(x, P("data")))
        out, (gw, gx) = jax.jit(run)(*a), jax.jit(jax.grad(loss, argnums=(0, 1)))(*a)
        shared[name] = max(rel(out, want[0]), rel(gw, want[1][0]), rel(gx, want[1][1]))
    results["lockstep"] = shared
    # Replicated arrays whose type carries that Explicit mesh run as on one device.
    rep = (put(W, P()), put(x, P()), put(depths, P()), put(keys, P()))
    results["replicated"] = max(
        rel(jax.jit(run)(*rep), ref[name][0]) for name, run in runs
    )
    # the masked reference and the scheduled loops agree on one device too
    results["agree"] = max(
        float(jnp.max(abs(a - b)) / jnp.max(abs(b)))
        for a, b in zip(jax.tree.leaves(ref["batched"]), jax.tree.leaves(ref["masked"]))
    )
    print("RESULT" + json.dumps(results))
    """
)


def test_shard_map_keyed_steps_with_constants_and_cond():
    """Step functions that take a key, build constants and branch run inside shard_map, and
    under plain jit with the batch sharded over Explicit mesh axes."""
    results = run_on_eight_devices(LOOP_HLO + KEYED_SCRIPT)
    assert results.pop("agree") < 1e-5
    assert results.pop("replicated") < 1e-5
    assert max(results.pop("lockstep").values()) < 1e-5
    plain = results.pop("plain_jit")
    assert set(plain) == {"batched", "vmapped", "nn", "scan", "rows"}
    for name, rec in plain.items():
        assert rec["dout"] < 1e-5 and rec["dgw"] < 1e-5 and rec["dgx"] < 1e-5, (name, rec)
        assert rec["lead"] == "data", (name, rec)  # the output stays split over the devices
        assert rec["all_gather"] == 0 and rec["in_loops"] == [], (name, rec)
    assert len(results) == 2
    for name, rec in results.items():
        # relative to the largest entry: float32 sums in another order over the devices
        assert rec["dout"] < 1e-5 and rec["dgw"] < 1e-5 and rec["dgx"] < 1e-5, (name, rec)
        # dyndepth's own loops sum the replicated W's gradient once, after the loop
        assert rec["in_loops"] == [] and rec["all_reduce"] >= 1, (name, rec)


REPLICATED_GRAD_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    import dyndepth

    import numpy as np
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # Auto axes
    x = jnp.linspace(0.1, 1.0, 8)
    w = jnp.array(0.7)

    def looped(kind):
        def run(w, x):
            if kind == "repeat":
                h = dyndepth.repeat(lambda h: jnp.tanh(w * h), x, 3, max_depth=4)
            elif kind == "recurrent_depth":
                core = lambda s, xi: jnp.tanh(w * s + xi)
                h = dyndepth.nn.recurrent_depth(core, x, x, n=1, k=2, max_n=2, max_k=2)
            else:  # the reference
                h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(w * h), x)
            return jax.lax.psum(jnp.sum(h), "data")
        sm = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        return jax.jit(jax.grad(sm))(w, x)

    def one_device(w):  # the same truncated loop on the whole batch, no shard_map
        core = lambda s, xi: jnp.tanh(w * s + xi)
        return jnp.sum(dyndepth.nn.recurrent_depth(core, x, x, n=1, k=2, max_n=2, max_k=2))

    out = {k: float(looped(k)) for k in ("repeat", "recurrent_depth", "fori")}
    out["recurrent_one_device"] = float(jax.grad(one_device)(w))
    print("RESULT" + json.dumps(out))
    """
)


def test_replicated_parameter_gradient_inside_shard_map_is_summed_once():
    """An unbatched loop inside shard_map closing over a replicated parameter: its gradient is
    the sum of the per-device gradients, once (it came out multiplied by the device count)."""
    r = run_on_eight_devices(REPLICATED_GRAD_SCRIPT)
    assert abs(r["repeat"] - r["fori"]) < 1e-5 * abs(r["fori"]), r
    want = r["recurrent_one_device"]
    assert want != 0.0 and abs(r["recurrent_depth"] - want) < 1e-5 * abs(want), r


TWO_D_SCRIPT = textwrap.dedent(
    """
    import json, re
    import numpy as np
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import dyndepth
    import dyndepth.nn as dnn

    B, D, M = 16, 8, 10
    W = jax.random.normal(jax.random.key(0), (D, D)) / 3
    W2 = jax.random.normal(jax.random.key(5), (D, D)) / 3
    x = jax.random.normal(jax.random.key(1), (B, D))
    depths = jax.random.randint(jax.random.key(2), (B,), 0, M + 1)
    keys = jax.random.split(jax.random.key(3), B)
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes; shard_map over both
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))

    def layer(W):
        # constants made inside the step and control flow on the carry, with a key
        def f(c, k):
            h = jnp.tanh(c @ W) * 0.5 + jnp.ones(D) / D
            h = jax.lax.cond(jnp.sum(h) > 0, lambda: h @ W, lambda: -h)
            h = jax.lax.fori_loop(0, 2, lambda i, h: h + 0.1 * jnp.tanh(h @ W), h)
            return c + jnp.where(jax.random.bernoulli(k, 0.9, h.shape), h, 0.0)
        return f

    def per_sample(loop):
        return lambda W, x, d, k: jax.vmap(lambda xi, di, ki: loop(W, xi, di, ki))(x, d, k)

    ddp = {  # one device's program, run per shard; W replicated
        "batched": lambda W, x, d, k: dyndepth.repeat_batched(layer(W), x, d, max_depth=M,
                                                              keys=k),
        "vmapped": per_sample(lambda W, x, d, k: dyndepth.repeat(layer(W), x, d,
                                                                 max_depth=M, key=k)),
        "checkpointed": per_sample(lambda W, x, d, k: dyndepth.repeat(
            layer(W), x, d, max_depth=M, key=k, checkpoints=3)),
        # every depth within the 3 carries stored: the every-carry backward pass per device
        "checkpoints_within": per_sample(lambda W, x, d, k: dyndepth.repeat(
            layer(W), x, jnp.minimum(d, 3), max_depth=M, key=k, checkpoints=3)),
        "masked": per_sample(lambda W, x, d, k: dyndepth.repeat(
            layer(W), x, d, max_depth=M, key=k, strategy="masked")),
        "scan": per_sample(lambda W, x, d, k: dyndepth.scan(
            lambda c, t, kk: (layer(W)(c, kk), jnp.concatenate([c, W[0]]) * t), x,
            jnp.linspace(0.0, 1.0, M), depth=d, key=k)[1]),
        "while": per_sample(lambda W, x, d, k: dyndepth.while_loop(
            lambda c: jnp.sum(c ** 2) > 0.5, lambda c: 0.9 * jnp.tanh(c @ W), x, max_steps=M)),
        "recurrent_depth": per_sample(lambda W, x, d, k: dnn.recurrent_depth(
            lambda s, xi, kk: jnp.tanh(s @ W + xi) * jax.random.bernoulli(kk, 0.9, s.shape),
            jnp.zeros_like(x), x, n=d // 2, k=d - d // 2, max_n=M, max_k=M, key=k)),
        "layer_drop": per_sample(lambda W, x, d, k: dnn.layer_drop(
            lambda p, h: h + jnp.tanh(h @ p), jnp.stack([W, W.T, -W]), x, k, 0.5)),
    }

    def megatron(W, W2):  # W's columns and W2's rows split over `model` inside shard_map
        return lambda c: c + jax.lax.psum(jnp.tanh(c @ W) @ W2, "model") / 2

    def megatron_one(W, W2):
        return lambda c: c + jnp.tanh(c @ W) @ W2 / 2

    tp = {  # (sharded program, one-device program)
        "tp_batched": tuple(
            (lambda m: lambda W, W2, x, d: dyndepth.repeat_batched(m(W, W2), x, d,
                                                                   max_depth=M))(m)
            for m in (megatron, megatron_one)),
        "tp_vmapped": tuple(
            (lambda m: lambda W, W2, x, d: jax.vmap(lambda xi, di: dyndepth.repeat(
                m(W, W2), xi, di, max_depth=M, checkpoints=4))(x, d))(m)
            for m in (megatron, megatron_one)),
    }

    def loops_collectives(hlo):
        # the replica groups of every collective in a loop's body or condition
        found = []
        for _, comp in loop_computations(hlo):
            for line in comp.splitlines():
                # (an instruction that is a collective, not one that reads a collective's result)
                op = re.search(r"= [^=]*? (all-reduce|all-gather|collective-permute|all-to-all)"
                               r"(-start)?\\(", line)
                if op:
                    found.append(replica_groups(line))
        return found

    def rel(a, b):
        return float(jnp.max(abs(a - b)) / jnp.max(abs(b)))

    results = {}
    for name, run in ddp.items():
        loss = lambda W, x, d, k, run=run: jnp.sum(run(W, x, d, k) ** 2)
        want = (run(W, x, depths, keys), jax.grad(loss, argnums=(0, 1))(W, x, depths, keys))
        sm = jax.shard_map(run, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                           out_specs=P("data"))
        sloss = lambda W, x, d, k: (lambda o: (jnp.sum(o ** 2), o))(sm(W, x, d, k))
        args = (put(W, P()), put(x, P("data")), put(depths, P("data")), put(keys, P("data")))
        vg = jax.value_and_grad(sloss, argnums=(0, 1), has_aux=True)
        g = jax.jit(vg).lower(*args).compile()
        (_, out), (gw, gx) = g(*args)
        results[name] = dict(
            err=max(rel(out, want[0]), rel(gw, want[1][0]), rel(gx, want[1][1])),
            all_gather=g.as_text().count("all-gather"),
            in_loops=loops_collectives(g.as_text()),
        )
    for name, (run, run_one) in tp.items():
        loss = lambda W, W2, x, d: jnp.sum(run_one(W, W2, x, d) ** 2)
        want = jax.value_and_grad(loss, argnums=(0, 1, 2))(W, W2, x, depths)
        sm = jax.shard_map(run, mesh=mesh,
                           in_specs=(P(None, "model"), P("model", None), P("data"), P("data")),
                           out_specs=P("data"))
        sloss = lambda W, W2, x, d: jnp.sum(sm(W, W2, x, d) ** 2)
        args = (put(W, P(None, "model")), put(W2, P("model", None)), put(x, P("data")),
                put(depths, P("data")))
        g = jax.jit(jax.value_and_grad(sloss, argnums=(0, 1, 2))).lower(*args).compile()
        v, grads = g(*args)
        results[name] = dict(
            err=max([rel(v, want[0])] + [rel(a, b) for a, b in zip(grads, want[1])]),
            all_gather=g.as_text().count("all-gather"),
            in_loops=loops_collectives(g.as_text()),
        )
    # A per-device key closed over by the step (folded with the device's index on `data`):
    # each shard's result is that of its own rows and its own key.
    base = jax.random.key(7)

    def own_key(x, d):
        kd = jax.random.fold_in(base, jax.lax.axis_index("data"))
        return jax.vmap(lambda xi, di: dnn.recurrent_depth(
            lambda s, xi: jnp.tanh(s @ W + xi) * jax.random.bernoulli(kd, 0.9, s.shape),
            jnp.zeros_like(xi), xi, n=di // 2, k=di - di // 2, max_n=M, max_k=M))(x, d)

    sm = jax.shard_map(own_key, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    got = jax.jit(sm)(put(x, P("data")), put(depths, P("data")))
    parts = []
    for i in range(4):
        kd = jax.random.fold_in(base, i)
        rows = slice(i * B // 4, (i + 1) * B // 4)
        parts.append(jax.vmap(lambda xi, di: dnn.recurrent_depth(
            lambda s, xi: jnp.tanh(s @ W + xi) * jax.random.bernoulli(kd, 0.9, s.shape),
            jnp.zeros_like(xi), xi, n=di // 2, k=di - di // 2, max_n=M, max_k=M))(
                x[rows], depths[rows]))
    results["own_key"] = rel(got, jnp.concatenate(parts))
    # A collective over `data` in the step, with depths that differ per device: refused.
    errors = []
    for loop in (
        lambda x, d: dyndepth.repeat_batched(
            lambda c: c - jax.lax.pmean(c, "data"), x, d, max_depth=M),
        lambda x, d: jax.vmap(lambda xi, di: dyndepth.repeat(
            lambda c: c - jax.lax.pmean(c, "data"), xi, di, max_depth=M))(x, d),
    ):
        sm = jax.shard_map(loop, mesh=mesh, in_specs=(P("data"), P("data")),
                           out_specs=P("data"))
        try:
            jax.jit(sm).lower(put(x, P("data")), put(depths, P("data")))
            errors.append("none")
        except ValueError as e:
            errors.append(str(e))
    results["guard"] = errors

    # A step whose own scan has no steps (its carry types settle without a step's slice).
    def empty_scan(x, d):
        step = lambda c: jax.lax.scan(lambda h, t: (jnp.tanh(h @ W) + t, None), c,
                                      jnp.zeros((0,)))[0] + 1.0
        return dyndepth.repeat_batched(step, x, d, max_depth=M)

    sm = jax.shard_map(empty_scan, mesh=mesh, in_specs=(P("data"), P("data")),
                       out_specs=P("data"))
    results["empty_scan"] = rel(jax.jit(sm)(put(x, P("data")), put(depths, P("data"))),
                                empty_scan(x, depths))
    print("RESULT" + json.dumps(results))
    """
)


def test_shard_map_on_a_two_dimensional_mesh():
    """``shard_map`` over a 4 x 2 (``data`` x ``model``) mesh: the loop state varies only over
    the axes its operands make it vary over, so ``out_specs=P("data")`` holds; data-parallel
    (replicated weights) and tensor-parallel (a step that psums over ``model``) programs equal
    one device, and no collective over ``data`` runs inside a loop."""
    results = run_on_eight_devices(LOOP_HLO + TWO_D_SCRIPT)
    assert results.pop("own_key") < 1e-6
    assert results.pop("empty_scan") < 1e-6
    for message in results.pop("guard"):
        assert "collective over mesh axis 'data'" in message, message
    assert len(results) == 11
    for name, rec in results.items():
        assert rec["err"] < 1e-5, (name, rec)
        assert rec["all_gather"] == 0, (name, rec)
        if name.startswith("tp_"):
            # the step's own psum over `model`: groups of the two devices of one data shard
            assert rec["in_loops"], (name, rec)
            for groups in rec["in_loops"]:
                assert groups in ("{{0,1},{2,3},{4,5},{6,7}}", "[4,2]<=[8]"), (name, rec)
        else:
            assert rec["in_loops"] == [], (name, rec)
