"""Several processes: two local JAX processes (``jax.distributed.initialize`` on a loopback
address, CPU collectives through gloo, 2 simulated devices each) train on one global mesh.

A training step with per-sample depths (``jax.vmap(dyndepth.repeat)`` and
``dyndepth.repeat_batched``, keyed dropout steps) over the 4-device mesh, batch split over
``data`` with ``Auto`` axes under plain ``jit``, gives the value and gradient that one process
computes alone.

Joining a run that does not start (a coordinator that never answers, a peer that never joins)
ends within ``--coordinator-timeout`` with a one-line error naming the address, says what it
waits for meanwhile, and stops at Ctrl-C. Every address here is on the loopback interface.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import simulated_devices_env

import dyndepth as dd

B, D, T = 16, 4, 6
# The workers import this module, and through it ``helpers``: this folder and the tests' root.
IMPORT_PATHS = [os.path.dirname(os.path.abspath(__file__)),
                os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # fmt: skip


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
    sys.path[:0] = sys.argv[3:]
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
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, address, str(i), *IMPORT_PATHS],
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


# ----------------------------------------------------------------------------- the time model

COST_WORKER = textwrap.dedent(
    """
    import hashlib, json, sys, warnings
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                               process_id=int(sys.argv[2]))
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    sys.path[:0] = sys.argv[3:]
    import dyndepth as dd
    from test_multiprocess import losses, problem

    # Each process its own constants, as measure_iteration_cost() on two hosts may give: process
    # 0 prices an iteration at a row (the scheduler's slot ladder), process 1 at a second (one
    # lockstep batch). Compiled apart, the two programs would differ.
    pid = jax.process_index()
    mine = dd.IterationCost(fixed_seconds=[1e-9, 1.0][pid], flops_per_second=1e30,
                            row_floor_seconds=1e-9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dd.set_iteration_cost("cpu", mine)
    used = dd._cost.backend_cost("cpu")

    mesh = Mesh(np.array(jax.devices()), ("data",))
    W, xs, ds, ks = problem()
    def global_array(a, spec):
        a = np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype,
                       jax.dtypes.prng_key) else a)
        return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
    args = (global_array(W, P()), global_array(xs, P("data")), global_array(ds, P("data")),
            global_array(ks, P("data")))
    fn = jax.jit(jax.value_and_grad(losses()["vmapped"]), out_shardings=NamedSharding(mesh, P()))
    value, _ = fn(*args)
    hlo = fn.lower(*args).compile().as_text()  # (after XLA's partitioning: the slot counts)

    # Process 0 restores the default, process 1 keeps its own: both take the default.
    with warnings.catch_warnings(record=True) as caught_reset:
        warnings.simplefilter("always")
        dd.set_iteration_cost("cpu", [None, mine][pid])
    reset = dd._cost.backend_cost("cpu") == dd._cost._DEFAULTS["cpu"]
    # Another platform on process 1: an error there naming it, nothing on process 0.
    try:
        dd.set_iteration_cost(["cpu", "gpu"][pid], mine)
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    print(f"RESULT{pid}" + json.dumps(dict(
        used=[used.fixed_seconds, used.flops_per_second, used.row_floor_seconds],
        warnings=[str(w.message) for w in caught], value=float(value),
        program=hashlib.sha256(hlo.encode()).hexdigest(), reset=reset,
        reset_warnings=[str(w.message) for w in caught_reset], mismatch=mismatch)))
    jax.distributed.shutdown()
    """
)


def test_two_processes_with_different_costs_use_process_zeros():
    """``set_iteration_cost`` with another cost on each process: every process takes process
    0's (process 1 is warned), so both compile the same program; the loop's value equals one
    process's. Process 0 restoring the default restores it everywhere; another platform on
    process 1 is a ``ValueError`` there."""
    address = f"127.0.0.1:{_free_port()}"
    env = simulated_devices_env(2, JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-c", COST_WORKER, address]
    procs = [subprocess.Popen([*argv, str(i), *IMPORT_PATHS], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    got = []
    for i, (out, _) in enumerate(outputs):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"RESULT{i}"))
        got.append(json.loads(line[len(f"RESULT{i}") :]))
    assert got[0]["used"] == got[1]["used"] == [1e-9, 1e30, 1e-9], got
    assert got[0]["warnings"] == [], got[0]
    (warning,) = got[1]["warnings"]
    assert "process 1's cost" in warning and "every process uses process 0's" in warning, warning
    assert got[0]["program"] == got[1]["program"]
    assert got[0]["reset"] and got[1]["reset"], got
    assert got[0]["reset_warnings"] == [], got[0]
    (warning,) = got[1]["reset_warnings"]
    assert "process 0's, the default IterationCost(" in warning, warning
    assert got[0]["mismatch"] is None, got[0]
    assert "`platform`='gpu'" in got[1]["mismatch"], got[1]
    value, _ = jax.jit(jax.value_and_grad(losses()["vmapped"]))(*problem())
    np.testing.assert_allclose([g["value"] for g in got], [value, value], rtol=1e-5)
    # The control: compiled apart, the two costs give two programs.
    programs = set()
    try:
        for fixed in (1e-9, 1.0):
            dd.set_iteration_cost("cpu", dd.IterationCost(fixed, 1e30, 1e-9))
            fn = jax.jit(jax.value_and_grad(losses()["vmapped"]))
            programs.add(fn.lower(*problem()).compile().as_text())
    finally:
        dd.set_iteration_cost("cpu", None)
    assert len(programs) == 2


# ----------------------------------------------------------------------------- joining the run


def _join(process_id: int, address: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "dyndepth_app", "demo", "--quick", "--coordinator", address,
            "--num-processes", "2", "--process-id", str(process_id), *extra]  # fmt: skip
    env = simulated_devices_env(1, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert lines, "nothing on stderr"
    assert not [ln for ln in lines if "Traceback" in ln or "Check failure" in ln], err
    return lines[-1]


@pytest.fixture
def silent_listener():
    """A loopback address that accepts TCP connections (the kernel completes them) and never
    answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("where", ["nothing listening", "silent listener", "peer never joins"])
