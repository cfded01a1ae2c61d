"""``dyndepth demo``: train a recurrent-depth ("Deep Thinking") network that thinks longer on
harder inputs, with dyndepth's own loops.

Task: prefix sums mod 2. A string of fair coin flips ``b``; the input is ``b - 0.5``, the target
at position ``i`` is ``sum(b[:i+1]) mod 2``; a string counts as solved only when every bit is
right. The model (DT-recall, 1D; Schwarzschild et al. 2021, Bansal et al. 2022) is trained on
16-bit strings with a random number of iterations and evaluated on 16-, 32- and 64-bit strings
for every iteration count from 1 to ``8 * M``: a net that learned the algorithm solves the longer
strings by iterating longer, and keeps solving them when it iterates longer still.

Model (no biases, no normalisation; every conv has kernel 3, SAME padding, written as one matmul
over the three shifted copies of the input, which XLA:CPU differentiates far faster than
``lax.conv`` inside a loop body):

    h = relu(conv(x, 1 -> w))                                  # projection
    repeat n times:  z = conv(concat(h, x), w + 1 -> w)        # recurrent core, with recall
                     z = block(block(z)), block(u) = relu(u + conv(relu(conv(u))))
                     h = z
    logits = conv(relu(conv(relu(conv(h, w -> w)), w -> w/2)), w/2 -> 2)   # head

Training (progressive loss, alpha = 1): for each batch draw ``n`` (iterations without gradient)
and ``k`` (iterations with gradient) with ``n + k <= M``, run ``n`` iterations with
``dyndepth.repeat(strategy="while")`` on stop-gradient inputs (no residuals stored), then ``k``
with ``dyndepth.repeat`` (reverse-mode, cost following ``k``), cross-entropy at the end. The
``alpha = 0`` control always runs ``M`` iterations with gradient. AdamW (weight decay 2e-4),
global-norm clipping at 1, linear warm-up, step decay x0.1 at 75% and 90% of training.
With ``--per-sample`` every sample draws its own ``n`` and ``k`` and both loops run through
``dyndepth.repeat_batched`` (the per-sample scheduler, which also counts the work it executes).

Data parallelism (``--devices N``, see :func:`make_loss_and_grad`): the batch is split over a 1-D
mesh of ``N`` devices and the loss and gradient run inside ``jax.shard_map``; every device
schedules its own shard, the loss is the mean over the *global* batch (a ``psum`` of the
per-device sums divided by the batch size), so the gradients of the replicated parameters come
out summed over the devices, and the AdamW update runs on the replicated parameters. The data,
``n`` and ``k`` are drawn from the replicated step key before ``shard_map``, so a run gives the
same numbers on any number of devices (up to float summation order).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dyndepth

from .args import (
    Interrupted,
    check_interrupt,
    int_at_least,
    int_list,
    interrupt_requested,
    positive_float,
)

# ----------------------------------------------------------------------------- data


def make_batch(key, batch, length):
    """(inputs (B, L) float32 in {-0.5, 0.5}, targets (B, L) int32 prefix parities)."""
    bits = jax.random.bernoulli(key, 0.5, (batch, length)).astype(jnp.int32)
    targets = jnp.cumsum(bits, axis=1) % 2
    return bits.astype(jnp.float32) - 0.5, targets


# ----------------------------------------------------------------------------- model


def conv(x, w):
    """SAME conv1d with kernel 3 as one matmul: x (L, Cin), w (3 * Cin, Cout) -> (L, Cout)."""
    xp = jnp.pad(x, ((1, 1), (0, 0)))
    shifted = jnp.concatenate([xp[:-2], xp[1:-1], xp[2:]], axis=-1)
    return shifted @ w


def init_params(key, width):
    def conv_w(k, cin, cout):
        bound = 1.0 / math.sqrt(3 * cin)  # PyTorch's default conv initialisation
        return jax.random.uniform(k, (3 * cin, cout), jnp.float32, -bound, bound)

    ks = jax.random.split(key, 9)
    return {
        "proj": conv_w(ks[0], 1, width),
        "recall": conv_w(ks[1], width + 1, width),
        "blocks": [
            {"a": conv_w(ks[2], width, width), "b": conv_w(ks[3], width, width)},
            {"a": conv_w(ks[4], width, width), "b": conv_w(ks[5], width, width)},
        ],
        "head": [
            conv_w(ks[6], width, width),
            conv_w(ks[7], width, width // 2),
            conv_w(ks[8], width // 2, 2),
        ],
    }


def project(params, x):
    """x (L,) -> initial state (L, w)."""
    return jax.nn.relu(conv(x[:, None], params["proj"]))


def core(params, h, x):
    """One iteration of the recurrent core (recall: the raw input is concatenated each time)."""
    z = conv(jnp.concatenate([h, x[:, None]], axis=-1), params["recall"])
    for blk in params["blocks"]:
        z = jax.nn.relu(z + conv(jax.nn.relu(conv(z, blk["a"])), blk["b"]))
    return z


def head(params, h):
    a, b, c = params["head"]
    return conv(jax.nn.relu(conv(jax.nn.relu(conv(h, a)), b)), c)


def think(params, x, n, k, max_iters):
    """n iterations without gradient, then k with gradient; returns the logits (L, 2).

    The first loop sees only stop-gradient inputs, so reverse mode never enters it: it runs as a
    plain forward loop and stores nothing. Under vmap with per-sample ``n`` and ``k`` the first
    (``"while"``) loop runs the batch until its largest ``n`` (finished samples masked) and the
    second goes through the per-sample scheduler; :func:`think_batched` schedules both."""
    h0 = project(params, x)
    frozen = jax.lax.stop_gradient(params)
    h = dyndepth.repeat(
        lambda h: core(frozen, h, x),
        jax.lax.stop_gradient(h0),
        n,
        max_depth=max_iters,
    )
    # The gradient flows from the projection only when no frozen iteration ran (n == 0).
    h = jnp.where(n == 0, h0, jax.lax.stop_gradient(h))
    h = dyndepth.repeat(lambda h: core(params, h, x), h, k, max_depth=max_iters)
    return head(params, h)


def think_batched(params, x, n, k, max_iters):
    """:func:`think` for a batch ``x`` (B, L) with per-sample ``n`` and ``k`` (B,), both loops
    through ``dyndepth.repeat_batched``: returns the logits (B, L, 2) and this device's forward
    work as ``(executed, useful)`` int32 arrays of shape (1,), summed over the two loops:
    ``executed`` is slots x loop iterations as run by the scheduler (its own count), ``useful``
    is ``sum(n + k)``. Inside ``shard_map`` the figures are the device's own.

    The carry is ``(h, x)``: the recall input rides along unchanged, since ``repeat_batched``
    steps one sample at a time and takes no per-sample ``xs``."""
    h0 = jax.vmap(lambda x: project(params, x))(x)
    frozen = jax.lax.stop_gradient(params)
    (h, _), st_n = dyndepth.repeat_batched(
        lambda c: (core(frozen, c[0], c[1]), c[1]),
        (jax.lax.stop_gradient(h0), x),
        n,
        max_depth=max_iters,
        return_stats=True,
    )
    h = jnp.where((n == 0)[:, None, None], h0, jax.lax.stop_gradient(h))
    (h, _), st_k = dyndepth.repeat_batched(
        lambda c: (core(params, c[0], c[1]), c[1]),
        (h, x),
        k,
        max_depth=max_iters,
        return_stats=True,
    )
    logits = jax.vmap(lambda h: head(params, h))(h)
    executed = st_n["per_device_executed_sample_steps"] + st_k["per_device_executed_sample_steps"]
    useful = st_n["per_device_useful_sample_steps"] + st_k["per_device_useful_sample_steps"]
    return logits, executed, useful


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def sample_cross_entropy(logits, targets):
    """Per-sample cross-entropy (mean over positions): (B, L, 2), (B, L) -> (B,)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0], axis=-1)


