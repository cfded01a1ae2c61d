"""What the stored-carry budget buys on an accelerator: the long tail at budgets of 0.5 to 8 GiB.

``benchmarks/tpu.py``'s long-tail workload (B=4096, D=1024, ``max_depth`` 256, step ``x -> x +
0.1 * tanh(x @ W1) @ W2``, depths 1 + Poisson(LogNormal), mean about 33): storing every carry
takes 4 GiB, and the budget counts two copies (8 GiB). Below it the loop stores as many carries
per sample as the budget holds and recomputes the others. Per budget: ``value_and_grad`` of
``repeat_batched`` with the defaults (best of ``--repeats`` interleaved rounds), its ratio to
``jax.checkpoint`` + masked ``lax.scan`` over the batch's deepest sample, the compiled
program's temporary memory, the carries stored per sample and the backward pass's executed
sample-steps (its recompute included; from ``return_stats``).

How to run (on the accelerator, from the repository root, dyndepth importable)::

    python benchmarks/tpu_budget.py             # about two minutes on one TPU v5e
    python benchmarks/tpu_budget.py --quick     # tiny shapes: a smoke run on a CPU
"""

from __future__ import annotations

import argparse

import jax
from scheduler import interleaved_ms
from tpu import WORKLOADS, checkpointed_scan, compiled, scheduled, workload_args

MIB = 2**20
BUDGETS_MIB = (512, 1024, 2048, 4096, 8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run on a CPU)")
    a = ap.parse_args()
    spec = (64, 16, 32, "long-tail") if a.quick else WORKLOADS["long-tail"]
    batch, width, max_depth, dist = spec
    # (quick: budgets scaled to its carries, 64 x 32 x 16 floats: 128 KiB to store them all)
    budgets = [b * (MIB // 2**12 if a.quick else MIB) for b in BUDGETS_MIB]
    dev = jax.devices()[0]
    args = workload_args(spec)
    ds = args[2]
    built = {f"budget {b / MIB:g} MiB": compiled(scheduled(max_depth), args, b) for b in budgets}
    built["jax.checkpoint + lax.scan"] = compiled(checkpointed_scan(int(ds.max())), args, None)
    ms = interleaved_ms({n: (c, args) for n, (c, _) in built.items()}, a.repeats)
    scan_ms = ms["jax.checkpoint + lax.scan"]
    print(f"jax {jax.__version__}, {dev.platform} ({dev.device_kind}), best of {a.repeats} "
          f"interleaved rounds")  # fmt: skip
    print(
        f"\nB={batch}, D={width}, max_depth {max_depth}, depths {dist} (mean "
        f"{float(ds.mean()):.1f}, max {int(ds.max())}, sum {int(ds.sum())}), value_and_grad\n"
    )
    print("| contender | ms | vs scan | temp MiB | stored / sample | bwd executed |")
    print("|---|---|---|---|---|---|")
    for n, (c, _) in built.items():
        (_, stats), _ = c(*args)
        temp = c.memory_analysis().temp_size_in_bytes / MIB
        cells = "- | -"
        if stats:
            cells = (
                f"{int(stats['stored_carries'])} | {int(stats['backward_executed_sample_steps'])}"
            )
        print(f"| {n} | {ms[n]:.2f} | {ms[n] / scan_ms:.2f}x | {temp:.1f} | {cells} |")


if __name__ == "__main__":
    main()
