"""Training the demo's network: progressive loss, AdamW, data parallelism, checkpoints, Ctrl-C.

Progressive loss (alpha = 1, Bansal et al. 2022): for each batch draw ``(n, k)`` with
``dyndepth.nn.sample_nk`` (``n + k <= M``), run ``n`` iterations without gradient and ``k`` with
gradient through ``dyndepth.nn.recurrent_depth``, cross-entropy at the end. The ``alpha = 0``
control always runs ``M`` iterations with gradient. Training strings have mixed lengths (drawn
per string from ``[min_train_length, train_length]``, padded and masked). AdamW (weight decay
2e-4), global-norm clipping at 1, linear warm-up; every ``check_every`` steps a validation check
(:func:`make_validation`), and once it passes ``cooldown`` more steps at a tenth of the learning
rate, then the run stops (at most ``steps`` steps in all).
With ``--per-sample`` every string draws its own ``n`` and ``k`` and both loops run through
``dyndepth.repeat_batched`` (the per-sample scheduler, which also counts the work it executes).

Data parallelism (``--devices N``, see :func:`make_loss_and_grad`): the batch is split over a 1-D
mesh of ``N`` devices and the loss and gradient run inside ``jax.shard_map``; every device
schedules its own shard, the loss is the mean over the *global* batch (a ``psum`` of the
per-device sums divided by the batch size), so the gradients of the replicated parameters come
out summed over the devices, and the AdamW update runs on the replicated parameters. The data,
``n`` and ``k`` are drawn from the replicated step key before ``shard_map``, so a run gives the
same numbers on any number of devices (up to float summation order). On several processes
(``--coordinator``, :mod:`~dyndepth_app.processes`) the mesh spans all their devices and the
same step runs unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dyndepth import nn as dnn

from .args import Interrupted, interrupt_requested
from .config import config_from_json, config_to_json, training_fields
from .model import (
    conv_eval,
    core,
    cross_entropy,
    head,
    init_params,
    make_batch,
    make_mixed_batch,
    project,
    sample_cross_entropy,
    think,
    think_batched,
)
from .processes import from_primary, is_primary, on_any_process, run_log

# ----------------------------------------------------------------------------- optimiser


def adamw_init(params):
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"m": zeros, "v": zeros, "t": jnp.zeros((), jnp.int32)}


def adamw_update(params, grads, opt, lr, *, weight_decay=2e-4, clip=1.0, b1=0.9, b2=0.999):
    gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
    scale = jnp.minimum(1.0, clip / jnp.maximum(gnorm, 1e-12))
    grads = jax.tree_util.tree_map(lambda g: g * scale, grads)
    t = opt["t"] + 1
    m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], grads)
    v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], grads)
    tf = t.astype(jnp.float32)
    mhat_c, vhat_c = 1 - b1**tf, 1 - b2**tf

    def upd(p, m, v):
        return p - lr * ((m / mhat_c) / (jnp.sqrt(v / vhat_c) + 1e-8) + weight_decay * p)

    return jax.tree_util.tree_map(upd, params, m, v), {"m": m, "v": v, "t": t}, gnorm


def learning_rate(step, cfg, converged_at):
    """Linear warm-up over ``cfg.warmup`` steps, then ``cfg.lr`` until the run converged (see
    :func:`make_validation`; ``converged_at`` is the step, -1 before), then ``0.1 * cfg.lr``
    for the ``cfg.cooldown`` steps that remain."""
    lr = cfg.lr * jnp.minimum(1.0, (step + 1) / max(1, cfg.warmup))
    return jnp.where((converged_at >= 0) & (step >= converged_at), 0.1 * lr, lr)


def make_validation(cfg):
    """``params -> accuracy``: whole-string accuracy after ``M`` iterations on 256 fixed
    strings of ``train_length`` bits. Training counts as converged once it reaches
    ``cfg.converge_target``; the escape from the loss plateau comes after a number of steps
    that varies a lot with the seed, so the run checks for it instead of guessing a step
    count."""
    x, t = make_batch(jax.random.PRNGKey(4242), 256, cfg.train_length)

    @jax.jit
    def accuracy(params):
        h = project(params, x, None, conv_eval)
        h = jax.lax.fori_loop(
            0, cfg.max_iters, lambda i, h: core(params, h, x, cfg.dilations, None, conv_eval), h
        )
        pred = jnp.argmax(head(params, h, None, conv_eval), axis=-1)
        return jnp.mean(jnp.all(pred == t, axis=-1))

    return accuracy


# ----------------------------------------------------------------------------- one step


def training_batch(key, cfg):
    """``(x, targets, mask)``: the step's strings, lengths drawn per string from
    ``[min_train_length, train_length]`` and padded (the mask is all ones when both are
    equal)."""
    x, t, m, _ = make_mixed_batch(key, cfg.batch, cfg.min_train_length, cfg.train_length)
    return x, t, m


def make_mesh(devices, batch):
    """A 1-D mesh ``("data",)`` over ``devices`` devices (:func:`mesh_devices`), or ``None`` for
    one device.

    Raises ``ValueError`` naming ``--devices`` when there are fewer devices than asked for or
    when ``batch`` does not split evenly over them."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices must be an integer >= 1, got {devices!r}")
    if devices == 1 and jax.process_count() == 1:
        return None
    chosen = mesh_devices(devices, jax.devices())
    if batch % devices:
        lo, hi = batch - batch % devices, batch - batch % devices + devices
        choices = f"{lo} or {hi}" if lo > 0 else f"{hi}"
        raise ValueError(
            f"--devices {devices}: --batch {batch} does not split evenly over {devices} "
            f"devices; use a batch that is a multiple of {devices} (e.g. --batch {choices})"
        )
    return jax.make_mesh((devices,), ("data",), devices=chosen)


