"""The demo's task, model and training: data, convolutions, masking, the truncated gradient,
resuming, per-sample depths, `dyndepth demo --quick` end to end (with `dyndepth eval`), and
data-parallel training (`--devices N`) on 8 simulated CPU devices, in a subprocess."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tree_allclose

from dyndepth._app import cli as _cli
from dyndepth._app import demo, model, train
from dyndepth._app.config import QUICK, Config, replace

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
    import json
    import jax, jax.numpy as jnp, numpy as np
    from dyndepth._app import model, train
    from dyndepth._app.config import QUICK, Config, replace

    assert jax.device_count() == 8
    out = {}
    for per_sample in (False, True):
        cfg = replace(Config(), **QUICK)
        cfg = replace(cfg, train_length=8, max_iters=4, batch=32, per_sample=per_sample)
        params = model.init_params(jax.random.PRNGKey(0), cfg.width)
        for nd in (1, 2, 8):
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
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")


def data_parallel_steps():
    """One training step on 1, 2 and 8 simulated devices, per-batch and per-sample depths."""
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
    """The step's loss and gradients on 2 and 8 devices agree with one device to 1e-5
    relative: the data and depths do not depend on the device count."""
    ref = res[f"{per_sample}-1"]
    ref_grads = [np.asarray(g) for g in ref["grads"]]
    for nd in (2, 8):
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
    pytest-xdist worker)."""
    res = data_parallel_steps()
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
            "dyndepth",
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
