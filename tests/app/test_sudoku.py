"""`dyndepth demo --task sudoku`: the generator (unique solutions, maximal removal paths), the
difficulty measure, the symmetries, the model's pieces against plain-Python references, the
three halting loops against each other, and a `--quick` run end to end (JSON keys, resuming,
one-line errors)."""

import json
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dyndepth_app import cli as _cli
from dyndepth_app import sudoku as S
from dyndepth_app import sudoku_data as sd
from dyndepth_app import sudoku_model as sm
from dyndepth_app import sudoku_train as st


@pytest.fixture(scope="module")
def paths():
    rng = random.Random("test-paths")
    return [sd.removal_path(rng) for _ in range(3)]


def test_removal_path_keeps_the_solution_unique_and_ends_minimal(paths):
    for solution, path in paths:
        assert sd.is_valid_solution([0] * 81, solution)
        assert len(set(path)) == len(path) and 50 <= len(path) <= 64
        end = 81 - len(path)
        for givens in (81, 60, 40, end + 3, end):
            puzzle = sd.puzzle_from_path(solution, path, givens)
            assert sum(1 for v in puzzle if v) == givens
            found, _ = sd.solve(puzzle, limit=2)
            assert found == [solution]
        # the path's end is minimal: emptying any given left opens a second solution
        puzzle = sd.puzzle_from_path(solution, path, end)
        for cell in [i for i in range(81) if puzzle[i]][:6]:
            fewer = list(puzzle)
            fewer[cell] = 0
            assert sd.count_solutions(fewer) == 2
    with pytest.raises(ValueError, match="givens must be in"):
        sd.puzzle_from_path(*paths[0], 81 - len(paths[0][1]) - 1)


def test_generator_is_seeded():
    a = sd.make_paths("seed-a", 2)
    b = sd.make_paths("seed-a", 2)
    c = sd.make_paths("seed-b", 2)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    puzzles = sd.puzzles_at(*a, np.array([81, 30]))
    assert (puzzles[0] == a[0][0]).all() and (puzzles[1] > 0).sum() >= 30


def test_difficulty_is_monotone_along_a_path(paths):
    """More givens never need more rounds of singles; puzzles that singles solve need no search;
    one empty cell takes one round."""
    for solution, path in paths:
        end = 81 - len(path)
        previous = (0, 0)
        buckets = []
        for givens in range(80, end - 1, -1):
            rounds, nodes = sd.difficulty(sd.puzzle_from_path(solution, path, givens))
            if givens == 80:
                assert (rounds, nodes) == (1, 0)
            if previous[1]:  # stuck before (more givens): stuck now
                assert nodes > 0
            elif not nodes:
                assert rounds >= previous[0]
            previous = (rounds, nodes)
            buckets.append(sd.bucket_of(rounds, nodes))
        order = {b: i for i, b in enumerate(sd.BUCKETS)}
        assert [order[b] for b in buckets] == sorted(order[b] for b in buckets)
    assert sd.bucket_of(4, 0) == "easy" and sd.bucket_of(5, 0) == "medium"
    assert sd.bucket_of(3, 7) == "hard"


def test_singles_round_places_only_right_digits(paths):
    solution, path = paths[1]
    grid = sd.puzzle_from_path(solution, path, 81 - len(path))
    while 0 in grid:
        place = sd.singles_round(grid)
        if not place:
            break
        for cell, digit in place.items():
            assert grid[cell] == 0 and solution[cell] == digit
            grid[cell] = digit


def test_symmetries_keep_validity_uniqueness_and_difficulty(paths):
    solution, path = paths[0]
    puzzle = sd.puzzle_from_path(solution, path, 30)
    want = sd.difficulty(puzzle)
    rng = np.random.default_rng(0)
    for i in range(4):
        cells, digits = sd.symmetry(rng)
        jcells, jdigits = (np.asarray(a) for a in st.symmetry(jax.random.PRNGKey(i)))
        for c, d in ((cells, digits), (jcells, jdigits)):
            assert (
                sorted(c) == list(range(81)) and d[0] == 0 and sorted(d[1:]) == list(range(1, 10))
            )
            new_sol = d[np.asarray(solution)[c]]
            new_puz = d[np.asarray(puzzle)[c]]
            assert sd.is_valid_solution(new_puz.tolist(), new_sol.tolist())
            assert sd.solve(new_puz.tolist(), limit=2)[0] == [new_sol.tolist()]
            assert sd.difficulty(new_puz.tolist())[0] == want[0]


