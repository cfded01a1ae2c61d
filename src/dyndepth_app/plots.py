"""The demo's pictures (matplotlib, imported only here): accuracy vs test-time iterations per
string length, and the adaptive run's stopping iteration vs string length."""

from __future__ import annotations

import numpy as np

MISSING = (
    "plots skipped: matplotlib is not installed; install it with "
    "`pip install matplotlib` (or `pip install 'dyndepth[demo]'`) and run the same command "
    "again: a finished run only re-evaluates"
)


def _pyplot():
    """``matplotlib.pyplot`` with the Agg backend, or ``None`` when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def have_matplotlib():
    return _pyplot() is not None


def plot_accuracy(curves_by_label, path, cfg):
    """Accuracy (%) vs test-time iterations, one line per run and length. Returns ``path``, or
    ``None`` without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=100)
    styles = {"alpha=1": "-", "alpha=0": ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lengths = sorted({int(k) for curves in curves_by_label.values() for k in curves})
    for label, curves in curves_by_label.items():
        for length, acc in sorted(curves.items(), key=lambda kv: int(kv[0])):
            ax.plot(
                np.arange(1, len(acc) + 1),
                100 * np.asarray(acc),
                styles.get(label, "--"),
                color=colors[lengths.index(int(length)) % len(colors)],
                label=f"{length} bits, {label}",
            )
    ax.axvline(cfg.max_iters, color="grey", lw=0.8)
    ax.text(cfg.max_iters + 2, 2, "train max M", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("test-time iterations (log scale)")
    ax.set_ylabel("strings solved (%)")
    ax.set_title(
        f"Prefix sums mod 2, trained on <= {cfg.train_length} bits (dyndepth demo)", fontsize=10
    )
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="center right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_adaptive(res, path):
    """The adaptive run: stopping iteration per string vs its length, the iteration from which
    each string stays solved, and the fixed count. Returns ``path``, or ``None`` without
    matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    lengths = np.asarray(res["lengths"])
    steps = np.asarray(res["steps"])
    solved = np.asarray(res["solved"], bool)
    solved_from = np.asarray(res["solved_from"])
    fig, ax = plt.subplots(figsize=(7.5, 4.4), dpi=100)
    ax.scatter(lengths[solved], steps[solved], s=7, label="stopped (string solved)")
    if (~solved).any():
        ax.scatter(
            lengths[~solved], steps[~solved], s=18, marker="x", color="red", label="stopped (wrong)"
        )
    ok = solved_from > 0
    ax.scatter(
        lengths[ok],
        solved_from[ok],
        s=4,
        color="grey",
        alpha=0.5,
        label="solved from this iteration on",
    )
    ax.axhline(res["fixed_iterations"], color="black", lw=0.8, ls="--")
    ax.text(
        lengths.min(),
        res["fixed_iterations"] * 1.02,
        f"fixed count for the batch: {res['fixed_iterations']}",
        fontsize=8,
    )
    ax.set_xlabel("string length (bits)")
    ax.set_ylabel("iterations")
    ax.set_title(
        f"Adaptive stopping, {res['strings']} strings of {res['min_length']}-{res['max_length']} "
        "bits in one batch",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
