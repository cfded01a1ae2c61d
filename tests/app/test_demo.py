"""The demo's task, model and training: data, convolutions, masking, the truncated gradient,
resuming, per-sample depths, `dyndepth demo --quick` end to end (with `dyndepth eval`),
data-parallel training (`--devices N`) on 8 simulated CPU devices, in a subprocess, and on
several processes (`--coordinator`, `dyndepth launch`): two local processes against one."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import simulated_devices_env, tree_allclose

from dyndepth_app import cli as _cli
from dyndepth_app import demo, launch, model, train
from dyndepth_app.config import QUICK, Config, config_to_json, replace

TINY = replace(Config(), **QUICK)


def test_data_is_prefix_parity():
    x, t = model.make_batch(jax.random.PRNGKey(0), 4, 10)
    bits = (np.asarray(x) + 0.5).astype(int)
    assert set(np.unique(bits)) <= {0, 1}
    np.testing.assert_array_equal(np.asarray(t), np.cumsum(bits, axis=1) % 2)


def test_mixed_batch_pads_prefixes_of_the_same_strings():
    key = jax.random.PRNGKey(3)
    x, t, m, lengths = model.make_mixed_batch(key, 64, 4, 12)
    lengths = np.asarray(lengths)
    assert lengths.min() >= 4 and lengths.max() <= 12 and len(set(lengths)) > 3
    np.testing.assert_array_equal(np.asarray(m), np.arange(12)[None] < lengths[:, None])
    full_x, full_t = model.make_batch(jax.random.split(key)[0], 64, 12)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(full_x) * np.asarray(m))
    np.testing.assert_array_equal(np.asarray(t), np.asarray(full_t))  # prefix parities


@pytest.mark.parametrize("dilation", [1, 2, 5])
def test_convs_match_lax_conv(dilation):
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 9, 3))
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 5))  # (kernel, cin, cout)
    ref = jax.lax.conv_general_dilated(
        jnp.transpose(x, (0, 2, 1)),
        jnp.transpose(w, (2, 1, 0)),
        (1,),
        [(dilation, dilation)],
        rhs_dilation=(dilation,),
        dimension_numbers=("NCH", "OIH", "NCH"),
    )
    ref = jnp.transpose(ref, (0, 2, 1))
    tree_allclose(model.conv(x, w.reshape(9, 5), dilation), ref, rtol=1e-5, atol=1e-5)
    tree_allclose(model.conv_eval(x, w.reshape(9, 5), dilation), ref, rtol=1e-5, atol=1e-5)
    tree_allclose(model.conv_eval(x[0], w.reshape(9, 5), dilation), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dilations", [(1, 1, 1, 1), (1, 2, 4, 2)])
def test_a_padded_string_computes_what_it_computes_alone(dilations):
    """The mask makes padding invisible: a string padded to 16 bits gets the same state at every
    iteration and the same logits as the string alone (the conv's own padding is zeros)."""
    params = model.init_params(jax.random.PRNGKey(4), 8)
    x, _ = model.make_batch(jax.random.PRNGKey(5), 1, 11)
    x = x[0]
    xp = jnp.pad(x, (0, 5))
    m = model.length_mask(jnp.array([11]), 16)[0]
    h, hp = model.project(params, x), model.project(params, xp, m)
    for _ in range(4):
        h = model.core(params, h, x, dilations)
        hp = model.core(params, hp, xp, dilations, m)
        tree_allclose(hp[:11], h, rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(hp[11:]))
    tree_allclose(model.head(params, hp, m)[:11], model.head(params, h), rtol=1e-5, atol=1e-6)


def test_think_gradient_is_truncated_to_the_last_k_iterations():
    params = model.init_params(jax.random.PRNGKey(3), 8)
    x, t = model.make_batch(jax.random.PRNGKey(4), 2, 6)

    def loss(p, n, k):
        return model.cross_entropy(model.think(p, x, n, k, 6), t)

    def reference(p, n, k):
        h = model.project(p, x)
        for i in range(n + k):
            if i == n and n > 0:
                h = jax.lax.stop_gradient(h)
            q = jax.lax.stop_gradient(p) if i < n else p
            h = model.core(q, h, x)
        return model.cross_entropy(model.head(p, h), t)

    for n, k in [(0, 3), (2, 2), (4, 1)]:
        tree_allclose(loss(params, n, k), reference(params, n, k))
        tree_allclose(jax.grad(loss)(params, n, k), jax.grad(reference)(params, n, k), rtol=1e-4)


def test_masked_loss_ignores_the_padding():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 6, 2))
    t = jnp.array([[0, 1, 0, 1, 1, 0]] * 3)
    m = model.length_mask(jnp.array([6, 3, 1]), 6)
    per = model.sample_cross_entropy(logits, t, m)
    for b, n in enumerate([6, 3, 1]):
        tree_allclose(
            per[b], model.sample_cross_entropy(logits[b : b + 1, :n], t[b : b + 1, :n])[0]
        )


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli.main(["demo", "--quick", "--control", "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert set(report["summary"]) == {"alpha=1", "alpha=0"}
    curves = report["curves"]["alpha=1"]
    assert set(curves) == {"8", "16"}
    assert all(
        QUICK["eval_min_iters"] <= len(c) <= QUICK["eval_max_iters"] for c in curves.values()
    )
    assert all(0.0 <= a <= 1.0 for c in curves.values() for a in c)
    assert report["summary"]["alpha=1"][0]["strings"] == QUICK["eval_batch"]
    assert report["summary"]["alpha=0"][0]["strings"] == QUICK["control_eval_batch"]
    assert "step_seconds_per_iteration" in report["training"]["alpha=1"]
    adaptive = report["adaptive"]
    assert adaptive["strings"] == QUICK["adaptive_batch"] and adaptive["same_as_lax"]
    assert len(adaptive["steps"]) == len(adaptive["lengths"]) == QUICK["adaptive_batch"]
    for name in ("accuracy.png", "adaptive.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert (
        "| alpha=1 | 16 |" in text
        and "| adaptive, dyndepth.while_loop under vmap, longest first |" in text
    )

    # The checkpoint evaluates from the command line, at any length and iteration count.
    js = tmp_path / "eval.json"
    ckpt = out / "alpha=1.ckpt.npz"
    argv = ["eval", "--checkpoint", str(ckpt), "--lengths", "8,24", "--iters", "5"]
    assert _cli.main(argv + ["--strings", "8", "--adaptive", "--json", str(js)]) == 0
    ev = json.loads(js.read_text())
    assert set(ev["curves"]) == {"8", "24"} and all(len(v) == 5 for v in ev["curves"].values())
    assert ev["adaptive"]["max_length"] == 24 and max(ev["adaptive"]["steps"]) <= 24


@pytest.mark.slow
def test_resume_continues_the_same_run(tmp_path):
    cfg = replace(TINY, train_length=6, max_iters=3, batch=8, steps=6)
    quiet = lambda *a, **k: None  # noqa: E731
    full, _ = train.train(cfg, str(tmp_path / "a"), log=quiet)
    train.train(cfg, str(tmp_path / "b"), stop_at=3, log=quiet)  # interrupted at step 3
    _, _, step, saved = train.load_checkpoint(str(tmp_path / "b" / "alpha=1.ckpt.npz"))
    assert step == 3 and saved == cfg
    # Resuming continues the same run: same parameters as the uninterrupted one.
    resumed, _ = train.train(cfg, str(tmp_path / "b"), log=quiet)
    tree_allclose(resumed, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("per_sample", [False, True])
def test_train_step_runs_per_batch_and_per_sample(per_sample):
    cfg = replace(TINY, train_length=6, max_iters=3, batch=8, steps=2, per_sample=per_sample)
    params = model.init_params(jax.random.PRNGKey(0), cfg.width)
    step = train.make_train_step(cfg)
    p2, _, loss, gnorm, nk, executed, useful = step(
        params, train.adamw_init(params), jax.random.PRNGKey(1), jnp.int32(0), jnp.int32(-1)
    )
    assert np.isfinite(float(loss)) and float(gnorm) > 0
    assert 1 <= float(nk) <= cfg.max_iters
    assert not bool(jnp.allclose(p2["recall"], params["recall"]))
    # One device: this step's forward sample-iterations, useful = sum(n + k) over the batch.
    assert executed.shape == useful.shape == (1,)
    assert int(useful[0]) == round(float(nk) * cfg.batch)
    assert int(useful[0]) <= int(executed[0])
    if not per_sample:
        assert int(executed[0]) == int(useful[0])


def test_think_batched_matches_vmapped_think():
    """--per-sample runs both loops through repeat_batched: same loss and gradients as
    vmap(think) with per-sample n and k (masked strings of mixed lengths), and the
    scheduler's own work counts."""
    M = 5
    params = model.init_params(jax.random.PRNGKey(5), 8)
    x, t, m, _ = model.make_mixed_batch(jax.random.PRNGKey(6), 12, 3, 7)
    n = jnp.array([0, 1, 4, 2, 0, 3, 1, 0, 2, 4, 1, 0], jnp.int32)
    k = jnp.array([1, 4, 1, 3, 5, 2, 1, 2, 1, 1, 3, 4], jnp.int32)
    dil = (1, 2, 1, 2)

    def batched(p):
        logits, executed, useful = model.think_batched(p, x, n, k, M, dil, m)
        return model.cross_entropy(logits, t, m), (executed, useful)

    def vmapped(p):
        logits = jax.vmap(lambda x, n, k, m: model.think(p, x, n, k, M, dil, m))(x, n, k, m)
        return model.cross_entropy(logits, t, m)

    (lb, (executed, useful)), gb = jax.jit(jax.value_and_grad(batched, has_aux=True))(params)
    lv, gv = jax.jit(jax.value_and_grad(vmapped))(params)
    tree_allclose(lb, lv)
    tree_allclose(gb, gv, rtol=1e-4, atol=1e-6)
    assert int(useful[0]) == int(jnp.sum(n + k))
    assert int(useful[0]) <= int(executed[0])


def test_devices_flag_rejects_bad_values(tmp_path, capsys):
    too_many = jax.device_count() + 1
    for devices, words in [
        ("0", ["--devices", ">= 1", "0"]),
        (
            str(too_many),
            [f"--devices {too_many}", "XLA_FLAGS=--xla_force_host_platform_device_count"],
        ),
    ]:
        argv = ["demo", "--quick", "--no-control", "--devices", devices, "--out", str(tmp_path)]
        assert _cli.main(argv) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
    assert not (tmp_path / "results.json").exists()


MULTI_DEVICE = textwrap.dedent(
    """
    import json, os
    import jax, jax.numpy as jnp, numpy as np
    from dyndepth_app import model, train
    from dyndepth_app.config import QUICK, Config, replace

    assert jax.device_count() == 8
    COUNTS = (1, 2, 8) if os.environ.get("DYNDEPTH_FULL") == "1" else (1, 8)
    out = {"counts": COUNTS}
    for per_sample in (False, True):
        cfg = replace(Config(), **QUICK)
        cfg = replace(cfg, train_length=8, max_iters=4, batch=32, per_sample=per_sample)
        params = model.init_params(jax.random.PRNGKey(0), cfg.width)
        for nd in COUNTS:
            fn = jax.jit(train.make_loss_and_grad(cfg, nd))
            p = train.replicate(params, train.make_mesh(nd, cfg.batch))
            loss, grads, nk, executed, useful = fn(p, jax.random.PRNGKey(1))
            out[f"{per_sample}-{nd}"] = dict(
                loss=float(loss),
                grads=[np.asarray(g).ravel().tolist() for g in jax.tree.leaves(grads)],
                executed=np.asarray(executed).tolist(),
                useful=np.asarray(useful).tolist(),
            )
    try:
        train.make_mesh(8, 100)
    except ValueError as e:
        out["batch_error"] = str(e)
    print("RESULT" + json.dumps(out))
    """
)


def _eight_devices():
    return simulated_devices_env(8)


def data_parallel_steps():
    """One training step on 1 and 8 (and 2) simulated devices, per-batch and per-sample depths."""
    proc = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE],
        env=_eight_devices(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def _check_data_parallel(res, per_sample):
    """The step's loss and gradients on 8 (and 2) devices agree with one device to 1e-5
    relative: the data and depths do not depend on the device count."""
    ref = res[f"{per_sample}-1"]
    ref_grads = [np.asarray(g) for g in ref["grads"]]
    for nd in res["counts"][1:]:
        rec = res[f"{per_sample}-{nd}"]
        assert abs(rec["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (per_sample, nd)
        for g, r in zip(rec["grads"], ref_grads, strict=True):
            err = np.max(np.abs(np.asarray(g) - r))
            assert err <= 1e-5 * np.max(np.abs(r)), (per_sample, nd, err)
        # One work entry per device; the devices share the useful work of the batch.
        assert len(rec["executed"]) == len(rec["useful"]) == nd
        assert sum(rec["useful"]) == sum(ref["useful"])
        assert all(u <= e for u, e in zip(rec["useful"], rec["executed"], strict=True))
        if per_sample == "False":
            assert rec["executed"] == rec["useful"] == [ref["useful"][0] // nd] * nd


def test_data_parallel_step_matches_one_device():
    """Per-sample and per-batch depths (one test: one 8-device run per session, not one per
    pytest-xdist worker); 8 devices against one, and 2 with DYNDEPTH_FULL=1."""
    res = data_parallel_steps()
    assert res["counts"][0] == 1 and 8 in res["counts"]
    _check_data_parallel(res, "True")
    _check_data_parallel(res, "False")
    assert "--devices 8" in res["batch_error"]
    assert "--batch 100" in res["batch_error"]


@pytest.mark.slow
def test_demo_quick_on_eight_devices(tmp_path):
    out = tmp_path / "run8"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dyndepth_app",
            "demo",
            "--quick",
            "--devices",
            "8",
            "--no-control",
            "--out",
            str(out),
        ],
        env=_eight_devices(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "per-device utilisation over 20 steps on 8 device(s)" in proc.stdout
    assert "| device | samples/step | useful | executed |" in proc.stdout
    report = json.loads((out / "results.json").read_text())
    assert report["devices"] == 8
    rows = report["training"]["alpha=1"]["per_device"]
    assert [r["device"] for r in rows] == list(range(8))
    assert all(r["samples_per_step"] == 2 and r["steps"] == 20 for r in rows)
    assert all(r["executed_sample_iterations"] == r["useful_sample_iterations"] > 0 for r in rows)
    assert abs(sum(r["share"] for r in rows) - 1.0) < 1e-6
    assert set(report["summary"]) == {"alpha=1"}


@pytest.mark.parametrize(
    "argv, batch",
    [
        ([], Config.batch),
        (["--devices", "8"], -(-Config.batch // 8) * 8),
        (["--devices", "8", "--batch", "96"], 96),
        (["--quick", "--devices", "3"], 18),
        (["--quick"], 16),
    ],
)
def test_default_batch_rounds_up_to_the_devices(argv, batch):
    import argparse

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.config_from_args(p.parse_args(argv)).batch == batch


# ----------------------------------------------------------------------------- several processes

COORDINATOR = ["--coordinator", "127.0.0.1:1234"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (COORDINATOR, ["--coordinator needs --num-processes and --process-id", "together"]),
        (["--num-processes", "2", "--process-id", "0"], ["needs --coordinator"]),
        (COORDINATOR + ["--num-processes", "2", "--process-id", "2"], ["argument --process-id"]),
        (["--coordinator", "localhost"], ["argument --coordinator:", "HOST:PORT"]),
        (["--coordinator", "h:70000"], ["argument --coordinator:", "1..65535"]),
        (["--num-processes", "0"], ["argument --num-processes:", ">= 1"]),
        (["--process-id", "-1"], ["argument --process-id:", ">= 0"]),
        (
            ["--task", "dropout-residual"]
            + COORDINATOR
            + ["--num-processes", "2", "--process-id", "0"],
            ["--coordinator applies to the prefix-sums training only"],
        ),
    ],
)
def test_process_flags_are_one_line_errors_naming_the_flag(tmp_path, capsys, argv, words):
    """Checked before JAX starts (none of these reaches ``jax.distributed.initialize``)."""
    assert _cli.main(["demo", "--quick", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dyndepth demo: error:"), err
    assert all(w in err for w in words), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], ["no command", "-- demo"]),
        (["--", "eval", "--checkpoint", "x"], ["`dyndepth demo` only", "eval --checkpoint x"]),
        (["--", "demo", "--process-id", "0"], ["--process-id is set by the launcher"]),
        (["--", "demo", "--coordinator=h:1"], ["--coordinator is set by the launcher"]),
        (["--", "demo", "--task", "seed"], ["--task seed runs on one device"]),
        (["--", "demo", "--task=dropout-residual"], ["--task dropout-residual runs on one"]),
        (["--processes", "0", "--", "demo"], ["argument --processes:"]),
        (["--devices-per-process", "x", "--", "demo"], ["argument --devices-per-process:"]),
    ],
)
def test_launch_rejects_what_it_cannot_run(capsys, argv, words):
    assert _cli.main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dyndepth launch: error:"), err
    assert all(w in err for w in words), err


def test_launch_environment_sets_the_device_count_of_each_process():
    env = launch.process_env(
        {"XLA_FLAGS": "--xla_a=1 --xla_force_host_platform_device_count=8"}, 2, 5
    )
    assert env["XLA_FLAGS"].split() == ["--xla_a=1", "--xla_force_host_platform_device_count=2"]
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:5"
    argv = launch.process_argv(["demo", "--quick"], 5, 1, 2)
    assert argv[1:] == ["-m", "dyndepth_app", "demo", "--quick", "--coordinator", "127.0.0.1:5",
                        "--num-processes", "2", "--process-id", "1"]  # fmt: skip


def test_mesh_takes_as_many_devices_from_every_process():
    class Device:
        platform = "cpu"

        def __init__(self, process, i):
            self.process_index, self.id = process, i

    two = [Device(p, i) for p in (0, 1) for i in range(3)]
    assert [(d.process_index, d.id) for d in train.mesh_devices(4, two)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert len(train.mesh_devices(6, two)) == 6
    for count, words in [
        (3, ["--devices 3", "as many devices of each of the 2 processes", "multiple of 2"]),
        (8, ["--devices 8", "hold 6", "--xla_force_host_platform_device_count=4"]),
    ]:
        with pytest.raises(ValueError) as e:
            train.mesh_devices(count, two)
        assert all(w in str(e.value) for w in words), str(e.value)
    one = [Device(0, i) for i in range(2)]
    assert train.mesh_devices(2, one) == one
    with pytest.raises(ValueError, match="--devices 3: only 2 cpu device"):
        train.mesh_devices(3, one)


TWO_PROCESSES = textwrap.dedent(
    """
    import argparse, json, sys
    from dyndepth_app import processes
    coordinator, process_id, out, cfg = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    processes.initialize(argparse.Namespace(
        coordinator=coordinator, num_processes=2, process_id=process_id))
    import jax, numpy as np
    from dyndepth_app import train
    from dyndepth_app.config import config_from_json

    params, figures = train.train(config_from_json(json.loads(cfg)), out, devices=2)
    if jax.process_index() == 0:
        leaves = [np.asarray(p).ravel().tolist() for p in jax.tree.leaves(params)]
        print("RESULT" + json.dumps(dict(figures=figures, params=leaves)))
    """
)


def _start_two_processes(out_dirs, cfg):
    port = launch.free_port()
    env = launch.process_env(os.environ, 1, port)
    argv = ["-c", TWO_PROCESSES, f"127.0.0.1:{port}"]
    cfg = json.dumps(config_to_json(cfg))
    return [
        subprocess.Popen(
            [sys.executable, *argv, str(i), str(out), cfg],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, out in enumerate(out_dirs)
    ]


def _finish(procs, timeout=300):
    """The processes' ``(stdout, stderr)``; a hang (processes that disagree wait for each other
    in a collective) is a failure after ``timeout`` seconds."""
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    return outputs


def _same_training(got, want_params, want_figures, devices):
    """A multi-process run's figures and parameters against a one-process run: loss and
    parameters to 1e-5 (float summation order), the same useful work split over ``devices``."""
    assert abs(got["figures"]["final_loss"] - want_figures["final_loss"]) <= 1e-5
    for g, w in zip(got["params"], jax.tree.leaves(want_params), strict=True):
        w = np.asarray(w).ravel()
        assert np.max(np.abs(np.ravel(g) - w)) <= 1e-5 * np.max(np.abs(w))
    rows = got["figures"]["per_device"]
    assert [r["device"] for r in rows] == list(range(devices))
    want_useful = want_figures["per_device"][0]["useful_sample_iterations"]
    assert sum(r["useful_sample_iterations"] for r in rows) == want_useful > 0


def test_two_processes_resume_and_train_as_one(tmp_path):
    """Two processes (one CPU device each) resume a checkpoint that only process 0 can see and
    train one step: the parameters and loss of one process resuming the same checkpoint.
    Process 1 prints nothing of its own (gloo's connection lines aside) and writes nothing."""
    cfg = replace(TINY, steps=2, batch=8)
    # Not the run's own initial parameters: process 1 must take process 0's.
    params = model.init_params(jax.random.PRNGKey(7), cfg.width)
    out0, out1, ref = tmp_path / "p0", tmp_path / "p1", tmp_path / "ref"
    for folder in (out0, ref):
        folder.mkdir()
        train.save_checkpoint(
            str(folder / "alpha=1.ckpt.npz"), params, train.adamw_init(params), 1, cfg
        )
    procs = _start_two_processes([out0, out1], cfg)
    want_params, want_figures = train.train(cfg, str(ref), log=lambda *a: None)
    (out_0, err_0), (out_1, err_1) = _finish(procs)
    got = json.loads(next(ln for ln in out_0.splitlines() if ln.startswith("RESULT"))[6:])
    assert got["figures"]["steps_run"] == want_figures["steps_run"] == 1
    _same_training(got, want_params, want_figures, devices=2)
    assert train.load_checkpoint(str(out0 / "alpha=1.ckpt.npz"))[2] == 2
    assert _only_gloo_chatter(out_1), out_1[-2000:]
    # The progress: process 0's only (a bar on a terminal; piped, as here, a log line on stdout)
    assert "alpha=1" in out_0 + err_0 and "alpha=1" not in out_1 + err_1
    assert not out1.exists()


_GLOO = re.compile(
    r"\[Gloo\] Rank |\d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : \d+"
)


def _only_gloo_chatter(text: str) -> bool:
    """Whether ``text`` (a non-reporting process's output) holds nothing but Gloo's connection
    messages, which its threads may write interleaved ("[Gloo] Rank [Gloo] Rank 2 is ...")."""
    return not _GLOO.sub("", text).strip()


@pytest.mark.slow
def test_launch_two_processes_matches_one_process(tmp_path, capfd):
    """`dyndepth launch` (2 processes x 2 devices) of `demo --quick --per-sample`: the loss,
    parameters and per-sample work of one process on one device; process 0 alone reports."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    argv = ["launch", "--processes", "2", "--devices-per-process", "2", "--log-dir", str(logs)]
    demo_argv = ["demo", "--quick", "--per-sample", "--steps", "3", "--eval-lengths", "8"]
    assert _cli.main([*argv, "--", *demo_argv, "--out", str(out)]) == 0
    text = capfd.readouterr().out
    assert text.count("dyndepth demo: prefix sums mod 2") == 1
    assert "data-parallel over 4 devices of 2 processes" in text
    assert "per-device utilisation over 3 steps on 4 device(s)" in text
    log1 = (logs / "process-1.log").read_text()
    assert _only_gloo_chatter(log1), log1[-2000:]

    report = json.loads((out / "results.json").read_text())
    assert report["processes"] == 2 and report["devices"] == 4
    params, _, step, cfg = train.load_checkpoint(str(out / "alpha=1.ckpt.npz"))
    assert step == 3 and cfg.per_sample
    want_params, want_figures = train.train(cfg, str(tmp_path / "ref"), log=lambda *a: None)
    got = dict(figures=report["training"]["alpha=1"], params=jax.tree.leaves(params))
    _same_training(got, want_params, want_figures, devices=4)