def test_draw_gives_puzzles_of_their_solutions_in_the_givens_range():
    sols, ranks = sd.make_paths("draw", 3)
    pool = st.device_pool(sols, ranks)
    puz, sol = (np.asarray(a) for a in st.draw(pool, jax.random.PRNGKey(0), 32, 30, 40))
    givens = (puz > 0).sum(axis=1)
    assert givens.min() >= 30 and givens.max() <= 40 and len(set(givens.tolist())) > 3
    for p, s in zip(puz, sol, strict=True):
        assert sd.is_valid_solution(p.tolist(), s.tolist())


def test_units_and_rules_match_plain_python():
    h = jax.random.normal(jax.random.PRNGKey(0), (2, 81, 9, 3))
    u = np.asarray(sm.units(h))
    hn = np.asarray(h)
    for cell in (0, 40, 80):
        r, c, b = sd.ROW[cell], sd.COL[cell], sd.BOX[cell]
        ref = [
            hn[:, cell],
            hn[:, [i for i in range(81) if sd.ROW[i] == r]].mean(1),
            hn[:, [i for i in range(81) if sd.COL[i] == c]].mean(1),
            hn[:, [i for i in range(81) if sd.BOX[i] == b]].mean(1),
            np.broadcast_to(hn[:, cell].mean(1, keepdims=True), hn[:, cell].shape),
        ]
        np.testing.assert_allclose(u[:, cell], np.concatenate(ref, axis=-1), rtol=1e-5, atol=1e-6)
    solution = sd.random_grid(random.Random(1))
    swapped = list(solution)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    broken = list(solution)
    broken[5] = broken[5] % 9 + 1
    grids = jnp.asarray([solution, swapped, broken])
    assert np.asarray(sm.obeys_rules(grids)).tolist() == [True, False, False]
    # swapping two cells of a row breaks their two columns and (here) nothing else: 2 extra
    # digits; a changed digit repeats in its row, column and box: 3
    assert np.asarray(sm.conflicts(grids)).tolist() == [0, 2, 3]
    assert [sd.is_valid_solution([0] * 81, g) for g in (solution, swapped, broken)] == [
        True,
        False,
        False,
    ]


@pytest.mark.slow  # about 40 s of compiling on the shared 2-core machine
def test_library_and_unrolled_outer_steps_agree():
    cfg = S.replace(S.SudokuConfig(), **S.QUICK)
    params = sm.init_params(jax.random.PRNGKey(0), cfg.width, cfg.layers, cfg.hidden)
    puz = jax.random.randint(jax.random.PRNGKey(1), (3, 81), 0, 10)
    state = sm.init_state(params, puz)

    def loss(params, library):
        s = sm.outer_step(params, state, puz, cycles=2, latent_steps=1, library=library)
        return jnp.sum(sm.readout(params, s, puz)[0] ** 2)

    a, ga = jax.value_and_grad(loss)(params, False)
    b, gb = jax.value_and_grad(loss)(params, True)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_stalled_rule_replay():
    conflicts = np.array([[5, 9, 4], [4, 9, 4], [4, 9, 0], [4, 8, 6], [3, 8, 6]])
    stop = S.stalled(conflicts, 2)
    # puzzle 0 improves at steps 1, 2, 5; puzzle 1 stalls at steps 2-3 then improves; puzzle 2
    # obeys the rules at step 3 (then breaks them again: its low stays 0)
    assert stop.T.tolist() == [
        [False, False, False, True, False],
        [False, False, True, False, False],
        [False, False, True, False, True],
    ]


