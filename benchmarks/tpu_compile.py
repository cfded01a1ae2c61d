"""Kernels per loop iteration, compile time and temp memory on the TPU compiler, without a TPU.

libtpu compiles for a named TPU topology on a machine that has none (the set-up:
``benchmarks/README.md``). For each program
below this script lowers and compiles ``jax.jit`` of it for one device of ``--topology``
(default ``v5e:2x2``) and reads the optimized HLO: every ``while`` loop, forward or backward,
and the kernels its body runs per iteration. It prints, per program, lower and compile time
(median of ``--repeats`` distinct programs: the step's constant differs by ``1e-6 * i``, so no
cache answers; one discarded first) and XLA's temp memory; per loop, the kernels and what they
are. It does not run anything: no run time.

**Counting rule**: a loop body's kernels are its fusions and unfused ops,
leaving out parameters, tuples, get-tuple-element, constants, bitcasts, ``opt-barrier`` and
buffer allocations (``custom-call`` to ``AllocateBuffer``): they emit no code. Copies
(``copy``, ``copy-start``) are counted apart, in their own column: they are real moves of data
every iteration. A ``conditional`` in a body counts one plus its largest branch; a ``call``, its
callee; a loop nested in a body is a row of its own ("in loop N"). Columns: ``scalar``, the
kernels whose every output is a scalar (on a TPU they run on the scalar unit, not as a vector
kernel); ``gather``, ``scatter``, ``dyn-slice``, ``dyn-update-slice``, ``dot``: the kernels that
contain such an op (a fusion is searched through); ``cond``, the kernels of the loop's condition
(also run every iteration, not in ``kernels``).

**Which loop is which.** Loops are numbered in schedule order: the entry computation's
instructions in order, descending into conditionals and calls (the branches of one conditional,
e.g. one loop per slot count, are alternatives: one runs). A loop is ``backward`` when its
``op_name`` holds ``transpose(``: JAX wraps every equation that transposition emits (the
backward pass of ``grad``/``vjp``, remat's recomputation in it included) in that name scope,
whatever the kernel; otherwise ``forward``. A loop in another loop's body is nested. The script
checks the rule against the order (dataflow puts every forward loop of a value_and_grad before
the backward ones) and prints a note where they disagree; ``--kernels`` lists every kernel of
every body with its ``op_name``, to see where an op comes from.

Programs (B=256, D=256, step ``c + 0.1 * tanh(c @ W)``, depths in ``[0, 100]``, ``max_depth``
100; fwd = forward, vg = ``jax.value_and_grad`` of ``sum(out ** 2)`` in ``W``): masked
``lax.scan`` fwd; ``jax.checkpoint`` + masked ``lax.scan`` vg; ``vmap(lax.while_loop)`` fwd;
``repeat_batched`` with ``slots=B`` (lockstep), ``slots=128`` (wrap-around) and the default,
fwd and vg; ``vmap(repeat)`` vg; ``vmap(dyndepth.while_loop)`` (continuous refill) fwd and vg;
one depth for the whole batch (lockstep) fwd and vg; and the transformer block of
``benchmarks/scheduler.py`` (B=64, L=16, D=64, max_depth 32): ``jax.checkpoint`` + masked
``lax.scan`` vg and ``vmap(repeat)`` vg.

How to run (from the repository root; the libtpu venv as in benchmarks/README.md)::

    PYTHONPATH=src /path/to/tpuvenv/bin/python benchmarks/tpu_compile.py 2>/dev/null
    PYTHONPATH=src /path/to/tpuvenv/bin/python benchmarks/tpu_compile.py --quick 2>/dev/null
    .venv/bin/python benchmarks/tpu_compile.py --platform cpu   # this machine's compiler
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from measure import (
    SEQ,
    block,
    block_shapes,
    compile_times,
    masked_scan,
    source_revision,
    table,
    temp_mib,
)

import dyndepth as dd

# ---------------------------------------------------------------------------------------------
# Reading optimized HLO text


@dataclasses.dataclass
class Instr:
    name: str
    opcode: str
    shape: str
    calls: list[str]
    op_name: str
    target: str  # a custom-call's target, else ""
    body: str  # a while loop's body, else ""
    cond: str  # a while loop's condition, else ""


@dataclasses.dataclass
class Loop:
    index: int
    body: str
    cond: str
    op_name: str
    parent: int | None  # the loop whose body holds this one
    role: str = ""


_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(
    r"\b(?:condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_COMMENT = re.compile(r"/\*[^*]*\*/")


def _split_type(rest: str) -> tuple[str, str]:
    """``rest`` = ``TYPE OPCODE(...)...``: the type (a tuple type in balanced parentheses, or
    one token) and the opcode."""
    if rest.startswith("("):
        depth = 0
        end = 0
        for end, ch in enumerate(rest, 1):  # noqa: B007 (read after the loop)
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        shape, tail = rest[:end], rest[end:].lstrip()
    else:
        shape, _, tail = rest.partition(" ")
    return shape, tail[: tail.find("(")]


def _attr(pattern: re.Pattern, line: str) -> str:
    m = pattern.search(line)
    return m.group(1) if m else ""


def parse_hlo(text: str) -> tuple[dict[str, list[Instr]], str]:
    """The computations of an HLO module's text (name -> instructions) and the entry's name."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in _COMMENT.sub("", text).splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = comps.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.startswith("}"):
            current = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, opcode = _split_type(m.group(2))
        calls = _CALLED.findall(line)
        for group in _BRANCHES.findall(line):
            calls += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        attrs = (_attr(p, line) for p in (_OP_NAME, _TARGET, _BODY, _COND))
        current.append(Instr(m.group(1), opcode, shape, calls, *attrs))
    return comps, entry


