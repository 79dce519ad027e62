"""Sudoku: generated puzzles are unique (checked by an independent exact-cover solver), augmentations are
validity-preserving bijections, the CSV loader reads the official format and rejects malformed files."""

import random

import numpy as np
import pytest

from hf_fixedpoint.puzzles import build_dataset
from hf_fixedpoint.puzzles.sudoku import SudokuTransform, generate, invalid_solutions, load_sudoku_csv, solve


def exact_cover_count(grid, limit=2):
    """Independent solution counter: Knuth's Algorithm X on dict-of-sets (not the bit-mask search under test)."""
    rows = {(i, d): [("cell", i), ("row", i // 9, d), ("col", i % 9, d), ("box", (i // 27) * 3 + i % 9 // 3, d)]
            for i in range(81) for d in range(1, 10)}
    cols = {}
    for r, cs in rows.items():
        for c in cs:
            cols.setdefault(c, set()).add(r)

    def select(r):
        removed = []
        for c in rows[r]:
            for other in cols[c]:
                for c2 in rows[other]:
                    if c2 != c:
                        cols[c2].discard(other)
            removed.append(cols.pop(c))
        return removed

    def deselect(r, removed):
        for c in reversed(rows[r]):
            cols[c] = removed.pop()
            for other in cols[c]:
                for c2 in rows[other]:
                    if c2 != c:
                        cols[c2].add(other)

    for i, d in enumerate(grid):
        if d:
            if ("cell", i) not in cols or (i, d) not in cols[("cell", i)]:
                return 0, None
            select((i, d))
    found, first = 0, []

    def search(chosen):
        nonlocal found
        if not cols:
            found += 1
            if not first:
                first.extend(chosen)
            return found >= limit
        c = min(cols, key=lambda k: len(cols[k]))
        for r in sorted(cols[c]):
            removed = select(r)
            stop = search(chosen + [r])
            deselect(r, removed)
            if stop:
                return True
        return False

    search([])
    solution = list(grid)
    for i, d in first:
        solution[i] = d
    return found, solution if found else None


def test_generated_puzzles_have_unique_solutions_and_are_minimal():
    rng = random.Random(1)
    for k in range(6):
        puzzle, solution, difficulty = generate(rng)
        count, independent = exact_cover_count(puzzle)
        assert count == 1 and independent == solution
        assert not invalid_solutions(np.array([solution]))[0]
        assert all(p in (0, s) for p, s in zip(puzzle, solution))
        assert solve(puzzle) == (1, solution, difficulty)
        if k < 2:  # minimal: every clue is needed
            for i in np.flatnonzero(puzzle):
                weaker = list(puzzle)
                weaker[i] = 0
                assert exact_cover_count(weaker)[0] == 2


def test_difficulty_ranks_a_famous_hard_puzzle_above_generated_ones():
    easter_monster = "1.......2.9.4...5...6...7...5.9.3.......7.......85..4.7.....6...3...9.8...2.....1"
    grid = [0 if ch == "." else int(ch) for ch in easter_monster]
    count, solution, backtracks = solve(grid)
    assert (count, solution) == exact_cover_count(grid)
    rng = random.Random(0)
    generated = [generate(rng)[2] for _ in range(10)]
    assert count == 1 and backtracks > max(generated)


def test_solve_counts_and_rejects():
    assert solve([0] * 81)[0] == 2
    clash = [0] * 81
    clash[0] = clash[1] = 5
    assert solve(clash) == (0, None, 0)
    with pytest.raises(ValueError, match="81 digits"):
        solve([0] * 80)


def test_min_difficulty_and_difficulty_column():
    ds, meta = build_dataset("sudoku", "test", num_puzzles=5, min_difficulty=30)
    assert meta.seq_len == 81 and meta.vocab_size == 11 and meta.grid_shape == (9, 9)
    for row in ds:
        puzzle = np.array(row["inputs"]) - 1
        count, solution, backtracks = solve(puzzle)
        assert count == 1 and backtracks == row["difficulty"] >= 30
        assert list(np.array(solution) + 1) == row["labels"]


def test_transforms_are_bijections_with_inverses():
    rng = np.random.default_rng(0)
    puzzle, solution, _ = generate(random.Random(3))
    grids = np.array([puzzle, solution])
    for _ in range(20):
        t = SudokuTransform.random(rng)
        assert sorted(t.cell_map) == list(range(81)) and sorted(t.digit_map) == list(range(10))
        assert t.digit_map[0] == 0
        assert np.array_equal(t.inverse().apply(t.apply(grids)), grids)
        assert np.array_equal(t.apply(t.inverse().apply(grids)), grids)
        new_puzzle, new_solution = t.apply(grids)
        assert not invalid_solutions(new_solution[None])[0]
        assert exact_cover_count(list(new_puzzle)) == (1, list(new_solution))


def test_augmented_rows_share_group_and_stay_solutions():
    ds, meta = build_dataset("sudoku", "train", num_puzzles=3, num_aug=2)
    assert len(ds) == 9 and meta.num_groups == 3
    assert ds["group"] == [0, 0, 0, 1, 1, 1, 2, 2, 2] and ds["aug_id"] == [0, 1, 2] * 3
    inputs, labels = np.array(ds["inputs"]) - 1, np.array(ds["labels"]) - 1
    assert not invalid_solutions(labels).any()
    assert (((inputs == 0) | (inputs == labels)).all())
    assert len({row.tobytes() for row in inputs}) == 9  # copies really differ
    assert len(set(np.sort(inputs > 0, axis=1).sum(1))) == 3  # clue counts are invariant within a group


def test_generation_is_reproducible_and_split_dependent():
    a, _ = build_dataset("sudoku", "train", num_puzzles=4, seed=7)
    b, _ = build_dataset("sudoku", "train", num_puzzles=4, seed=7)
    c, _ = build_dataset("sudoku", "train", num_puzzles=4, seed=8)
    d, _ = build_dataset("sudoku", "test", num_puzzles=4, seed=7)
    e, _ = build_dataset("sudoku", "train", num_puzzles=2, seed=7)
    assert a["inputs"] == b["inputs"] and a["inputs"] != c["inputs"] and a["inputs"] != d["inputs"]
    assert e["inputs"] == a["inputs"][:2]  # puzzle k depends only on (seed, split, k)


def _write_csv(path, rows, header="source,q,a,rating"):
    path.write_text(header + "\n" + "\n".join(",".join(r) for r in rows) + "\n")
    return path


def _official_rows(n=3):
    out = []
    for k in range(n):
        p, s, d = generate(random.Random(10 + k))
        out.append(("gen", "".join(str(v) if v else "." for v in p), "".join(map(str, s)), str(d)))
    return out


def test_csv_loader_reads_official_format(tmp_path):
    rows = _official_rows()
    path = _write_csv(tmp_path / "train.csv", rows)
    puzzles, solutions, ratings = load_sudoku_csv(path)
    assert puzzles.shape == (3, 81) and list(ratings) == [int(r[3]) for r in rows]
    ds, meta = build_dataset("sudoku", "train", csv_path=str(path))
    assert ["".join("." if v == 1 else str(v - 1) for v in row) for row in ds["inputs"]] == [r[1] for r in rows]
    assert ["".join(str(v - 1) for v in row) for row in ds["labels"]] == [r[2] for r in rows]
    sub, _ = build_dataset("sudoku", "train", csv_path=str(path), subsample=2, seed=3)
    sub2, _ = build_dataset("sudoku", "train", csv_path=str(path), subsample=2, seed=3)
    assert len(sub) == 2 and sub["inputs"] == sub2["inputs"]
    # header aliases, and a 4-column header with unknown names read positionally as source,q,a,rating
    for header in ("id,question,answer,difficulty", "c0,c1,c2,c3"):
        other = load_sudoku_csv(_write_csv(tmp_path / "alias.csv", rows, header=header))
        assert all(np.array_equal(x, y) for x, y in zip(other, (puzzles, solutions, ratings)))
    # without the answer column the loader solves the puzzles itself
    q_only = _write_csv(tmp_path / "q.csv", [(r[0], r[1]) for r in rows], header="source,q")
    assert np.array_equal(load_sudoku_csv(q_only)[1], solutions)


def test_csv_min_difficulty_filters_by_rating_and_num_puzzles_is_rejected(tmp_path):
    rows = [(f"s{k}", q, a, str(rating)) for k, ((_, q, a, _), rating) in enumerate(zip(_official_rows(4),
                                                                                        (0, 7, 3, 12)))]
    path = str(_write_csv(tmp_path / "train.csv", rows))
    ds, _ = build_dataset("sudoku", "train", csv_path=path, min_difficulty=3)
    assert ds["difficulty"] == [7, 3, 12]  # rows with rating >= 3, in file order
    assert ["".join("." if v == 1 else str(v - 1) for v in row) for row in ds["inputs"]] == [rows[k][1]
                                                                                          for k in (1, 2, 3)]
    # subsample draws from the rows the rating filter kept, like --min-difficulty with --subsample-size
    sub, _ = build_dataset("sudoku", "train", csv_path=path, min_difficulty=7, subsample=2, seed=1)
    assert sorted(sub["difficulty"]) == [7, 12]
    with pytest.raises(ValueError, match=r"min_difficulty=13 keeps no row .* \(highest rating 12\)"):
        build_dataset("sudoku", "train", csv_path=path, min_difficulty=13)
    with pytest.raises(ValueError, match=r"num_puzzles=2 only applies to generated Sudoku; with csv_path use "
                                         r"subsample"):
        build_dataset("sudoku", "train", csv_path=path, num_puzzles=2)
    q_only = str(_write_csv(tmp_path / "q.csv", [(r[0], r[1]) for r in rows], header="source,q"))
    with pytest.raises(ValueError, match="min_difficulty=1 needs a `rating` column"):
        build_dataset("sudoku", "train", csv_path=q_only, min_difficulty=1)
    assert len(build_dataset("sudoku", "train", csv_path=q_only)[0]) == 4
    with pytest.raises(ValueError, match="subsample=2 only applies to csv_path data"):
        build_dataset("sudoku", "train", num_puzzles=3, subsample=2)


@pytest.mark.parametrize("mutate,message", [
    (lambda r: (r[0], r[1][:80], r[2], r[3]), "has 80 characters"),
    (lambda r: (r[0], "x" + r[1][1:], r[2], r[3]), "unknown character 'x'"),
    (lambda r: (r[0], r[1], r[2][:-1] + "0", r[3]), "unknown character '0'"),
    (lambda r: (r[0], r[1], r[2][1] + r[2][0] + r[2][2:], r[3]), "not a valid Sudoku solution"),
    (lambda r: (r[0], r[1], r[2], "hard"), "rating"),
    (lambda r: (r[0], r[1], r[2]), "has 3 fields"),
])
def test_csv_loader_rejects_malformed_rows(tmp_path, mutate, message):
    rows = _official_rows(2)
    rows[1] = mutate(rows[1])
    with pytest.raises(ValueError, match=message) as err:
        load_sudoku_csv(_write_csv(tmp_path / "bad.csv", rows))
    assert "line 3" in str(err.value) or message == "rating"


def test_csv_loader_rejects_inconsistent_and_unsolvable(tmp_path):
    source, q, a, rating = _official_rows(1)[0]
    k = next(i for i, ch in enumerate(q) if ch != ".")
    wrong = q[:k] + str(int(q[k]) % 9 + 1) + q[k + 1:]
    with pytest.raises(ValueError, match="contradicts a given digit"):
        load_sudoku_csv(_write_csv(tmp_path / "c.csv", [(source, wrong, a, rating)]))
    with pytest.raises(ValueError, match="unsolvable"):
        load_sudoku_csv(_write_csv(tmp_path / "u.csv", [("x", "55" + "." * 79)], header="source,q"))
    with pytest.raises(ValueError, match="more than one solution"):
        load_sudoku_csv(_write_csv(tmp_path / "m.csv", [("x", "." * 81)], header="source,q"))
    with pytest.raises(ValueError, match="has no column \\['q'\\]"):
        load_sudoku_csv(_write_csv(tmp_path / "h.csv", [("x", "." * 81)], header="source,board"))
    with pytest.raises(ValueError, match="empty file"):
        (tmp_path / "e.csv").write_text("")
        load_sudoku_csv(tmp_path / "e.csv")
    with pytest.raises(ValueError, match="no puzzles"):
        (tmp_path / "n.csv").write_text("source,q,a,rating\n")
        load_sudoku_csv(tmp_path / "n.csv")


def test_num_blanks_gives_exact_blank_counts_and_unique_solutions():
    for blanks in (1, 30, 50):
        puzzle, solution, difficulty = generate(random.Random(blanks), num_blanks=blanks)
        assert puzzle.count(0) == blanks
        assert exact_cover_count(puzzle) == (1, solution)  # unique, checked independently
        assert all(p in (0, s) for p, s in zip(puzzle, solution))
        assert solve(puzzle) == (1, solution, difficulty)


def test_num_blanks_dataset_is_deterministic_and_validated():
    a, meta = build_dataset("sudoku", "train", seed=3, num_puzzles=4, num_blanks=25)
    b, _ = build_dataset("sudoku", "train", seed=3, num_puzzles=4, num_blanks=25)
    c, _ = build_dataset("sudoku", "train", seed=4, num_puzzles=4, num_blanks=25)
    inputs = np.array(a["inputs"])
    assert (inputs == 1).sum(axis=1).tolist() == [25] * 4  # token 1 = blank
    assert a["inputs"] == b["inputs"] and a["labels"] == b["labels"] and a["inputs"] != c["inputs"]
    for row in inputs - 1:
        assert exact_cover_count(list(row))[0] == 1
    for bad in (0, 65, 2.5, True):
        with pytest.raises(ValueError, match="num_blanks"):
            build_dataset("sudoku", "train", num_puzzles=1, num_blanks=bad)
    with pytest.raises(ValueError, match="num_blanks"):
        generate(random.Random(0), num_blanks=-1)
    with pytest.raises(ValueError, match="num_blanks.*csv_path"):
        build_dataset("sudoku", "train", csv_path="unused.csv", num_blanks=10)