def evaluate_curve(params, x, targets, iters):
    """Whole-string accuracy after every iteration count 1..iters, with one dyndepth.scan."""

    def per_sample(x, t):
        def step(h, _):
            h = core(params, h, x)
            solved = jnp.all(jnp.argmax(head(params, h), axis=-1) == t)
            return h, solved

        _, solved = dyndepth.scan(
            step, project(params, x), depth=iters, length=iters, strategy="while"
        )
        return solved

    return jnp.mean(jax.vmap(per_sample)(x, targets).astype(jnp.float32), axis=0)


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


def learning_rate(step, cfg):
    warm = max(1, int(0.03 * cfg.steps))
    lr = cfg.lr * jnp.minimum(1.0, (step + 1) / warm)
    lr = jnp.where(step >= int(0.75 * cfg.steps), lr * 0.1, lr)
    return jnp.where(step >= int(0.9 * cfg.steps), lr * 0.1, lr)


# ----------------------------------------------------------------------------- training


@dataclass
class Config:
    width: int = 64
    train_length: int = 16
    max_iters: int = 16  # M
    batch: int = 100
    steps: int = 1500
    lr: float = 3e-3
    alpha: float = 1.0
    per_sample: bool = False
    seed: int = 0
    # Evaluation only: a checkpoint resumes under other values of these.
    eval_lengths: tuple = field(default=(16, 32, 64), metadata={"eval": True})
    eval_batch: int = field(default=500, metadata={"eval": True})
    eval_iters_factor: int = field(default=8, metadata={"eval": True})