def find_loops(comps: dict[str, list[Instr]], entry: str) -> list[Loop]:
    """Every while loop, in schedule order (see the module docstring), with its role."""
    loops: list[Loop] = []

    def visit(comp: str, parent: int | None) -> None:
        for ins in comps.get(comp, []):
            if ins.opcode == "while":
                loop = Loop(len(loops), ins.body, ins.cond, ins.op_name, parent)
                loops.append(loop)
                visit(ins.body, loop.index)
            elif ins.opcode in ("conditional", "call") or ins.opcode.startswith("async"):
                for c in ins.calls:
                    visit(c, parent)

    visit(entry, None)
    for loop in loops:
        loop.role = "backward" if "transpose(" in loop.op_name else "forward"
    return loops


_NO_CODE = {"parameter", "tuple", "get-tuple-element", "constant", "bitcast", "opt-barrier",
            "copy-done", "while"}  # fmt: skip
_COPIES = {"copy", "copy-start"}
_NOTABLE = {
    "gather": ("gather",),
    "scatter": ("scatter",),
    "dyn-slice": ("dynamic-slice",),
    "dyn-update-slice": ("dynamic-update-slice",),
    "dot": ("dot", "convolution"),
}


def body_kernels(comps: dict[str, list[Instr]], comp: str) -> tuple[list[Instr], int]:
    """The kernels one iteration of body ``comp`` runs, and its copies (the counting rule)."""
    kernels, copies = [], 0
    for ins in comps.get(comp, []):
        if ins.opcode in _NO_CODE or ins.target == "AllocateBuffer":
            continue
        if ins.opcode in _COPIES:
            copies += 1
        elif ins.opcode == "call":
            k, c = body_kernels(comps, ins.calls[0])
            kernels, copies = kernels + k, copies + c
        elif ins.opcode == "conditional":
            branches = [body_kernels(comps, b) for b in ins.calls]
            k, c = max(branches, key=lambda kc: len(kc[0]), default=([], 0))
            kernels, copies = kernels + [ins] + k, copies + c
        else:
            kernels.append(ins)
    return kernels, copies


def _opcodes_inside(comps: dict[str, list[Instr]], ins: Instr) -> set[str]:
    ops, todo, seen = {ins.opcode}, list(ins.calls) if ins.opcode == "fusion" else [], set()
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for inner in comps.get(c, []):
            ops.add(inner.opcode)
            todo += inner.calls
    return ops


def _is_scalar(shape: str) -> bool:
    dims = re.findall(r"\[([^\]]*)\]", shape)
    return bool(dims) and all(d == "" for d in dims)


def loop_rows(text: str) -> list[dict]:
    """One dict per while loop of an optimized HLO module's text: index, role, parent, body
    kernels, copies, scalar kernels, the notable kinds and the kernel list."""
    comps, entry = parse_hlo(text)
    rows = []
    for loop in find_loops(comps, entry):
        kernels, copies = body_kernels(comps, loop.body)
        inside = [_opcodes_inside(comps, k) for k in kernels]
        row = dict(loop=loop, kernels=kernels, inside=inside, n=len(kernels), copies=copies,
                   scalar=sum(_is_scalar(k.shape) for k in kernels),
                   cond=len(body_kernels(comps, loop.cond)[0]))  # fmt: skip
        for col, ops in _NOTABLE.items():
            row[col] = sum(any(o in ops for o in s) for s in inside)
        rows.append(row)
    return rows


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}  # fmt: skip


