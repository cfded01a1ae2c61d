"""What a scheduled iteration costs against a lockstep one, per row, on an accelerator.

The slot rule (``dyndepth._cost``) models an iteration over ``S`` slots as ``fixed + S x row``.
A wrap-around iteration also moves each row's data in and out of its slot (gathers and
scatters), which a lockstep iteration (``S = B``, every row at one shared step: slices) does
not; on a TPU that costs per row whatever the step. For each workload below (step ``x + tanh(x
@ W)``, ``B`` samples of width ``D``, every carry stored), this script times value_and_grad of
``repeat_batched`` at fixed slot counts, at the default, with the time rule over a longer
ladder (:func:`losses`), and ``jax.checkpoint`` + masked ``lax.scan``; from ``return_stats``
it takes each count's iterations (forward + backward) and prints the time per iteration and,
per scheduled count, the cost per row beyond lockstep's:
``(t / iterations - lockstep's t / iterations x S / B) / S``, the movement the model does not
count. The default's time over the best fixed count's is the slot rule's check (at most 1.1x).

How to run (on the accelerator host, from the repository root, dyndepth importable)::

    python benchmarks/tpu_slot_costs.py
    python benchmarks/tpu_slot_costs.py --quick    # small shapes (a smoke run on a CPU)
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from measure import machine_line, masked_scan
from scheduler import depths_of, interleaved_ms

import dyndepth as dd

# name: (batch, width, max_depth, distribution, fixed slot counts)
WORKLOADS = {
    "narrow": (4096, 16, 500, "uniform", (4096, 2048, 512, 128)),
    "medium": (1024, 256, 100, "uniform", (1024, 512, 128, 32)),
    "wide, long tail": (2048, 512, 128, "long-tail", (2048, 1024, 256, 64)),
}
QUICK = {"narrow": (256, 16, 40, "uniform", (256, 128, 32)),
         "wide, long tail": (128, 64, 32, "long-tail", (128, 64, 16))}  # fmt: skip


def losses(batch: int, max_depth: int, counts: tuple) -> dict:
    """label -> loss(W, xs, ds) returning ``(value, stats)``. Beside the default, the time
    rule over the five counts of a small step's ladder (``B``, ``B / 2``, ``B / 4``, ``B / 8``,
    ``B / 32``): the counts the default leaves out on a TPU (those whose rows with twice their
    moves are as many as the batch's) kept, each a loop of the chain that does not run."""
    ladder = tuple(max(1, batch >> k) for k in (0, 1, 2, 3, 5))

    def dyndepth_loss(slots):
        def loss(W, xs, ds):
            step = lambda x: x + jnp.tanh(x @ W)  # noqa: E731
            out, stats = dd.repeat_batched(step, xs, ds, max_depth=max_depth, slots=slots,
                                           checkpoints=max_depth, return_stats=True)  # fmt: skip
            return jnp.sum(out**2), stats

        return loss

    def scan_loss(W, xs, ds):
        out = masked_scan(lambda x: x + jnp.tanh(x @ W), xs, ds, max_depth, remat=True)
        return jnp.sum(out**2), {}

    out = {"default": dyndepth_loss(None), "time rule, five counts": dyndepth_loss(ladder)}
    out.update((f"S={c}", dyndepth_loss(c)) for c in counts)
    out["jax.checkpoint + lax.scan"] = scan_loss
    return out


def workload(name: str, spec: tuple, repeats: int) -> None:
    batch, width, max_depth, dist, counts = spec
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    args = (
        jax.random.normal(k[0], (width, width)) / width**0.5,
        jax.random.normal(k[1], (batch, width)),
        depths_of(dist, k[2], batch, max_depth),
    )
    fns = {lab: jax.jit(jax.value_and_grad(f, has_aux=True))
           for lab, f in losses(batch, max_depth, counts).items()}  # fmt: skip
    iters = {}
    for lab, fn in fns.items():
        (_, stats), _ = fn(*args)
        if stats:
            iters[lab] = int(stats["iterations"]) + int(stats["backward_iterations"])
    ms = interleaved_ms({lab: (fn, args) for lab, fn in fns.items()}, repeats)
    ds = args[2]
    print(f"\n#### {name}: B={batch}, D={width}, max_depth {max_depth}, {dist} depths "
          f"(sum {int(jnp.sum(ds))}, max {int(jnp.max(ds))})\n")  # fmt: skip
    print("| contender | ms | iterations fwd + bwd | µs / iteration | ns / row beyond lockstep |")
    print("|---|---|---|---|---|")
    lock = ms[f"S={batch}"] / iters[f"S={batch}"]
    for lab, t in ms.items():
        it = iters.get(lab)
        per = f"{1e3 * t / it:.2f}" if it else "-"
        extra = "-"
        if it and lab.startswith("S=") and int(lab[2:]) < batch:
            S = int(lab[2:])
            extra = f"{1e6 * (t / it - lock * S / batch) / S:.1f}"
        print(f"| {lab} | {t:.2f} | {it or '-'} | {per} | {extra} |")
    best = min(ms[f"S={c}"] for c in counts)
    print(f"\ndefault / best fixed count: {ms['default'] / best:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--quick", action="store_true", help="small shapes (a smoke run on a CPU)")
    p.add_argument("--only", default="", help="workloads whose name contains this text")
    a = p.parse_args()
    if a.repeats < 1:
        p.error("--repeats must be positive")
    print(machine_line())
    for name, spec in (QUICK if a.quick else WORKLOADS).items():
        if a.only in name:
            workload(name, spec, a.repeats)


if __name__ == "__main__":
    main()