def mesh_devices(count, devices):
    """The ``count`` devices of the mesh, from ``devices`` (all devices of all processes): the
    first ``count``; on several processes the first ``count / P`` of each of the ``P``
    processes, so that every process holds as many rows of the batch (a process without a
    device in the mesh could not take part in the step). Raises ``ValueError`` naming
    ``--devices``."""
    per_process = {}
    for d in devices:
        per_process.setdefault(d.process_index, []).append(d)
    processes, have = len(per_process), min(len(v) for v in per_process.values())
    platform = devices[0].platform
    if processes == 1 and have < count:
        raise ValueError(
            f"--devices {count}: only {have} {platform} device(s) are available. "
            f"To simulate {count} devices on a CPU, start the command with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} (the flag is read when "
            "JAX starts, so it must be set in the environment beforehand)"
        )
    if count % processes:
        raise ValueError(
            f"--devices {count}: the mesh must hold as many devices of each of the {processes} "
            f"processes; use a multiple of {processes}"
        )
    per = count // processes
    if per > have:
        raise ValueError(
            f"--devices {count}: {processes} processes with {have} {platform} device(s) each "
            f"hold {processes * have}. To simulate {per} devices per process on a CPU, start "
            f"each process with XLA_FLAGS=--xla_force_host_platform_device_count={per} "
            f"(dyndepth launch --devices-per-process {per} does so)"
        )
    return [d for p in sorted(per_process) for d in per_process[p][:per]]