def allocated_mib(text: str) -> float:
    """MiB of the buffers that ``AllocateBuffer`` custom-calls create (the TPU compiler's; its
    ``temp_size_in_bytes`` leaves them out: a scan's stored steps can live there)."""
    comps, _ = parse_hlo(text)
    total = 0
    for ins in (i for instrs in comps.values() for i in instrs if i.target == "AllocateBuffer"):
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", ins.shape):
            size = _BYTES.get(dtype, 4)
            for d in filter(None, dims.split(",")):
                size *= int(d)
            total += size
    return total / 2**20


def order_note(rows: list[dict]) -> str | None:
    """A note when a forward loop comes after a backward one (top level: not nested)."""
    roles = [r["loop"].role for r in rows if r["loop"].parent is None]
    if "backward" in roles and "forward" in roles[roles.index("backward") :]:
        return "a forward loop comes after a backward one in schedule order: check the roles"
    return None


# ---------------------------------------------------------------------------------------------
# The programs


@dataclasses.dataclass
class Program:
    name: str
    kind: str  # "fwd" or "vg"
    run: Callable  # run(eps, W, xs, ds) -> batch of final carries
    block: bool = False  # the transformer-block workload

    def make(self, i: int) -> Callable:
        """Program ``i``: the step's constant moved by ``1e-6 * i`` (a distinct program)."""
        eps = 1e-6 * i
        if self.kind == "fwd":
            return lambda W, xs, ds: self.run(eps, W, xs, ds)
        return jax.value_and_grad(lambda W, xs, ds: jnp.sum(self.run(eps, W, xs, ds) ** 2))


def tanh_step(eps: float, W) -> Callable:
    return lambda c: c + (0.1 + eps) * jnp.tanh(c @ W)


def block_step(eps: float, p) -> Callable:
    return lambda x: block(p, x) * (1.0 + eps)


def programs(max_depth: int, batch: int) -> list[Program]:
    M = max_depth

    def scan(remat):
        return lambda e, W, xs, ds: masked_scan(tanh_step(e, W), xs, ds, M, remat)

    def while_(e, W, xs, ds):
        def one(x, d):
            body = lambda s: (s[0] + 1, tanh_step(e, W)(s[1]))  # noqa: E731
            return lax.while_loop(lambda s: s[0] < d, body, (0, x))[1]

        return jax.vmap(one)(xs, ds)

    def batched(slots=None, shared=False):
        def run(e, W, xs, ds):
            depths = ds[0] if shared else ds
            return dd.repeat_batched(tanh_step(e, W), xs, depths, max_depth=M, slots=slots)

        return run

    def vmap_repeat(step_of):
        def run(e, W, xs, ds):
            one = lambda x, d: dd.repeat(step_of(e, W), x, d, max_depth=M)  # noqa: E731
            return jax.vmap(one)(xs, ds)

        return run

    def refill(e, W, xs, ds):
        def one(x, d):
            body = lambda s: (tanh_step(e, W)(s[0]), s[1] + 1)  # noqa: E731
            return dd.while_loop(lambda s: s[1] < d, body, (x, 0), max_steps=M)[0]

        return jax.vmap(one)(xs, ds)

    def block_scan(e, p, xs, ds):
        return masked_scan(block_step(e, p), xs, ds, M, remat=True)

    rows = [
        Program("masked `lax.scan`", "fwd", scan(False)),
        Program("`jax.checkpoint` + masked `lax.scan`", "vg", scan(True)),
        Program("`vmap(lax.while_loop)`", "fwd", while_),
    ]
    for label, kw in ((f"`slots=B` ({batch}, lockstep)", dict(slots=batch)),
                      ("`slots=128` (wrap-around)", dict(slots=128)),
                      ("default slots", {})):  # fmt: skip
        rows += [Program(f"`repeat_batched`, {label}", k, batched(**kw)) for k in ("fwd", "vg")]
    rows += [
        Program("`vmap(repeat)`, default", "vg", vmap_repeat(tanh_step)),
        Program("`vmap(dyndepth.while_loop)` (continuous refill)", "fwd", refill),
        Program("`vmap(dyndepth.while_loop)` (continuous refill)", "vg", refill),
        Program("one depth for the batch (lockstep)", "fwd", batched(shared=True)),
        Program("one depth for the batch (lockstep)", "vg", batched(shared=True)),
        Program("block: `jax.checkpoint` + masked `lax.scan`", "vg", block_scan, block=True),
        Program("block: `vmap(repeat)`, default", "vg", vmap_repeat(block_step), block=True),
    ]
    return rows


