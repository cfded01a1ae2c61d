"""Sudoku puzzles for ``dyndepth demo --task sudoku``: a seeded generator with unique
solutions, a reference solver, a difficulty measure, and the symmetries used to augment the
training set. Plain Python and numpy, nothing downloaded.

A grid is 81 integers in row-major order, 0 for an empty cell and 1-9 for a digit.

**Generation** (:func:`removal_path`): a random full grid (depth-first fill with shuffled
digits), then its cells in random order, each emptied if the puzzle keeps a unique solution
(:func:`has_other_solution`: is there a solution with another digit in that cell?) and kept
otherwise. The cells emptied, in order, make a *removal path*: emptying the first ``81 - k`` of
them gives a puzzle with ``k`` givens and a unique solution, for every ``k`` from 81 down to the
path's end (about 22-26 givens). One path therefore gives puzzles of every difficulty.

**Difficulty** (:func:`difficulty`): rounds of single-candidate propagation. A round places
every naked single (a cell with one candidate left) and every hidden single (a digit with one
place left in a row, column or box) at once; puzzles on which the rounds get stuck need search,
and the reference solver's search nodes are counted. Buckets (:data:`BUCKETS`): ``easy``,
singles solve it in at most 4 rounds; ``medium``, singles solve it in 5 rounds or more;
``hard``, singles get stuck (search needed).
"""

from __future__ import annotations

import random

import numpy as np

