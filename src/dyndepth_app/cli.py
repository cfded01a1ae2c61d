"""The ``dyndepth`` command line: ``dyndepth demo``, ``dyndepth eval``, ``dyndepth bench`` and
``dyndepth launch`` (a multi-process demo on this machine).

The library never imports this module.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version as _version

from .args import Interrupted, Parser, SigintGuard, int_at_least


def _demo(args: argparse.Namespace) -> int:
    from dyndepth_app import compile_cache, processes, sudoku

    error = sudoku.wrong_task_flag(args)
    if error:
        print(f"dyndepth demo: error: {error}", file=sys.stderr)
        return 2
    if args.task == "sudoku":
        compile_cache.enable(args)
        return sudoku.main(args)
    if args.task == "dropout-residual":
        flags = processes.given(args)
        if args.devices not in (None, 1):
            flags.insert(0, f"--devices {args.devices}")
        if flags:
            print(
                f"dyndepth demo: error: {flags[0]} applies to the prefix-sums training "
                "only; --task dropout-residual runs on one device",
                file=sys.stderr,
            )
            return 2
        return _dropout_residual_demo(args)
    error = processes.check_flags(args)
    if error:
        print(f"dyndepth demo: error: {error}", file=sys.stderr)
        return 2
    if processes.given(args):
        try:
            processes.initialize(args)  # before anything else touches JAX
        except (processes.JoinFailed, Interrupted) as e:
            # JAX's join is still blocked in a thread that nothing can stop, and its exit
            # handlers would wait for it: leave at once.
            failed = isinstance(e, processes.JoinFailed)
            print(f"dyndepth demo: {'error: ' if failed else ''}{e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1 if failed else 130)
        except RuntimeError as e:  # cannot reach or start the coordinator; JAX already in use
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(
                f"dyndepth demo: error: process {args.process_id} of {args.num_processes} could "
                f"not join the run at --coordinator {args.coordinator}: {first}",
                file=sys.stderr,
            )
            return 1
    from dyndepth_app import demo

    compile_cache.enable(args)
    return demo.main_demo(args)


def _launch(args: argparse.Namespace) -> int:
    from dyndepth_app import launch

    return launch.main(args)


def _eval(args: argparse.Namespace) -> int:
    from dyndepth_app import compile_cache, demo

    compile_cache.enable(args)
    return demo.main_eval(args)


def _dropout_residual_demo(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    import dyndepth
    from dyndepth_app import bench as _bench

    print("== a dropout residual layer with dyndepth.repeat (B=32, D=64, depths in [1, 100]) ==")
    max_iters, batch, dim = 100, 32, 64
    key = jax.random.PRNGKey(42)
    kx, kd, kb = jax.random.split(key, 3)
    xs = jax.random.normal(kx, (batch, dim))
    ds = jax.random.randint(kd, (batch,), 1, max_iters + 1)
    ks = jax.random.split(kb, batch)

    def layer(x, k):
        h = jax.nn.relu(x @ jnp.ones((dim, dim)) / dim)
        keep = jax.random.bernoulli(k, 0.5, h.shape)
        return x + jnp.where(keep, h * 2.0, 0.0)

    out = jax.jit(
        jax.vmap(lambda x, d, k: dyndepth.repeat(layer, x, d, max_depth=max_iters, key=k))
    )(xs, ds, ks)
    print(out.shape)
    print()
    print("== side by side on this workload: the scan + cond baseline vs dyndepth ==")
    print(_bench.header())
    workload = _bench.WORKLOADS["dropout-residual"]
    rows = _bench.run_workload(workload, args.repeats, progress=_bench._progress)
    print(_bench.table(rows))
    return 0


def _parser() -> argparse.ArgumentParser:
    from dyndepth_app import compile_cache
    from dyndepth_app import demo as demo_mod
    from dyndepth_app import launch as launch_mod
    from dyndepth_app import sudoku as sudoku_mod

    parser = Parser(prog="dyndepth", description="dyndepth demo and benchmarks")
    parser.add_argument(
        "--version",
        action="version",
        version=f"dyndepth {_version('dyndepth')} (jax {_version('jax')})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="train a recurrent-depth network on prefix sums (--task dropout-residual: the "
        "README quickstart's program and a side-by-side on its workload; --task sudoku: "
        "halting per puzzle)",
    )
    demo_mod.add_arguments(demo)
    sudoku_mod.add_arguments(demo)
    compile_cache.add_arguments(demo)
    demo.add_argument(
        "--repeats",
        type=int_at_least(1),
        default=5,
        help="(--task dropout-residual) timing repeats",
    )
    demo.set_defaults(run=_demo)
    ev = sub.add_parser("eval", help="evaluate a saved demo checkpoint")
    demo_mod.add_eval_arguments(ev)
    compile_cache.add_arguments(ev)
    ev.set_defaults(run=_eval)
    sub.add_parser("bench", help="side-by-side benchmarks (dyndepth bench --help)", add_help=False)
    la = sub.add_parser(
        "launch",
        help="run the demo as several processes on this machine, each with simulated CPU "
        "devices (dyndepth launch --processes 2 --devices-per-process 2 -- demo --quick)",
    )
    launch_mod.add_arguments(la)
    la.set_defaults(run=_launch)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command; returns the exit status: 0, 2 for a usage error (one line on stderr), 130
    after Ctrl-C (one line on stderr saying what was kept)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    commands = ("demo", "eval", "bench", "launch")
    prog = "dyndepth " + (argv[0] if argv and argv[0] in commands else "")
    with SigintGuard(prog.strip()):
        try:
            if argv and argv[0] == "bench":  # the benchmark has its own parser and --help
                from dyndepth_app import bench

                bench.main(argv[1:])
                return 0
            args = _parser().parse_args(argv)
            return args.run(args)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            return e.code if isinstance(e.code, int) else 2
        except Interrupted as e:
            sys.stdout.flush()
            print(f"{prog.strip()}: {e}", file=sys.stderr, flush=True)
            return 130


if __name__ == "__main__":
    sys.exit(main())
