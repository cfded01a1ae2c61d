"""Megatron-style tensor parallelism inside the loops, in a ``jax.shard_map`` manual over
``("data", "model")`` on a 4 x 2 mesh: ``W1`` split by columns and ``W2`` by rows over ``model``,
the step summing its partial products over ``model`` itself (``lax.psum``), the batch and the
per-sample depths split over ``data``.

The gradient used to fail to trace where a loop's const is not a weight (the input a
``nn.recurrent_depth`` core closes over, differentiated): the loop state was typed as varying
over every manual axis any operand varies over (``model`` through the weights), so the step's
new carry varied over ``model`` while its cotangent did not. A carry with one part split over
``model`` (the step's hidden units) and one replicated failed the same way: a const's cotangent
is now kept local over the axes the number of steps varies over only. Values and gradients (``grad``
of the batch's loss and per-sample ``vmap(grad)``) must equal the same computation on one
device; the compiled program must gather no weight and run no collective inside a loop but
over a ``model`` pair (the two ``model`` devices of a ``data`` shard run the same trip count).

The Equinox example (examples/tensor_parallel.py) runs here too. Every check runs in a
subprocess with 8 simulated CPU devices and a timeout.
"""

import textwrap
from pathlib import Path

from helpers import run_on_eight_devices
from test_shard import LOOP_HLO

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tensor_parallel.py"

