"""Several processes: two local JAX processes (``jax.distributed.initialize`` on a loopback
address, CPU collectives through gloo, 2 simulated devices each) train on one global mesh.

A training step with per-sample depths (``jax.vmap(dyndepth.repeat)`` and
``dyndepth.repeat_batched``, keyed dropout steps) over the 4-device mesh, batch split over
``data`` with ``Auto`` axes under plain ``jit``, gives the value and gradient that one process
computes alone.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
from helpers import simulated_devices_env

import dyndepth as dd

B, D, T = 16, 4, 6


def problem():
    W = jax.random.normal(jax.random.PRNGKey(0), (D, D)) / 2
    xs = jax.random.normal(jax.random.PRNGKey(1), (B, D))
    ds = jax.random.randint(jax.random.PRNGKey(2), (B,), 0, T + 1)
    ks = jax.random.split(jax.random.PRNGKey(3), B)
    return W, xs, ds, ks


def losses():
    def step(W):
        return lambda c, k: (
            c + jnp.where(jax.random.bernoulli(k, 0.8, c.shape), jnp.tanh(c @ W), 0.0)
        )

    def vmapped(W, xs, ds, ks):
        one = lambda x, d, k: dd.repeat(step(W), x, d, max_depth=T, key=k)
        return jnp.sum(jax.vmap(one)(xs, ds, ks) ** 2)

    def batched(W, xs, ds, ks):
        return jnp.sum(dd.repeat_batched(step(W), xs, ds, max_depth=T, keys=ks) ** 2)

    return {"vmapped": vmapped, "batched": batched}


WORKER = textwrap.dedent(
    """
    import json, sys
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]))
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path.insert(0, sys.argv[3])
    from test_multiprocess import losses, problem

    mesh = Mesh(np.array(jax.devices()), ("data",))
    W, xs, ds, ks = problem()

    def global_array(a, spec):
        a = np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype,
                       jax.dtypes.prng_key) else a)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    args = (global_array(W, P()), global_array(xs, P("data")), global_array(ds, P("data")),
            global_array(ks, P("data")))
    out = {}
    for name, loss in losses().items():
        fn = jax.jit(jax.value_and_grad(loss), out_shardings=NamedSharding(mesh, P()))
        value, grad = fn(*args)
        hlo = fn.lower(*args).compile().as_text()
        out[name] = dict(value=float(value), grad=np.asarray(grad).tolist(),
                         all_gathers=hlo.count("all-gather("))
    if jax.process_index() == 0:
        print("RESULT" + json.dumps(out))
    jax.distributed.shutdown()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one():
    address = f"127.0.0.1:{_free_port()}"
    env = simulated_devices_env(2, JAX_PLATFORMS="cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, address, str(i), here],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    line = next(ln for ln in outputs[0][0].splitlines() if ln.startswith("RESULT"))
    got = json.loads(line[len("RESULT") :])
    # The keys travel as raw key data (uint32), as a legacy PRNGKey batch is.
    for name, loss in losses().items():
        value, grad = jax.jit(jax.value_and_grad(loss))(*problem())
        np.testing.assert_allclose(got[name]["value"], value, rtol=1e-5)
        # Up to the order of the float sums (per device, then over the devices).
        scale = float(jnp.max(jnp.abs(grad)))
        np.testing.assert_allclose(got[name]["grad"], grad, rtol=1e-5, atol=1e-6 * scale)
        assert got[name]["all_gathers"] == 0, got[name]