def training_fields(cfg):
    """The fields of ``cfg`` that define a training run (all but the evaluation ones)."""
    return {f.name: getattr(cfg, f.name) for f in fields(cfg) if not f.metadata.get("eval")}


class ConfigMismatch(ValueError):
    """A checkpoint in ``--out`` was trained with another configuration."""


def check_resumable(path, cfg):
    """Raise :class:`ConfigMismatch` naming the differing fields when the checkpoint at ``path``
    was trained with another configuration than ``cfg`` (evaluation fields aside)."""
    saved = training_fields(read_checkpoint_config(path))
    wanted = training_fields(cfg)
    diff = [name for name in wanted if saved[name] != wanted[name]]
    if diff:
        what = ", ".join(f"{n} {saved[n]!r} (checkpoint) vs {wanted[n]!r} (now)" for n in diff)
        raise ConfigMismatch(
            f"--out {os.path.dirname(path) or '.'} holds {os.path.basename(path)}, trained with "
            f"another configuration: {what}; use another --out, or the checkpoint's settings to "
            "resume it"
        )


def draw_nk(key, cfg, shape=()):
    """Deep Thinking's draw: n ~ U[0, M - 1], then k ~ U[1, M - n]."""
    kn, kk = jax.random.split(key)
    n = jax.random.randint(kn, shape, 0, cfg.max_iters)
    k = jax.random.randint(kk, shape, 1, cfg.max_iters - n + 1)
    return n, k