ALL = 0x1FF  # digits 1-9 as bits 0-8
ROW = [i // 9 for i in range(81)]
COL = [i % 9 for i in range(81)]
BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
UNITS = (
    [[r * 9 + c for c in range(9)] for r in range(9)]
    + [[r * 9 + c for r in range(9)] for c in range(9)]
    + [[i for i in range(81) if BOX[i] == b] for b in range(9)]
)
POP = [bin(m).count("1") for m in range(512)]
LOW = {1 << d: d + 1 for d in range(9)}  # single-bit mask -> digit

BUCKETS = ("easy", "medium", "hard")
BUCKET_RULES = {
    "easy": "solved by singles in <= 4 rounds",
    "medium": "solved by singles in >= 5 rounds",
    "hard": "singles get stuck: needs search",
}


def _masks(grid):
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    for i, v in enumerate(grid):
        if v:
            b = 1 << (v - 1)
            if rows[ROW[i]] & b or cols[COL[i]] & b or boxes[BOX[i]] & b:
                return None  # two equal digits in a unit
            rows[ROW[i]] |= b
            cols[COL[i]] |= b
            boxes[BOX[i]] |= b
    return rows, cols, boxes


def _search(grid, rows, cols, boxes, limit, found, nodes, rng=None):
    """Depth-first search with naked singles and the fewest-candidates cell first. Appends
    solutions to ``found`` until it holds ``limit``; ``nodes[0]`` counts the branch points."""
    placed = []
    ok = True
    while True:
        best, best_n, best_m, single = -1, 10, 0, False
        for i in range(81):
            if grid[i]:
                continue
            m = ALL & ~(rows[ROW[i]] | cols[COL[i]] | boxes[BOX[i]])
            n = POP[m]
            if n == 0:
                ok = False
                break
            if n == 1:
                b = m
                grid[i] = LOW[b]
                rows[ROW[i]] |= b
                cols[COL[i]] |= b
                boxes[BOX[i]] |= b
                placed.append(i)
                single = True
            elif n < best_n:
                best, best_n, best_m = i, n, m
        if not ok or not single:
            break
    if ok:
        if best < 0:
            found.append(list(grid))
        else:
            nodes[0] += 1
            digits = [d for d in range(9) if best_m >> d & 1]
            if rng is not None:
                rng.shuffle(digits)
            i = best
            for d in digits:
                b = 1 << d
                grid[i] = d + 1
                rows[ROW[i]] |= b
                cols[COL[i]] |= b
                boxes[BOX[i]] |= b
                _search(grid, rows, cols, boxes, limit, found, nodes, rng)
                rows[ROW[i]] &= ~b
                cols[COL[i]] &= ~b
                boxes[BOX[i]] &= ~b
                grid[i] = 0
                if len(found) >= limit:
                    break
    for i in placed:
        b = 1 << (grid[i] - 1)
        rows[ROW[i]] &= ~b
        cols[COL[i]] &= ~b
        boxes[BOX[i]] &= ~b
        grid[i] = 0


def solve(puzzle, limit=1):
    """``(solutions, search nodes)``: up to ``limit`` solutions of ``puzzle`` (lists of 81
    digits) found by the reference solver, and the branch points it visited."""
    grid = list(puzzle)
    masks = _masks(grid)
    if masks is None:
        return [], 0
    found, nodes = [], [0]
    _search(grid, *masks, limit, found, nodes)
    return found, nodes[0]


def count_solutions(puzzle, limit=2):
    """The number of solutions of ``puzzle``, counted up to ``limit``."""
    return len(solve(puzzle, limit)[0])


def has_other_solution(puzzle, cell, digit):
    """Whether ``puzzle`` (with ``cell`` empty) has a solution with something other than
    ``digit`` in ``cell``: a search from each other candidate of the cell."""
    grid = list(puzzle)
    masks = _masks(grid)
    if masks is None:
        return False
    rows, cols, boxes = masks
    free = ALL & ~(rows[ROW[cell]] | cols[COL[cell]] | boxes[BOX[cell]]) & ~(1 << (digit - 1))
    for d in range(9):
        if free >> d & 1:
            b = 1 << d
            grid[cell] = d + 1
            rows[ROW[cell]] |= b
            cols[COL[cell]] |= b
            boxes[BOX[cell]] |= b
            found = []
            _search(grid, rows, cols, boxes, 1, found, [0])
            rows[ROW[cell]] &= ~b
            cols[COL[cell]] &= ~b
            boxes[BOX[cell]] &= ~b
            if found:
                return True
    return False


def random_grid(rng):
    """A random full grid (``rng``: a ``random.Random``)."""
    grid = [0] * 81
    found = []
    _search(grid, [0] * 9, [0] * 9, [0] * 9, 1, found, [0], rng)
    return found[0]


def removal_path(rng):
    """``(solution, path)``: a random full grid and the cells emptied from it in order, each
    keeping the solution unique (see the module's docstring)."""
    solution = random_grid(rng)
    puzzle = list(solution)
    order = list(range(81))
    rng.shuffle(order)
    path = []
    for cell in order:
        digit = puzzle[cell]
        puzzle[cell] = 0
        if has_other_solution(puzzle, cell, digit):
            puzzle[cell] = digit
        else:
            path.append(cell)
    return solution, path


def puzzle_from_path(solution, path, givens):
    """The puzzle with ``givens`` givens on a removal path (``givens >= 81 - len(path)``)."""
    if not 81 - len(path) <= givens <= 81:
        raise ValueError(f"givens must be in [{81 - len(path)}, 81] on this path, got {givens}")
    puzzle = list(solution)
    for cell in path[: 81 - givens]:
        puzzle[cell] = 0
    return puzzle


def singles_round(grid):
    """One round of single-candidate propagation: ``{cell: digit}`` of every naked and hidden
    single of ``grid``, found from the same state; ``None`` on a contradiction."""
    masks = _masks(grid)
    if masks is None:
        return None
    rows, cols, boxes = masks
    cand = [0] * 81
    for i in range(81):
        if not grid[i]:
            cand[i] = ALL & ~(rows[ROW[i]] | cols[COL[i]] | boxes[BOX[i]])
            if not cand[i]:
                return None
    place = {}
    for i in range(81):
        if cand[i] and POP[cand[i]] == 1:
            place[i] = LOW[cand[i]]
    for unit in UNITS:
        for d in range(9):
            b = 1 << d
            where = [i for i in unit if cand[i] & b]
            if len(where) == 1:
                place.setdefault(where[0], d + 1)
    return place


def difficulty(puzzle):
    """``(rounds, search_nodes)``: the rounds of single-candidate propagation that solve
    ``puzzle``, or, when they get stuck, the rounds run before and the reference solver's search
    nodes on the puzzle (``0`` when singles solve it)."""
    grid = list(puzzle)
    rounds = 0
    while 0 in grid:
        place = singles_round(grid)
        if not place:
            return rounds, max(1, solve(puzzle)[1])
        for i, v in place.items():
            grid[i] = v
        rounds += 1
    return rounds, 0


def bucket_of(rounds, nodes):
    """The difficulty bucket (:data:`BUCKETS`) of a puzzle with this :func:`difficulty`."""
    if nodes:
        return "hard"
    return "easy" if rounds <= 4 else "medium"


def is_valid_solution(puzzle, grid):
    """Whether ``grid`` is full, obeys the rules and agrees with the givens of ``puzzle``."""
    grid = list(grid)
    if 0 in grid or any(p and p != g for p, g in zip(puzzle, grid, strict=True)):
        return False
    return all(len({grid[i] for i in unit}) == 9 for unit in UNITS)


# ----------------------------------------------------------------------------- data sets


def make_paths(seed, count, progress=None):
    """``count`` removal paths drawn with ``random.Random(seed)``: ``(solutions (count, 81)
    int8, ranks (count, 81) int8)``, where ``ranks[p, cell]`` is the cell's position on path
    ``p`` (81 for cells never emptied), so the puzzle with ``k`` givens keeps the cells of rank
    ``>= 81 - k``."""
    rng = random.Random(seed)
    solutions = np.zeros((count, 81), np.int8)
    ranks = np.full((count, 81), 81, np.int8)
    for p in range(count):
        solution, path = removal_path(rng)
        solutions[p] = solution
        ranks[p, path] = np.arange(len(path))
        if progress is not None:
            progress(1)
    return solutions, ranks


def puzzles_at(solutions, ranks, givens):
    """The puzzles with ``givens[p]`` givens on each path: (P, 81) int8 (clipped to the path)."""
    floor = 81 - np.sum(ranks < 81, axis=1)
    g = np.maximum(np.asarray(givens), floor)
    return np.where(ranks >= 81 - g[:, None], solutions, 0).astype(np.int8)


# ----------------------------------------------------------------------------- symmetries


def symmetry(rng):
    """A random validity-preserving transformation: ``(cells (81,), digits (10,))`` with
    ``new[i] = digits[old[cells[i]]]``: bands, rows within bands, stacks, columns within stacks,
    a transpose and a relabelling of the digits (0 stays 0). It keeps a unique solution unique
    and the :func:`difficulty` unchanged."""
    band, stack = rng.permutation(3), rng.permutation(3)
    rows = np.concatenate([3 * b + rng.permutation(3) for b in band])
    cols = np.concatenate([3 * s + rng.permutation(3) for s in stack])
    cells = (rows[:, None] * 9 + cols[None, :]).reshape(81)
    if rng.random() < 0.5:
        cells = cells.reshape(9, 9).T.reshape(81)
    digits = np.concatenate([[0], 1 + rng.permutation(9)])
    return cells, digits
