"""Compiling for devices without a live backend (issue 40 item 5).

A batched loop on a mesh with ``Auto`` axes is a ``custom_partitioning`` call whose partitioner
XLA calls back while it compiles, through the live backend that registered it: compiled for a
TPU topology without a TPU (``jax.experimental.topologies``, a compile-only client), that failed
with "Custom emitter for CustomSPMDPartitioning not found". Such a loop is now lowered
unpartitioned (the same values) with a trace-time warning that says why and what to do.

Here: which devices count as live; the fallback on 8 simulated CPU devices, the live check
forced off (the lowered program has no custom partitioning, the value equals the partitioned
program's, the warning names the cause and the remedy), and the partitioned control; and, where
libtpu is installed, a ``value_and_grad`` of ``vmap(repeat)`` compiled for a ``v5e:2x2``
topology, deviceless.
"""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import pytest
from helpers import run_on_eight_devices

from dyndepth import _per_device

PROGRAM = textwrap.dedent(
    """
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import dyndepth as dd
    from dyndepth import _per_device

    B, D = 64, 32

    def loss(W, x, d):
        step = lambda c: c + 0.1 * jnp.tanh(c @ W)
        out = jax.vmap(lambda xi, di: dd.repeat(step, xi, di, max_depth=20))(x, d)
        return jnp.sum(out ** 2)

    def compile_on(devices):
        mesh = Mesh(np.array(devices), ("data",))
        spec = lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                 sharding=NamedSharding(mesh, p))
        k = jax.random.split(jax.random.key(0), 3)
        W = jax.random.normal(k[0], (D, D)) / D ** 0.5
        x = jax.random.normal(k[1], (B, D))
        d = jax.random.randint(k[2], (B,), 0, 21)
        args, specs = (W, x, d), (P(), P("data"), P("data"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lowered = jax.jit(jax.value_and_grad(loss)).lower(
                *[spec(a, p) for a, p in zip(args, specs)])
            compiled = lowered.compile()
        return dict(
            custom_partitioning="CustomSPMDPartitioning" in lowered.as_text(),
            warnings=[str(w.message) for w in caught if "without a live backend" in str(w.message)],
            loops=compiled.as_text().count(" while("),
        ), compiled, args, mesh, specs
    """
)

FALLBACK = PROGRAM + textwrap.dedent(
    """
    out = {}
    for forced in (False, True):
        if forced:  # as for a topology's compile-only devices
            _per_device.live_devices = lambda devices: False
        info, compiled, args, mesh, specs = compile_on(jax.devices())
        placed = [jax.device_put(a, NamedSharding(mesh, p)) for a, p in zip(args, specs)]
        info["value"] = float(compiled(*placed)[0])
        out["fallback" if forced else "partitioned"] = info
    print("RESULT" + json.dumps(out))
    """
)

TOPOLOGY = PROGRAM + textwrap.dedent(
    """
    from jax.experimental import topologies
    devices = topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices
    info, compiled, *_ = compile_on(devices)
    info["platform"] = devices[0].platform
    print("RESULT" + json.dumps(info))
    """
)


class _Stranger:
    """A device of no backend this process runs, as a topology's compile-only devices are."""

    def __init__(self, platform):
        self.platform = platform


def test_live_devices():
    assert _per_device.live_devices(jax.devices())
    assert not _per_device.live_devices([_Stranger("cpu")])
    assert not _per_device.live_devices([*jax.devices(), _Stranger("cpu")])
    assert not _per_device.live_devices([_Stranger("no-such-platform")])


def test_auto_mesh_loop_without_live_devices_is_lowered_unpartitioned():
    out = run_on_eight_devices(FALLBACK)
    partitioned, fallback = out["partitioned"], out["fallback"]
    assert partitioned["custom_partitioning"] and partitioned["warnings"] == []
    assert not fallback["custom_partitioning"]
    (message,) = set(fallback["warnings"])  # (one per loop: forward, backward)
    assert "8 cpu devices without a live backend" in message
    assert "custom_partitioning" in message and "Explicit axes" in message
    assert fallback["loops"] > 0
    assert abs(fallback["value"] - partitioned["value"]) <= 1e-5 * abs(partitioned["value"])


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu")
def test_auto_mesh_loop_compiles_for_a_tpu_topology_deviceless():
    # (no TPU: the CPU backend is the live one; this process may hold libtpu's lock already)
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    proc = subprocess.run([sys.executable, "-c", TOPOLOGY], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    info = json.loads(line[len("RESULT") :])
    assert info["platform"] == "tpu" and info["loops"] > 0
    assert not info["custom_partitioning"]
    (message,) = set(info["warnings"])
    assert "4 tpu devices without a live backend" in message