def make_mesh(devices, batch):
    """A 1-D mesh ``("data",)`` over the first ``devices`` devices, or ``None`` for one device.

    Raises ``ValueError`` naming ``--devices`` when there are fewer devices than asked for or
    when ``batch`` does not split evenly over them."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices must be an integer >= 1, got {devices!r}")
    if devices == 1:
        return None
    have = jax.device_count()
    if have < devices:
        raise ValueError(
            f"--devices {devices}: only {have} {jax.default_backend()} device(s) are available. "
            f"To simulate {devices} devices on a CPU, start the command with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (the flag is read when "
            "JAX starts, so it must be set in the environment beforehand)"
        )
    if batch % devices:
        lo, hi = batch - batch % devices, batch - batch % devices + devices
        choices = f"{lo} or {hi}" if lo > 0 else f"{hi}"
        raise ValueError(
            f"--devices {devices}: --batch {batch} does not split evenly over {devices} "
            f"devices; use a batch that is a multiple of {devices} (e.g. --batch {choices})"
        )
    return jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])


def make_loss_and_grad(cfg, devices=1):
    """``(params, key) -> (loss, grads, mean(n + k), executed, useful)`` for the training batch
    and depths drawn from ``key``: the traceable core of :func:`make_train_step`. ``executed``
    and ``useful`` (int32, one entry per device) are the forward sample-iterations of the
    step's loops on each device (see :func:`think_batched`; with a per-batch depth every sample
    runs exactly ``n + k`` iterations, so both are ``samples_per_device * (n + k)``, counted,
    not measured).

    ``devices > 1``: data-parallel over :func:`make_mesh`. Key discipline: the step key is
    replicated, and the global batch, the per-batch ``(n, k)`` (identical on every device, so
    the shards run in lockstep depth) or the per-sample ``n`` and ``k`` are all drawn from it
    *before* ``shard_map``, exactly as on one device; each device then gets its rows of the
    batch (and of per-sample ``n``, ``k``). Inside ``shard_map`` the loss is
    ``psum(sum of this shard's per-sample losses) / batch``, the mean over the global batch, so
    the gradients of the replicated parameters come out of ``shard_map`` summed over devices
    (dyndepth adds the per-device gradient of a replicated parameter with one ``psum`` after
    its backward loop) and equal the one-device gradient up to float summation order. The
    optimizer update then runs on the replicated parameters and optimizer state."""
    M = cfg.max_iters
    mesh = make_mesh(devices, cfg.batch)
    per_sample = cfg.per_sample and cfg.alpha != 0.0  # alpha = 0 always runs (0, M)

    def forward(params, x, n, k):
        if per_sample:
            return think_batched(params, x, n, k, M)
        logits = jax.vmap(lambda x: think(params, x, n, k, M))(x)
        work = jnp.reshape(x.shape[0] * (n + k), (1,)).astype(jnp.int32)
        return logits, work, work

    def loss_fn(params, x, t, n, k):
        logits, executed, useful = forward(params, x, n, k)
        return cross_entropy(logits, t), (executed, useful)

    def shard_loss_fn(params, x, t, n, k):
        logits, executed, useful = forward(params, x, n, k)
        total = jax.lax.psum(jnp.sum(sample_cross_entropy(logits, t)), "data")
        return total / cfg.batch, (executed, useful)

    if mesh is None:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    else:
        nk = P("data") if per_sample else P()
        grad_fn = jax.shard_map(
            jax.value_and_grad(shard_loss_fn, has_aux=True),
            mesh=mesh,
            in_specs=(P(), P("data"), P("data"), nk, nk),
            out_specs=((P(), (P("data"), P("data"))), P()),
        )

    def loss_and_grad(params, key):
        kd, kn = jax.random.split(key)
        x, t = make_batch(kd, cfg.batch, cfg.train_length)
        if cfg.alpha == 0.0:
            n, k = jnp.int32(0), jnp.int32(M)
        else:
            n, k = draw_nk(kn, cfg, (cfg.batch,) if per_sample else ())
        if mesh is not None:  # each device gets its rows of the global batch
            rows = NamedSharding(mesh, P("data"))
            x, t = jax.reshard(x, rows), jax.reshard(t, rows)
            if per_sample:
                n, k = jax.reshard(n, rows), jax.reshard(k, rows)
        (loss, (executed, useful)), grads = grad_fn(params, x, t, n, k)
        return loss, grads, jnp.mean(n + k), executed, useful

    return loss_and_grad


def make_train_step(cfg, devices=1):
    """The jitted training step ``(params, opt, key, step) -> (params, opt, loss, gnorm,
    mean(n + k), executed, useful)``: :func:`make_loss_and_grad`, then the AdamW update (on the
    replicated parameters and optimizer state when ``devices > 1``)."""
    loss_and_grad = make_loss_and_grad(cfg, devices)

    @jax.jit
    def train_step(params, opt, key, step):
        loss, grads, nk, executed, useful = loss_and_grad(params, key)
        params, opt, gnorm = adamw_update(params, grads, opt, learning_rate(step, cfg))
        return params, opt, loss, gnorm, nk, executed, useful

    return train_step


def replicate(tree, mesh):
    """``tree`` placed on every device of ``mesh`` (unchanged when ``mesh`` is None)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, P()))