SCRIPT = LOOP_HLO + textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd

    B, D, H, T = 16, 8, 16, 5
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    W1 = jax.random.normal(k[0], (D, H)) / 3
    W2 = jax.random.normal(k[1], (H, D)) / 4
    xs = jax.random.normal(k[2], (B, D))
    # per-sample depths whose longest differs between the data shards (4 rows each)
    ds = jnp.array([1, 2, 0, 1, 3, 2, 1, 0, 4, 1, 2, 3, 5, 4, 1, 2], jnp.int32)
    seq = jax.random.normal(k[3], (B, T, D))
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
    cols, rows, batch = P(None, "model"), P("model", None), P("data")

    def mlp(W1, W2, red):
        return lambda c: c + red(jnp.tanh(c @ W1) @ W2)

    def split_step(W1, W2, x, red, a, b):
        a = jnp.tanh(b @ W1) + 0.5 * a  # varies over model
        return a, b + red(a @ W2) / 4 + 0.1 * x

    # one sample: (W1, W2, x, d, seq, red) -> its output; red sums over model (or not)
    ONE = {
        "repeat": lambda W1, W2, x, d, s, red: dd.repeat(mlp(W1, W2, red), x, d, max_depth=T),
        "repeat_shared_depth": lambda W1, W2, x, d, s, red: dd.repeat(
            mlp(W1, W2, red), x, 3, max_depth=T),
        # the step closes over the sample's input: a const of the loop, differentiated
        "repeat_closing_over_x": lambda W1, W2, x, d, s, red: dd.repeat(
            lambda c: mlp(W1, W2, red)(c) + 0.5 * x, x, d, max_depth=T),
        # a carry part split over model (this device's hidden units) next to a replicated one
        "repeat_split_carry": lambda W1, W2, x, d, s, red: dd.repeat(
            lambda c: split_step(W1, W2, x, red, *c), (jnp.zeros(W1.shape[1]), x), d,
            max_depth=T)[1],
        "while_loop": lambda W1, W2, x, d, s, red: dd.while_loop(
            lambda c: jnp.sum(c ** 2) < 4.0, mlp(W1, W2, red), 0.3 * x, max_steps=T),
        "scan": lambda W1, W2, x, d, s, red: dd.scan(
            lambda c, xi: (mlp(W1, W2, red)(c) + xi, jnp.sum(c)), x, s, depth=d)[0],
        "recurrent_depth": lambda W1, W2, x, d, s, red: dd.nn.recurrent_depth(
            lambda st, xx: mlp(W1, W2, red)(st) + xx, x, x, n=d // 2, k=d - d // 2,
            max_n=T, max_k=T),
        "recurrent_depth_shared_depth": lambda W1, W2, x, d, s, red: dd.nn.recurrent_depth(
            lambda st, xx: mlp(W1, W2, red)(st) + xx, x, x, n=1, k=2, max_n=T, max_k=T),
    }
    psum = lambda h: lax.psum(h, "model")
    ident = lambda h: h

    def batched(name, red):
        if name == "repeat_batched":
            return lambda W1, W2, xs, ds, seq: dd.repeat_batched(
                mlp(W1, W2, red), xs, ds, max_depth=T)
        one = ONE[name]
        return lambda W1, W2, xs, ds, seq: jax.vmap(
            lambda x, d, s: one(W1, W2, x, d, s, red))(xs, ds, seq)

    def loops_collectives(hlo):
        found = []
        for _, comp in loop_computations(hlo):
            for line in comp.splitlines():
                # an instruction of that op (not an operand named after one)
                if re.search(r"\\b(all-reduce|all-gather|collective-permute|all-to-all)"
                             r"(-start)?\\(", line):
                    found.append(replica_groups(line))
        return found

    def rel(got, want):
        pairs = zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True)
        return max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)

    args = (put(W1, cols), put(W2, rows), put(xs, batch), put(ds, batch), put(seq, batch))
    specs = (cols, rows, batch, batch, batch)
    out = {}
    for name in list(ONE) + ["repeat_batched"]:
        run = jax.shard_map(batched(name, psum), mesh=mesh, in_specs=specs, out_specs=batch)
        loss = lambda *a: jnp.sum(run(*a) ** 2)
        loss1 = lambda *a: jnp.sum(batched(name, ident)(*a) ** 2)
        g = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(*args).compile()
        hlo = g.as_text()
        rec = dict(err=rel(g(*args), jax.value_and_grad(loss1, (0, 1, 2))(W1, W2, xs, ds, seq)),
                   all_gather=hlo.count("all-gather"), in_loops=loops_collectives(hlo))
        if name in ("repeat", "recurrent_depth", "scan"):
            # per-sample gradients: vmap(grad) inside shard_map, each sample's own (the
            # weights made varying over data first: else JAX sums their gradient over data)
            def sample_grads(red, local=ident):
                def f(W1, W2, xs, ds, seq):
                    l = lambda a, b, x, d, s: jnp.sum(ONE[name](a, b, x, d, s, red) ** 2)
                    return jax.vmap(jax.grad(l, (0, 1, 2)), in_axes=(None, None, 0, 0, 0))(
                        local(W1), local(W2), xs, ds, seq)
                return f
            per_data = lambda w: lax.pcast(w, ("data",), to="varying")
            sm = jax.shard_map(sample_grads(psum, per_data), mesh=mesh, in_specs=specs,
                               out_specs=(P("data", None, "model"), P("data", "model"), batch))
            rec["per_sample_err"] = rel(jax.jit(sm)(*args),
                                        sample_grads(ident)(W1, W2, xs, ds, seq))
        out[name] = rec
    print("RESULT" + json.dumps(out))
    """
)


# The replica groups of the model pairs of a 4 x 2 mesh, as XLA writes them.
MODEL_PAIRS = ("{{0,1},{2,3},{4,5},{6,7}}", "[4,2]<=[8]")


def test_megatron_step_in_full_manual_shard_map_values_and_gradients():
    out = run_on_eight_devices(SCRIPT, timeout=900)
    names = ["repeat", "repeat_shared_depth", "repeat_closing_over_x", "repeat_split_carry",
             "while_loop", "scan",
             "recurrent_depth", "recurrent_depth_shared_depth", "repeat_batched"]  # fmt: skip
    assert sorted(out) == sorted(names), out
    for name, rec in out.items():
        assert rec["err"] < 1e-5, (name, rec)
        assert rec["all_gather"] == 0, (name, rec)
        # the step's sums over model, inside the loops: every one over a model pair
        assert rec["in_loops"], (name, rec)
        assert all(groups in MODEL_PAIRS for groups in rec["in_loops"]), (name, rec)
    for name in ("repeat", "recurrent_depth", "scan"):
        assert out[name]["per_sample_err"] < 1e-5, (name, out[name])


EXAMPLE_SCRIPT = textwrap.dedent(
    f"""
    import json, runpy
    ns = runpy.run_path({str(EXAMPLE)!r}, run_name="not_main")
    out = {{}}
    for mode, extra in (("per_sample", []), ("shared", ["--shared-depth"])):
        res = ns["main"](["--steps", "2", "--batch", "8"] + extra)
        out[mode] = dict(worst=res["worst"], all_gathers=res["all_gathers"],
                         losses=res["losses"], shard=list(res["q_weight_shard"]))
    print("RESULT" + json.dumps(out))
    """
)


def test_equinox_tensor_parallel_example():
    out = run_on_eight_devices(EXAMPLE_SCRIPT, timeout=900)
    for mode, rec in out.items():
        assert rec["worst"] < 1e-5, (mode, rec)  # loss and gradients equal one device
        assert rec["all_gathers"] == 0, (mode, rec)
        assert rec["shard"] == [8, 16], (mode, rec)  # half of q's (out, in) weight per device
        assert len(rec["losses"]) == 2 and all(v == v for v in rec["losses"]), (mode, rec)
