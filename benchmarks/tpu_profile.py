"""Where the long tail's value_and_grad spends its time on an accelerator, op by op.

Runs ``benchmarks/tpu.py``'s long-tail workload (B=4096, D=1024, ``max_depth`` 256, depths 1 +
Poisson(LogNormal)) under ``jax.profiler`` for each contender named by ``--contenders`` (the
names of ``tpu.py``'s table: ``default``, ``every carry stored``, ``jax.checkpoint + lax.scan``,
...) and sums, per call, the device time of every executed XLA op (the ``XLA Ops`` line of the
device's trace) by op, printing the largest with the name stack they were emitted for: which
loop (forward or backward, its slot count) and which operation (the store's first fill is a
``pad``; a conversion of a whole buffer, a ``convert`` run once per call). The ops of a loop's
body run once per iteration (the count column); a loop's or branch's own span (``while``,
``conditional``) is printed beside them, not added in.

How to run (on the accelerator host, from the repository root, dyndepth importable)::

    python benchmarks/tpu_profile.py
    python benchmarks/tpu_profile.py --contenders "every carry stored" --top 20
"""

from __future__ import annotations

import argparse
import collections
import time

import jax
import tpu
from op_profile import op_names, trace_events

SPANS = ("while", "cond", "conditional", "call")


def device_ops(events: list) -> list:
    """The complete events of the devices' ``XLA Ops`` lines."""
    proc, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            proc[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
    return [e for e in events if e.get("ph") == "X" and "/device:" in proc.get(e["pid"], "")
            and thread.get((e["pid"], e["tid"])) == "XLA Ops"]  # fmt: skip


def profile(fn, args, calls: int) -> tuple[collections.Counter, collections.Counter]:
    """Milliseconds and executions per call of each op, over ``calls`` profiled calls."""
    ms, runs = collections.Counter(), collections.Counter()
    for e in device_ops(trace_events(fn, args, calls)):
        ms[e["name"]] += e["dur"] / 1e3 / calls
        runs[e["name"]] += 1 / calls
    return ms, runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", nargs="+", default=["every carry stored", "default"])
    p.add_argument("--calls", type=int, default=2, help="profiled calls per contender")
    p.add_argument("--top", type=int, default=12, help="ops printed per contender")
    a = p.parse_args()
    spec = tpu.WORKLOADS["long-tail"]
    batch, _, max_depth, _ = spec
    args = tpu.workload_args(spec)
    named = tpu.contenders(batch, max_depth, int(args[2].max()))
    unknown = [n for n in a.contenders if n not in named]
    if unknown or a.calls < 1 or a.top < 1:
        p.error(f"--contenders: one of {sorted(named)}; --calls, --top positive (got {unknown})")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; long tail B={batch}, "
          f"max_depth {max_depth}, value_and_grad; per call, {a.calls} profiled calls")  # fmt: skip
    for name in a.contenders:
        loss, budget = named[name]
        fn, _ = tpu.compiled(loss, args, budget)
        names = op_names(fn)
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        wall = 1e3 * (time.perf_counter() - t0)
        ms, runs = profile(fn, args, a.calls)
        ops = {n: v for n, v in ms.items() if not n.startswith(SPANS)}
        print(f"\n### {name}: {wall:.1f} ms a call, ops {sum(ops.values()):.1f} ms, temp "
              f"{fn.memory_analysis().temp_size_in_bytes / 2**20:.0f} MiB\n")  # fmt: skip
        print("| op | ms | runs | emitted for |\n|---|---|---|---|")
        for n, v in sorted(ms.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"| {n} | {v:.2f} | {runs[n]:.0f} | {names.get(n, '(no name)')[-72:]} |")


if __name__ == "__main__":
    main()