def save_checkpoint(path, params, opt, step, cfg):
    flat = {}
    for prefix, tree in (("params", params), ("opt", opt)):
        for kp, leaf in jax.tree_util.tree_leaves_with_path(tree):
            flat[prefix + jax.tree_util.keystr(kp)] = np.asarray(leaf)
    flat["__step__"] = np.asarray(step)
    flat["__config__"] = np.asarray(json.dumps(asdict(cfg)))
    tmp = path + ".tmp.npz"
    np.savez(tmp, **flat)
    os.replace(tmp, path)


class BadCheckpoint(ValueError):
    """A path that is not a readable demo checkpoint."""


def _open_checkpoint(path):
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".ckpt.npz"))
        hint = f" such as {os.path.join(path, found[0])}" if found else ""
        raise BadCheckpoint(f"{path} is a directory; pass a checkpoint file{hint}")
    if not os.path.exists(path):
        raise BadCheckpoint(f"{path}: no such file")
    try:
        data = np.load(path, allow_pickle=False)
        cfg_dict = json.loads(str(data["__config__"]))
        cfg_dict["eval_lengths"] = tuple(cfg_dict["eval_lengths"])
        return data, Config(**cfg_dict)
    except Exception as e:  # zip, npz, JSON or field errors: all mean "not a checkpoint"
        raise BadCheckpoint(
            f"{path} is not a dyndepth demo checkpoint ({type(e).__name__}: {e})"
        ) from None


def read_checkpoint_config(path):
    """The :class:`Config` stored in a checkpoint; raises :class:`BadCheckpoint`."""
    return _open_checkpoint(path)[1]


def load_checkpoint(path):
    """``(params, opt, step, cfg)`` from a checkpoint; raises :class:`BadCheckpoint` for a
    missing, corrupt or foreign file or a directory."""
    data, cfg = _open_checkpoint(path)
    try:
        return _fill_checkpoint(data, cfg)
    except Exception as e:
        raise BadCheckpoint(
            f"{path} is not a dyndepth demo checkpoint ({type(e).__name__}: {e})"
        ) from None


def _fill_checkpoint(data, cfg):
    params = init_params(jax.random.PRNGKey(0), cfg.width)
    opt = adamw_init(params)

    def fill(prefix, tree):
        leaves = [
            jnp.asarray(data[prefix + jax.tree_util.keystr(kp)])
            for kp, _ in jax.tree_util.tree_leaves_with_path(tree)
        ]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), leaves)

    return fill("params", params), fill("opt", opt), int(data["__step__"]), cfg


def _log(*args):
    print(*args, flush=True)


def _bar(total, desc):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)
    except ImportError:  # pragma: no cover - tqdm is in the test and demo extras
        return None