def make_loss_and_grad(cfg, devices=1):
    """``(params, key) -> (loss, grads, mean(n + k), executed, useful)`` for the training batch
    and depths drawn from ``key``: the traceable core of :func:`make_train_step`. ``executed``
    and ``useful`` (int32, one entry per device, replicated on every device) are the forward
    sample-iterations of the step's loops on each device (see
    :func:`~dyndepth_app.model.think_batched`; with a per-batch depth every sample runs
    exactly ``n + k`` iterations, so both are ``samples_per_device * (n + k)``, counted, not
    measured).

    ``devices > 1``: data-parallel over :func:`make_mesh`. Key discipline: the step key is
    replicated, and the global batch, the per-batch ``(n, k)`` (identical on every device, so
    the shards run in lockstep depth) or the per-sample ``n`` and ``k`` are all drawn from it
    *before* ``shard_map``, exactly as on one device; each device then gets its rows of the
    batch (and of per-sample ``n``, ``k``). Inside ``shard_map`` the loss is
    ``psum(sum of this shard's per-sample losses) / batch``, the mean over the global batch, so
    the gradients of the replicated parameters come out of ``shard_map`` summed over devices
    (dyndepth adds the per-device gradient of a replicated parameter with one ``psum`` after
    its backward loop) and equal the one-device gradient up to float summation order. The
    optimizer update then runs on the replicated parameters and optimizer state.

    On several processes (``jax.distributed``) the mesh spans their devices and nothing else
    changes: every process runs this program, draws the same global batch and depths from the
    same replicated key and keeps its devices' rows, so no data crosses between processes and
    the numbers are those of one process."""
    M = cfg.max_iters
    mesh = make_mesh(devices, cfg.batch)
    per_sample = cfg.per_sample and cfg.alpha != 0.0  # alpha = 0 always runs (0, M)

    def forward(params, x, m, n, k):
        if per_sample:
            return think_batched(params, x, n, k, M, cfg.dilations, m)
        logits = think(params, x, n, k, M, cfg.dilations, m)  # the loop carries the batch
        work = jnp.reshape(x.shape[0] * (n + k), (1,)).astype(jnp.int32)
        return logits, work, work

    def loss_fn(params, x, t, m, n, k):
        logits, executed, useful = forward(params, x, m, n, k)
        return cross_entropy(logits, t, m), (executed, useful)

    def shard_loss_fn(params, x, t, m, n, k):
        logits, executed, useful = forward(params, x, m, n, k)
        total = jax.lax.psum(jnp.sum(sample_cross_entropy(logits, t, m)), "data")
        return total / cfg.batch, (executed, useful)

    if mesh is None:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    else:
        nk = P("data") if per_sample else P()
        rows = P("data")
        grad_fn = jax.shard_map(
            jax.value_and_grad(shard_loss_fn, has_aux=True),
            mesh=mesh,
            in_specs=(P(), rows, rows, rows, nk, nk),
            out_specs=((P(), (rows, rows)), P()),
        )

    def loss_and_grad(params, key):
        kd, kn = jax.random.split(key)
        x, t, m = training_batch(kd, cfg)
        if cfg.alpha == 0.0:
            n, k = jnp.int32(0), jnp.int32(M)
        else:
            n, k = dnn.sample_nk(kn, (cfg.batch,) if per_sample else (), max_iters=M)
        depth = jnp.mean(n + k)
        if mesh is not None:  # each device gets its rows of the global batch
            rows = NamedSharding(mesh, P("data"))
            x, t, m = (jax.reshard(a, rows) for a in (x, t, m))
            if per_sample:
                n, k = jax.reshard(n, rows), jax.reshard(k, rows)
        (loss, (executed, useful)), grads = grad_fn(params, x, t, m, n, k)
        if mesh is not None:
            # Replicated (a gather of one number per device), so that every process can read
            # them: a process cannot fetch the entries of another process's devices.
            everywhere = NamedSharding(mesh, P())
            executed, useful = jax.reshard(executed, everywhere), jax.reshard(useful, everywhere)
        return loss, grads, depth, executed, useful

    return loss_and_grad


def make_train_step(cfg, devices=1):
    """The jitted training step ``(params, opt, key, step, converged_at) -> (params, opt, loss,
    gnorm, mean(n + k), executed, useful)``: :func:`make_loss_and_grad`, then the AdamW update
    (on the replicated parameters and optimizer state when ``devices > 1``)."""
    loss_and_grad = make_loss_and_grad(cfg, devices)

    @jax.jit
    def train_step(params, opt, key, step, converged_at):
        loss, grads, nk, executed, useful = loss_and_grad(params, key)
        lr = learning_rate(step, cfg, converged_at)
        params, opt, gnorm = adamw_update(params, grads, opt, lr)
        return params, opt, loss, gnorm, nk, executed, useful

    return train_step