def tpu_sharding(topology: str):
    """A one-device sharding on the first device of a TPU topology (deviceless: libtpu)."""
    from jax.experimental import topologies  # noqa: PLC0415 (only the TPU mode needs it)

    topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def arg_specs(prog: Program, sharding, batch: int, width: int, block_batch: int):
    """Abstract arguments (shapes only: nothing runs, the depths' values do not matter)."""
    spec = lambda shape, dtype=jnp.float32: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    if prog.block:
        p = {k: spec(s) for k, s in block_shapes(64).items()}
        return p, spec((block_batch, SEQ, 64)), spec((block_batch,), jnp.int32)
    return spec((width, width)), spec((batch, width)), spec((batch,), jnp.int32)


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def measure(prog: Program, args, repeats: int) -> tuple[list, list, list]:
    """Compile ``prog``: its summary row, its loops' rows and its kernel listing."""
    lower_s, compile_s, compiled = compile_times(prog.make, args, repeats)
    text = compiled.as_text()
    rows = loop_rows(text)
    name = f"{prog.name}, {prog.kind}"
    by_role = {r: [x for x in rows if x["loop"].role == r] for r in ("forward", "backward")}
    cells = []
    for key in ("n", "copies"):
        cells += [_span([x[key] for x in by_role[r]]) for r in ("forward", "backward")]
    loops = f"{len(by_role['forward'])} / {len(by_role['backward'])}"
    summary = [name, loops, *cells, f"{lower_s:.2f}", f"{compile_s:.2f}",
               f"{temp_mib(compiled):.1f}", f"{allocated_mib(text):.1f}"]  # fmt: skip
    detail, listing = [], []
    for x in rows:
        lp = x["loop"]
        nesting = f"in loop {lp.parent}" if lp.parent is not None else "top"
        detail.append([name, lp.index, lp.role, nesting, x["n"], x["scalar"], x["copies"],
                       *(x[c] for c in _NOTABLE), x["cond"], lp.op_name or "-"])  # fmt: skip
        for k, inside in zip(x["kernels"], x["inside"], strict=True):
            notable = ",".join(c for c, ops in _NOTABLE.items() if any(o in ops for o in inside))
            listing.append(f"{name} | loop {lp.index} ({lp.role}) | {k.opcode} {k.name} "
                           f"{k.shape[:60]} [{notable}] | {k.op_name}")  # fmt: skip
    note = order_note(rows)
    if note:
        print(f"note ({name}): {note}")
    print(f"  compiled {name}: {compile_s:.2f} s", file=sys.stderr, flush=True)
    return summary, detail, listing


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", choices=("tpu", "cpu"), default="tpu",
                   help="tpu: libtpu, deviceless (default); cpu: this machine")  # fmt: skip
    p.add_argument("--topology", default="v5e:2x2", help="TPU topology (default v5e:2x2)")
    p.add_argument("--repeats", type=int, default=3, help="distinct programs per median")
    p.add_argument("--quick", action="store_true", help="one compile per program, no block")
    p.add_argument("--kernels", action="store_true", help="list every body's kernels")
    p.add_argument("--only", default="", help="programs whose name contains this text")
    a = p.parse_args()
    batch, width, max_depth, block_batch = 256, 256, 100, 64
    repeats = 1 if a.quick else a.repeats
    if a.platform == "tpu":
        try:
            sharding = tpu_sharding(a.topology)
        except Exception as e:  # noqa: BLE001 - libtpu absent or the topology unknown
            sys.exit(f"error: --platform tpu needs libtpu (see benchmarks/README.md): {e}")
        where = f"TPU {a.topology}, one device, deviceless (libtpu)"
    else:
        sharding, where = None, f"this machine's CPU ({jax.devices()[0].device_kind})"
    print(f"jax {jax.__version__}, dyndepth at {source_revision()}; compiled for {where}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; lower / compile: median of {repeats} distinct "
          f"programs{' after a discarded one' if repeats > 1 else ''}\n")  # fmt: skip
    summary, detail, listing = [], [], []
    t_start = time.perf_counter()
    for prog in programs(max_depth, batch):
        if (a.quick and prog.block) or a.only not in prog.name:
            continue
        args = arg_specs(prog, sharding, batch, width, block_batch)
        row, loops, kernels = measure(prog, args, repeats)
        summary.append(row)
        detail += loops
        listing += kernels
    print(
        "### Per program: kernels per loop-body iteration (range over the loops of a role), "
        "lower and compile time, temp memory\n"
    )
    print(table(["program", "loops fwd / bwd", "kernels fwd", "kernels bwd", "copies fwd",
                 "copies bwd", "lower s", "compile s", "temp MiB", "AllocateBuffer MiB"],
                summary))  # fmt: skip
    print("\n### Per loop (schedule order; role from the name stack, see the docstring)\n")
    print(table(["program", "loop", "role", "nesting", "kernels", "scalar", "copies",
                 *_NOTABLE, "cond", "op_name"], detail))  # fmt: skip
    if a.kernels:
        print("\n### Kernels of every loop body\n")
        print("\n".join(listing))
    print(f"\n(whole run: {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