@pytest.mark.parametrize("rule", ["valid", "head", "stalled"])
def test_halting_loops_agree_with_the_replayed_rule(rule):
    """dyndepth.while_loop under vmap, vmap(lax.while_loop) and the rule replayed on the fixed
    run's trajectory stop every puzzle at the same step with the same answer."""
    cfg = S.replace(S.SudokuConfig(), **{**S.QUICK, "max_steps": 6})
    params = sm.init_params(jax.random.PRNGKey(2), cfg.width, cfg.layers, cfg.hidden)
    params["halt"] = 3.0 * jax.random.normal(jax.random.PRNGKey(3), (cfg.width,))
    sols, ranks = sd.make_paths("halt", 2)
    # full grids are valid at once, grids with 30 givens never are (an untrained model)
    puz = np.concatenate([sd.puzzles_at(sols, ranks, np.array([g, g])) for g in (81, 80, 30)])
    sol = np.concatenate([sols] * 3)
    solved, valid, head, conflicts = S.trajectory(params, cfg, puz, sol)
    stop = {"valid": valid, "head": head, "stalled": S.stalled(conflicts, cfg.stall_steps)}[rule]
    want = np.where(stop.any(0), stop.argmax(0) + 1, cfg.max_steps)
    if rule == "valid":
        assert want[:2].tolist() == [1, 1] and want[-2:].tolist() == [6, 6]
    puz = jnp.asarray(puz, jnp.int32)
    ans_d, steps_d, executed = S.halting_dyndepth(params, cfg, rule, puz)  # 3 slots, 6 puzzles
    # the loop's work: every slot busy but in the tail, at most one slot-length wasted each
    assert want.sum() <= int(executed) <= want.sum() + 3 * cfg.max_steps
    ans_l, steps_l = S.halting_lax(params, cfg, rule, puz)
    np.testing.assert_array_equal(np.asarray(steps_d), want)
    np.testing.assert_array_equal(np.asarray(steps_l), want)
    np.testing.assert_array_equal(np.asarray(ans_d), np.asarray(ans_l))
    last = want == cfg.max_steps
    fixed = np.asarray(S.fixed_steps(params, cfg, puz))
    np.testing.assert_array_equal(fixed[last], np.asarray(ans_d)[last])


def test_flags_of_the_other_task_are_one_line_errors(capsys):
    assert _cli.main(["demo", "--task", "sudoku", "--control"]) == 2
    assert _cli.main(["demo", "--json", "x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "dyndepth demo: error: --control applies to --task prefix-sums only",
        "dyndepth demo: error: --json applies to --task sudoku only",
    ]


def test_quick_run_end_to_end(tmp_path, capsys):
    out, js = tmp_path / "run", tmp_path / "r.json"
    argv = ["demo", "--task", "sudoku", "--quick", "--out", str(out), "--json", str(js)]
    assert _cli.main(argv) == 0
    res = json.loads(js.read_text())
    assert list(res["accuracy_by_difficulty"]) == ["easy", "medium", "hard"]
    assert list(res["steps_by_difficulty"]) == ["easy", "medium", "hard"]
    a = res["adaptive"]
    for k in ("accuracy", "fixed_accuracy", "executed_over_useful", "seconds", "fixed_seconds"):
        assert isinstance(a[k], float), k
    assert a["same_as_lax"]
    assert a["executed_over_useful"] >= 1.0
    assert len(res["puzzles"]["steps"]) == 3 * S.QUICK["test_per_bucket"]
    assert json.loads((out / "results.json").read_text())["config"] == res["config"]
    first = capsys.readouterr().out
    assert "| easy (solved by singles in <= 4 rounds) |" in first
    # Again in the same folder: the puzzles come from the cache, the training is complete
    cfg = S.replace(S.SudokuConfig(), **S.QUICK)
    lines = []
    S.datasets(cfg, str(out), lines.append)
    _, figures = st.train(
        cfg,
        None,
        str(out),
        config_from_json=S.config_from_json,
        training_fields=S.training_fields,
        log=lines.append,
    )
    assert "puzzles read from" in lines[0] and "resuming from" in lines[1]
    assert figures["steps_run"] == 0 and figures["step"] == cfg.steps
    # Another configuration in the same folder: one line naming the setting, before any work
    assert _cli.main(argv + ["--width", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "width 4 (checkpoint) vs 8 (now)" in err[0]


@pytest.mark.slow  # compiles the larger model: about a minute on the shared 2-core machine
def test_gpu_preset_at_small_scale(tmp_path):
    """The ``--preset gpu`` model (its width, latent steps and givens range) trains and
    evaluates end to end on the CPU, with a tiny batch, data set and step count."""
    args = _cli._parser().parse_args(["demo", "--task", "sudoku", "--preset", "gpu"])
    cfg = S.config_from_args(args)
    assert (cfg.width, cfg.latent_steps, cfg.max_givens, cfg.batch) == (32, 2, 40, 256)
    small = S.replace(cfg, batch=4, steps=2, train_paths=4, test_per_bucket=2, max_steps=3)
    res = S.run_sudoku(small, str(tmp_path), log=lambda *a: None)
    assert res["training"]["step"] == 2 and res["config"]["width"] == 32
    assert res["adaptive"]["same_as_lax"]