def replicate(tree, mesh):
    """``tree`` placed on every device of ``mesh`` (unchanged when ``mesh`` is None)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P()))


# ----------------------------------------------------------------------------- checkpoints


class BadCheckpoint(ValueError):
    """A path that is not a readable demo checkpoint."""


class ConfigMismatch(ValueError):
    """A checkpoint in ``--out`` was trained with another configuration."""


def save_checkpoint(path, params, opt, step, cfg, converged_at=-1):
    flat = {}
    for prefix, tree in (("params", params), ("opt", opt)):
        for kp, leaf in jax.tree_util.tree_leaves_with_path(tree):
            flat[prefix + jax.tree_util.keystr(kp)] = np.asarray(leaf)
    flat["__step__"] = np.asarray(step)
    flat["__converged_at__"] = np.asarray(converged_at)
    flat["__config__"] = np.asarray(json.dumps(config_to_json(cfg)))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **flat)
    os.replace(tmp, path)


def _open_checkpoint(path):
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".ckpt.npz"))
        hint = f" such as {os.path.join(path, found[0])}" if found else ""
        raise BadCheckpoint(f"{path} is a directory; pass a checkpoint file{hint}")
    if not os.path.exists(path):
        raise BadCheckpoint(f"{path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
        return data, config_from_json(json.loads(str(data["__config__"])))
    except Exception as e:  # zip, npz, JSON or field errors: all mean "not a checkpoint"
        raise BadCheckpoint(
            f"{path} is not a checkpoint of this version of dyndepth demo ({type(e).__name__}: {e})"
        ) from None


def read_checkpoint_config(path):
    """The :class:`~dyndepth_app.config.Config` stored in a checkpoint; raises
    :class:`BadCheckpoint`."""
    return _open_checkpoint(path)[1]


def load_checkpoint(path):
    """``(params, opt, step, cfg)`` from a checkpoint; raises :class:`BadCheckpoint` for a
    missing, corrupt or foreign file or a directory. :func:`checkpoint_converged_at` reads the
    step at which the run converged."""
    data, cfg = _open_checkpoint(path)
    params = init_params(jax.random.PRNGKey(0), cfg.width)
    opt = adamw_init(params)

    def fill(prefix, tree):
        leaves = []
        for kp, like in jax.tree_util.tree_leaves_with_path(tree):
            leaf = np.asarray(data[prefix + jax.tree_util.keystr(kp)])
            if leaf.shape != like.shape:
                raise ValueError(f"{prefix}{jax.tree_util.keystr(kp)} has shape {leaf.shape}")
            leaves.append(jnp.asarray(leaf))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)

    try:
        return fill("params", params), fill("opt", opt), int(data["__step__"]), cfg
    except Exception as e:
        raise BadCheckpoint(
            f"{path} is not a dyndepth demo checkpoint ({type(e).__name__}: {e})"
        ) from None


def checkpoint_converged_at(path):
    """The step at which the checkpoint's run converged, -1 if it has not."""
    return int(_open_checkpoint(path)[0]["__converged_at__"])


def check_resumable(path, cfg):
    """Raise :class:`ConfigMismatch` naming the differing fields when the checkpoint at ``path``
    was trained with another configuration than ``cfg`` (evaluation fields aside)."""
    refuse_other_training(training_fields(read_checkpoint_config(path)), training_fields(cfg), path)


def refuse_other_training(saved: dict, wanted: dict, path: str) -> None:
    """Raise :class:`ConfigMismatch` naming the fields of ``wanted`` (the run's training
    configuration) that differ from ``saved`` (the checkpoint's at ``path``)."""
    diff = [name for name in wanted if saved.get(name) != wanted[name]]
    if diff:
        what = ", ".join(f"{n} {saved.get(n)!r} (checkpoint) vs {wanted[n]!r} (now)" for n in diff)
        raise ConfigMismatch(
            f"--out {os.path.dirname(path) or '.'} holds {os.path.basename(path)}, trained with "
            f"another configuration: {what}; use another --out, or the checkpoint's settings to "
            "resume it"
        )


# ----------------------------------------------------------------------------- the loop


def _start_state(cfg, ckpt, label, log):
    """``(params, opt, step, converged_at)``: from the checkpoint ``ckpt`` when it exists (None:
    do not resume), else a fresh start. On several processes, process 0 alone reads the
    checkpoint and the others take its state, so that all resume at the same step even when
    they cannot see the file."""
    params = init_params(jax.random.fold_in(jax.random.PRNGKey(cfg.seed), 1), cfg.width)
    opt, step, converged_at = adamw_init(params), 0, -1
    if ckpt is not None and is_primary() and os.path.exists(ckpt):
        check_resumable(ckpt, cfg)
        params, opt, step, _ = load_checkpoint(ckpt)
        converged_at = checkpoint_converged_at(ckpt)
        log(f"[{label}] resuming from {ckpt} at step {step}")
    if jax.process_count() > 1:
        state = (params, opt, np.int32(step), np.int32(converged_at))
        params, opt, step, converged_at = from_primary(state)
    return params, opt, int(step), int(converged_at)