def train(cfg, out_dir, *, label="alpha=1", resume=True, stop_at=None, devices=1, log=None):
    """Train (resuming from ``out_dir/<label>.ckpt.npz`` when present); returns params (on one
    device) and a dict of training figures. ``stop_at`` ends the call early at that step (as an
    interruption would: the checkpoint holds the state, and a later call resumes the same run).
    ``devices``: data-parallel over that many devices (see :func:`make_train_step`); a run gives
    the same numbers on any number of devices, so a checkpoint resumes on any count.

    ``figures["per_device"]`` holds, per device, the forward sample-iterations of the steps run
    in this call (see :func:`per_device_work`)."""
    log = log or _log
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
    key = jax.random.PRNGKey(cfg.seed)
    step_fn = make_train_step(cfg, devices)  # validates ``devices`` before any work
    mesh = make_mesh(devices, cfg.batch)
    if resume and os.path.exists(ckpt):
        check_resumable(ckpt, cfg)
        params, opt, start, _ = load_checkpoint(ckpt)
        log(f"[{label}] resuming from {ckpt} at step {start}")
    else:
        params = init_params(jax.random.fold_in(key, 1), cfg.width)
        opt = adamw_init(params)
        start = 0
    params, opt = replicate((params, opt), mesh)
    bar = _bar(cfg.steps, label)
    if bar is not None:
        bar.update(start)
    times, depths, losses = [], [], []
    executed = np.zeros(devices, np.int64)
    useful = np.zeros(devices, np.int64)
    every = max(1, cfg.steps // 10)
    t_start = time.perf_counter()
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    for step in range(start, end):
        if interrupt_requested():  # Ctrl-C: keep the work done, stop cleanly
            save_checkpoint(ckpt, params, opt, step, cfg)
            if bar is not None:
                bar.close()
            raise Interrupted(
                f"interrupted at step {step} of {cfg.steps} ({label}); checkpoint saved to "
                f"{ckpt}; run the same command to resume"
            )
        t0 = time.perf_counter()
        params, opt, loss, gnorm, nk, ex, us = step_fn(
            params, opt, jax.random.fold_in(key, 1000 + step), jnp.int32(step)
        )
        loss = float(loss)
        dt = time.perf_counter() - t0
        executed += np.asarray(ex, np.int64)
        useful += np.asarray(us, np.int64)
        if step > start + 2:  # skip compile
            times.append(dt)
            depths.append(float(nk))
        losses.append(loss)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", steps_per_s=f"{1.0 / max(dt, 1e-9):.1f}")
        elif step % every == 0:
            log(f"[{label}] step {step} loss {loss:.4f}")
        if (step + 1) % every == 0 or step + 1 == cfg.steps:
            save_checkpoint(ckpt, params, opt, step + 1, cfg)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_start
    figures = {"train_seconds": wall, "final_loss": losses[-1] if losses else None}
    figures["devices"] = devices
    figures["per_device"] = per_device_work(executed, useful, cfg, end - start)
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
        figures["median_step_seconds"] = float(np.median(times))
        buckets = {}
        for d, t in zip(depths, times, strict=True):
            buckets.setdefault(int(round(d)), []).append(t)
        figures["median_step_seconds_by_iterations"] = {
            str(d): float(np.median(v)) for d, v in sorted(buckets.items())
        }
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


def evaluate(params, cfg, lengths=None, iters=None, key=None):
    """Whole-string accuracy after every iteration count ``1..iters`` (default ``8 M``) for
    each length: ``{length: [accuracy, ...]}``. Stops at a Ctrl-C between lengths
    (:class:`Interrupted`)."""
    lengths = cfg.eval_lengths if lengths is None else lengths
    iters = cfg.eval_iters_factor * cfg.max_iters if iters is None else iters
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    key = jax.random.PRNGKey(12345) if key is None else key
    curve = jax.jit(evaluate_curve, static_argnums=3)
    results = {}
    for length in lengths:
        check_interrupt("interrupted during evaluation")
        x, t = make_batch(jax.random.fold_in(key, length), cfg.eval_batch, length)
        results[int(length)] = np.asarray(curve(params, x, t, iters)).tolist()
    return results


def summarize(curves, cfg):
    """Per length: the best accuracy and where, the best over ``[2M, 8M]`` and the accuracy at
    ``M``, each ``None`` when the curve does not reach those iterations, and at the last
    iteration evaluated (``iters``)."""
    M = cfg.max_iters
    rows = []
    for length, acc in curves.items():
        acc = np.asarray(acc)
        rows.append(
            {
                "length": length,
                "best": float(acc.max()),
                "best_at": int(acc.argmax()) + 1,
                "best_in_2M_8M": float(acc[2 * M - 1 : 8 * M].max()) if len(acc) >= 8 * M else None,
                "at_M": float(acc[M - 1]) if len(acc) >= M else None,
                "at_last": float(acc[-1]),
                "iters": len(acc),
            }
        )
    return rows


def _pct(v):
    return "n/a" if v is None else f"{100 * v:.1f}%"


def table(summary_by_label, cfg):
    """The summary as a Markdown table; "n/a" marks iterations that were not evaluated."""
    M = cfg.max_iters
    lines = [
        f"| run | test length | best solved | at iteration | best in [2M, 8M] = [{2 * M}, "
        f"{8 * M}] | at M = {M} | at the last iteration evaluated |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, rows in summary_by_label.items():
        for r in rows:
            lines.append(
                f"| {label} | {r['length']} | {_pct(r['best'])} | {r['best_at']} | "
                f"{_pct(r['best_in_2M_8M'])} | {_pct(r['at_M'])} | "
                f"{_pct(r['at_last'])} (iteration {r['iters']}) |"
            )
    return "\n".join(lines)


def plot(curves_by_label, path, cfg):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    styles = {"alpha=1": "-", "alpha=0": ":"}
    for label, curves in curves_by_label.items():
        for length, acc in curves.items():
            ax.plot(
                np.arange(1, len(acc) + 1),
                100 * np.asarray(acc),
                styles.get(label, "--"),
                label=f"{length} bits, {label}",
            )
    ax.axvline(cfg.max_iters, color="grey", lw=0.8)
    ax.text(cfg.max_iters + 1, 2, "train max", color="grey", fontsize=8)
    ax.set_xlabel("test-time iterations")
    ax.set_ylabel("strings solved (%)")
    ax.set_title(f"Prefix sums mod 2, trained on {cfg.train_length} bits (dyndepth demo)")
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_demo(cfg, out_dir, *, control=True, devices=1, log=None):
    log = log or _log
    os.makedirs(out_dir, exist_ok=True)
    make_mesh(devices, cfg.batch)  # a clear error before any work
    log(
        f"dyndepth demo: prefix sums mod 2, width {cfg.width}, train length {cfg.train_length}, "
        f"M={cfg.max_iters}, batch {cfg.batch}, {cfg.steps} steps, "
        + (
            f"devices: {jax.devices()}"
            if devices == 1
            else f"data-parallel over {devices} devices: {jax.devices()[:devices]}"
        )
    )
    runs = [("alpha=1", cfg)]
    if control:
        runs.append(("alpha=0", Config(**{**asdict(cfg), "alpha": 0.0, "per_sample": False})))
    curves, summaries, training = {}, {}, {}
    for label, c in runs:  # a config mismatch is an error before any training
        ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
        if os.path.exists(ckpt):
            check_resumable(ckpt, c)
    for label, c in runs:
        params, figures = train(c, out_dir, label=label, devices=devices, log=log)
        training[label] = figures
        try:
            curves[label] = evaluate(params, c)
        except Interrupted:
            ckpt = os.path.join(out_dir, f"{label}.ckpt.npz")
            raise Interrupted(
                f"interrupted while evaluating {label}; its training is complete in {ckpt} "
                f"(dyndepth eval --checkpoint {ckpt} evaluates it; the same command resumes the "
                "demo)"
            ) from None
        summaries[label] = summarize(curves[label], c)
    report = {
        "config": asdict(cfg),
        "devices": devices,
        "training": training,
        "summary": summaries,
        "curves": {label: {str(k): v for k, v in cv.items()} for label, cv in curves.items()},
        "jax": jax.__version__,
        "dyndepth": dyndepth.__version__,
    }
    with open(os.path.join(out_dir, "results.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    png = plot(curves, os.path.join(out_dir, "accuracy.png"), cfg)
    log("")
    log(table(summaries, cfg))
    for label, f in training.items():
        if "step_seconds_per_iteration" in f:
            log(
                f"[{label}] training {f['train_seconds']:.0f} s; step time = "
                f"{1e3 * f['step_seconds_fixed']:.1f} ms + "
                f"{1e3 * f['step_seconds_per_iteration']:.2f}"
                " ms x (n + k)"
            )
    for label, f in training.items():
        if devices == 1 and not (cfg.per_sample and label == "alpha=1"):
            continue  # one device, per-batch depth: 100% by construction (still in the JSON)
        rows = f["per_device"]
        log("")
        if not rows[0]["steps"]:
            log(f"[{label}] per-device utilisation: no training step ran in this call (resumed)")
            continue
        log(
            f"[{label}] per-device utilisation over {rows[0]['steps']} steps on {devices} "
            f"device(s), {f['per_device_counts']}:"
        )
        log(device_table(rows))
    log(f"results: {os.path.join(out_dir, 'results.json')}" + (f", plot: {png}" if png else ""))
    return report


# ----------------------------------------------------------------------------- CLI


# ``--quick``: a seconds-long smoke run. Flags given explicitly win over these values.
QUICK = dict(
    width=8,
    train_length=8,
    max_iters=4,
    batch=16,
    steps=20,
    eval_lengths=(8, 16),
    eval_batch=32,
    eval_iters_factor=8,
)


def add_arguments(p):
    d = Config()
    p.add_argument("--task", choices=["prefix-sums", "seed"], default="prefix-sums")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few seconds: tiny model, few steps (flags given explicitly still apply)",
    )
    p.add_argument("--width", type=int_at_least(2), help=f"channels (default {d.width})")
    p.add_argument(
        "--train-length",
        type=int_at_least(1),
        help=f"bits per training string (default {d.train_length})",
    )
    p.add_argument(
        "--max-iters", type=int_at_least(1), help=f"M: n + k <= M (default {d.max_iters})"
    )
    p.add_argument(
        "--batch",
        type=int_at_least(1),
        help=f"training batch (default {d.batch}, rounded up to a multiple of --devices)",
    )
    p.add_argument("--steps", type=int_at_least(1), help=f"training steps (default {d.steps})")
    p.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--alpha", type=float, choices=[0.0, 1.0], default=d.alpha)
    p.add_argument("--per-sample", action="store_true", help="per-sample n and k (scheduler)")
    p.add_argument("--no-control", action="store_true", help="skip the alpha=0 control run")
    p.add_argument(
        "--devices",
        type=int_at_least(1),
        default=1,
        help="data-parallel training over this many devices (the batch must split evenly; on "
        "a CPU, simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=N)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--eval-lengths",
        type=int_list(1),
        help="test string lengths, comma-separated (default "
        + ",".join(map(str, d.eval_lengths))
        + ")",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default runs/<timestamp>/). A folder that holds checkpoints of "
        "the same configuration resumes them; one trained with another configuration is an "
        "error naming the differing settings",
    )


def _round_up(n, m):
    m = m if isinstance(m, int) and m >= 1 else 1
    return -(-n // m) * m


_FLAGS = ("width", "train_length", "max_iters", "batch", "steps", "lr", "eval_lengths")


def config_from_args(a):
    """The run's :class:`Config`: each flag given explicitly, else the ``--quick`` value (with
    ``--quick``), else the default. Without ``--batch`` the batch (100, or 16 with ``--quick``)
    is rounded up to a multiple of ``--devices``, so that it splits evenly."""
    devices = getattr(a, "devices", 1)
    values = asdict(Config())
    if a.quick:
        values.update(QUICK)
    if getattr(a, "batch", None) is None:
        values["batch"] = _round_up(values["batch"], devices)
    for name in _FLAGS:
        if getattr(a, name, None) is not None:
            values[name] = getattr(a, name)
    values.update(alpha=a.alpha, per_sample=a.per_sample, seed=a.seed)
    return Config(**values)


def main_demo(a):
    cfg = config_from_args(a)
    devices = getattr(a, "devices", 1)
    try:
        make_mesh(devices, cfg.batch)
    except ValueError as e:
        print(f"dyndepth demo: error: {e}", file=sys.stderr)
        return 2
    if a.batch is None and devices > 1:
        print(f"batch {cfg.batch} (the default, rounded up to a multiple of --devices {devices})")
    out = a.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    try:
        run_demo(cfg, out, control=not a.no_control, devices=devices)
    except ConfigMismatch as e:
        print(f"dyndepth demo: error: {e}", file=sys.stderr)
        return 2
    return 0


def main_eval(a):
    try:
        params, _, step, cfg = load_checkpoint(a.checkpoint)
    except BadCheckpoint as e:
        print(f"dyndepth eval: error: argument --checkpoint: {e}", file=sys.stderr)
        return 2
    print(f"checkpoint {a.checkpoint} (step {step}, width {cfg.width}, M={cfg.max_iters})")
    curves = evaluate(params, cfg, lengths=a.lengths, iters=a.iters)
    print(table({"eval": summarize(curves, cfg)}, cfg))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({str(k): v for k, v in curves.items()}, fh)
    return 0