def test_a_run_that_never_starts_ends_with_one_line_naming_the_address(where, request):
    if where == "silent listener":
        process_id, address = 1, request.getfixturevalue("silent_listener")
        why = "accepts connections, but no JAX coordinator answered"
    elif where == "nothing listening":
        process_id, address = 1, f"127.0.0.1:{_free_port()}"
        why = "nothing accepts connections there"
    else:  # process 0 starts the coordinator; process 1 never comes
        process_id, address = 0, f"127.0.0.1:{_free_port()}"
        why = "not all of the other 1 process(es) joined"
    proc = _join(process_id, address, "--coordinator-timeout", "3")
    out, err = proc.communicate(timeout=60)  # JAX's own limit would be 63 s, then an abort
    assert proc.returncode == 1, err
    line = _error_line(err)
    assert line.startswith(f"dyndepth demo: error: process {process_id} of 2 could not join"), err
    assert f"--coordinator {address} within 3 s" in line and why in line, line
    assert "waiting for" in err and address in err.splitlines()[0], err  # progress first
    assert out == "", out  # no training started


def test_ctrl_c_stops_the_wait_for_the_coordinator():
    address = f"127.0.0.1:{_free_port()}"
    proc = _join(1, address)  # the default time limit: 300 s
    try:
        first = proc.stderr.readline()  # the first progress line, after 2 s of waiting
        assert "waiting for the coordinator (process 0) at " + address in first, first
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - start < 20
    line = _error_line(err)
    assert line == (
        f"dyndepth demo: process 1 of 2: stopped while waiting for the coordinator at "
        f"{address}; nothing was started"
    ), err


QUIET = textwrap.dedent(
    """
    import argparse, sys
    import numpy as np
    from jax.experimental import multihost_utils
    from dyndepth_app import processes

    address, process_id = sys.argv[1], int(sys.argv[2])
    if process_id == 0:  # as dyndepth demo joins
        processes.initialize(argparse.Namespace(coordinator=address, num_processes=2,
                                                process_id=0, coordinator_timeout=60))
    else:  # the control: JAX's own join, then the same first collective
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=address, num_processes=2, process_id=1)
        multihost_utils.sync_global_devices("dyndepth: joined")
    print("SUM", int(np.sum(multihost_utils.process_allgather(np.int32(process_id + 1)))))
    """
)


def test_joining_keeps_gloos_connection_lines_out_of_the_output():
    """gloo prints a line when the processes' CPU collectives connect; the demo's join makes
    that connection with its stdout muted (process 0). Process 1 joins as plain JAX does: the
    control that shows the line exists."""
    address = f"127.0.0.1:{_free_port()}"
    env = simulated_devices_env(1, JAX_PLATFORMS="cpu")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", QUIET, address, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    (out0, err0), (out1, _) = outputs
    assert "[Gloo]" in out1, out1  # the control
    assert "SUM 3" in out0 and "Gloo" not in out0 + err0, out0 + err0
    assert "SUM 3" in out1


def test_coordinator_timeout_needs_a_multi_process_run(capsys):
    from dyndepth_app import cli

    assert cli.main(["demo", "--coordinator-timeout", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "dyndepth demo: error: --coordinator-timeout applies to a multi-process run "
        "(with --coordinator)"
    )
    assert cli.main(["demo", "--coordinator-timeout", "0"]) == 2
    assert "argument --coordinator-timeout:" in capsys.readouterr().err