def _check_interrupt(step):
    """Whether to look for a Ctrl-C before ``step``: always on one process; on several, every
    10 steps, as the processes must agree (a collective of about 3 ms on two CPU processes, a
    tenth of a ``--quick`` step there)."""
    return jax.process_count() == 1 or step % 10 == 0


def _bar(total, desc):
    try:
        from tqdm import tqdm

        # disable=None: no bar when stderr is not a terminal, so piped logs hold no frames
        return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr, disable=None)
    except ImportError:  # pragma: no cover - tqdm is in the test and demo extras
        return None


def train(cfg, out_dir, *, label="alpha=1", resume=True, stop_at=None, devices=1, log=None):
    """Train (resuming from ``out_dir/<label>.ckpt.npz`` when present); returns params (on one
    device) and a dict of training figures. ``stop_at`` ends the call early at that step (as an
    interruption would: the checkpoint holds the state, and a later call resumes the same run).
    ``devices``: data-parallel over that many devices (see :func:`make_train_step`); a run gives
    the same numbers on any number of devices, so a checkpoint resumes on any count.

    A checkpoint trained with another configuration raises :class:`ConfigMismatch`. After a
    Ctrl-C (under :class:`~dyndepth_app.args.SigintGuard`) the loop saves a checkpoint of the
    steps done and raises :class:`~dyndepth_app.args.Interrupted`.

    ``figures["per_device"]`` holds, per device, the forward sample-iterations of the steps run
    in this call (see :func:`per_device_work`).

    On several processes (:mod:`~dyndepth_app.processes`) every process calls this; process 0
    alone logs, shows the progress bar and reads and writes the checkpoint."""
    primary = is_primary()
    log = run_log(log)
    if primary:
        os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
    key = jax.random.PRNGKey(cfg.seed)
    step_fn = make_train_step(cfg, devices)  # validates ``devices`` before any work
    mesh = make_mesh(devices, cfg.batch)
    validation = make_validation(cfg)
    params, opt, start, converged_at = _start_state(cfg, ckpt if resume else None, label, log)
    params, opt = replicate((params, opt), mesh)

    def save(step):
        if primary:
            save_checkpoint(ckpt, params, opt, step, cfg, converged_at)

    bar = _bar(cfg.steps, label) if primary else None
    if bar is not None:
        bar.update(start)
    times, depths, losses = [], [], []
    executed = np.zeros(devices, np.int64)
    useful = np.zeros(devices, np.int64)
    every = max(1, cfg.steps // 10)
    t_start = time.perf_counter()
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    if converged_at >= 0:
        end = min(end, converged_at + cfg.cooldown)
    step = start
    while step < end:
        if _check_interrupt(step) and on_any_process(interrupt_requested()):
            # Ctrl-C (on any process: all stop at this step): keep the work done, stop cleanly
            save(step)
            if bar is not None:
                bar.close()
            raise Interrupted(
                f"interrupted at step {step} of {cfg.steps} ({label}); checkpoint saved to "
                f"{ckpt}; run the same command to resume"
            )
        t0 = time.perf_counter()
        params, opt, loss, gnorm, nk, ex, us = step_fn(
            params,
            opt,
            jax.random.fold_in(key, 1000 + step),
            jnp.int32(step),
            jnp.int32(converged_at),
        )
        loss = float(loss)
        dt = time.perf_counter() - t0
        executed += np.asarray(ex, np.int64)
        useful += np.asarray(us, np.int64)
        if step > start + 2:  # skip compile
            times.append(dt)
            depths.append(float(nk))
        losses.append(loss)
        if bar is not None and not bar.disable:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", steps_per_s=f"{1.0 / max(dt, 1e-9):.1f}")
        elif step % every == 0:
            log(f"[{label}] step {step} loss {loss:.4f}")
        if converged_at < 0 and (step + 1) % cfg.check_every == 0:
            accuracy = float(validation(params))
            if accuracy >= cfg.converge_target:
                converged_at = step + 1
                end = min(end, converged_at + cfg.cooldown)
                message = (
                    f"[{label}] converged at step {converged_at}: {100 * accuracy:.1f}% of "
                    f"{cfg.train_length}-bit strings solved after M={cfg.max_iters} iterations; "
                    f"{cfg.cooldown} more steps at a tenth of the learning rate"
                )
                if bar is not None:
                    bar.write(message)
                else:
                    log(message)
        step += 1
        if step % every == 0 or step in (end, cfg.steps):
            save(step)
    if bar is not None:
        bar.close()
    if converged_at < 0 and step == cfg.steps:
        log(
            f"[{label}] warning: training did not converge within {cfg.steps} steps (fewer than "
            f"{100 * cfg.converge_target:g}% of the {cfg.train_length}-bit validation strings "
            "solved): expect poor accuracy; another --seed or more --steps may help"
        )
    wall = time.perf_counter() - t_start
    figures = {"train_seconds": wall, "final_loss": losses[-1] if losses else None}
    figures["steps_run"] = step - start
    figures["converged_at_step"] = converged_at if converged_at >= 0 else None
    figures["devices"] = devices
    figures["per_device"] = per_device_work(executed, useful, cfg, step - start)
    figures["per_device_counts"] = (
        "forward sample-iterations of the n and k loops; executed as counted by "
        "dyndepth.repeat_batched (slots x loop iterations)"
        if cfg.per_sample and cfg.alpha != 0.0
        else "forward sample-iterations of the n and k loops; per-batch depth: every sample "
        "runs n + k, so executed = useful by construction"
    )
    if len(times) >= 5 and len(set(depths)) > 1:
        # Step time against the iterations the batch ran (n + k): a line fit, so that readers
        # can see the cost follow the depth.
        a, b = np.polyfit(np.asarray(depths), np.asarray(times), 1)
        figures["step_seconds_per_iteration"] = float(a)
        figures["step_seconds_fixed"] = float(b)
    if times:
        figures["median_step_seconds"] = float(np.median(times))
    if mesh is not None:
        # Evaluation runs on one device. Through the host: ``jax.device_put(params, device)``
        # would keep the mesh in the arrays' sharding type, which jit then refuses to mix with
        # single-device arrays.
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a)), params)
    return params, figures


def per_device_work(executed, useful, cfg, steps):
    """Per-device figures over ``steps`` training steps: a list of dicts with ``device``,
    ``samples_per_step``, ``useful_sample_iterations`` (the iterations its samples asked for,
    ``sum(n + k)``), ``executed_sample_iterations`` (what its loops ran: slots x loop iterations
    with ``--per-sample``, as counted by ``dyndepth.repeat_batched``; with a per-batch depth every
    sample runs exactly ``n + k``, so executed equals useful by construction),
    ``utilisation`` (useful / executed) and ``share`` (its part of all useful work). Forward
    passes only: the backward pass of the ``k`` loop follows the same schedule but is not
    counted. With ``--devices`` on simulated CPU devices the devices share the host's cores, so
    these are counts of work, not of time."""
    executed = np.asarray(executed, np.int64)
    useful = np.asarray(useful, np.int64)
    total = max(int(useful.sum()), 1)
    return [
        {
            "device": d,
            "samples_per_step": cfg.batch // len(useful),
            "steps": steps,
            "useful_sample_iterations": int(u),
            "executed_sample_iterations": int(e),
            "utilisation": float(u / e) if e else None,
            "share": float(u / total),
        }
        for d, (e, u) in enumerate(zip(executed, useful, strict=True))
    ]


def device_table(rows):
    lines = [
        "| device | samples/step | useful | executed | useful/executed | share of useful |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        util = "-" if r["utilisation"] is None else f"{100 * r['utilisation']:.1f}%"
        lines.append(
            f"| {r['device']} | {r['samples_per_step']} | {r['useful_sample_iterations']} | "
            f"{r['executed_sample_iterations']} | {util} | {100 * r['share']:.1f}% |"
        )
    return "\n".join(lines)
