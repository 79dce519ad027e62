"""Sudoku: a loader for the Sudoku-Extreme CSV format, a generator of hard unique puzzles, symmetry augmentations.

Tokens (as in the research code): PAD 0, blank 1, digit ``d`` -> ``d + 1`` (vocab 11, ``seq_len`` 81, row-major
9x9 grid). Every label position is supervised. Grids are handled here as ``[..., 81]`` digit arrays (0 = blank).

Difficulty of a puzzle = the number of dead ends (backtracks) of :func:`solve`'s deterministic depth-first search
(most-constrained cell first, digits ascending) while it finds the solution and proves it unique. Like the tdoku
backtrack count that rates Sudoku-Extreme, it is 0 for puzzles that fall to naked singles.
"""

from __future__ import annotations

import multiprocessing
import random
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from ..core.fp_registry import check_number
from .common import PuzzleMetadata, read_puzzle_csv, register_task, split_rng

_ROW = [i // 9 for i in range(81)]
_COL = [i % 9 for i in range(81)]
_BOX = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]
_ALL = 0b1111111110  # bits 1..9
_POPCOUNT = [bin(m).count("1") for m in range(1 << 10)]
_BITS = [[1 << d for d in range(1, 10) if m >> d & 1] for m in range(1 << 10)]  # set bits of a candidate mask


class _Search:
    """Bit-mask depth-first search with the most-constrained-cell heuristic; counts solutions up to a limit."""

    def __init__(self, grid, rng: Optional[random.Random] = None, forbid: Optional[Tuple[int, int]] = None,
                 prefer: Optional[List[int]] = None):
        self.grid = list(grid)
        self.rows, self.cols, self.boxes = [0] * 9, [0] * 9, [0] * 9
        self.consistent = True
        for i, v in enumerate(self.grid):
            if v:
                bit = 1 << v
                if (self.rows[_ROW[i]] | self.cols[_COL[i]] | self.boxes[_BOX[i]]) & bit:
                    self.consistent = False
                self.rows[_ROW[i]] |= bit
                self.cols[_COL[i]] |= bit
                self.boxes[_BOX[i]] |= bit
        self.empties = [i for i, v in enumerate(self.grid) if not v]
        self.rng, self.prefer = rng, prefer
        self.forbid_cell, self.forbid_bit = (forbid[0], 1 << forbid[1]) if forbid else (-1, 0)
        self.count = self.backtracks = 0
        self.solution = None

    def run(self, limit: int) -> "_Search":
        self.limit = limit
        if self.consistent:
            self._dfs(0)
        return self

    def _dfs(self, depth: int) -> bool:
        grid, rows, cols, boxes, empties = self.grid, self.rows, self.cols, self.boxes, self.empties
        if depth == len(empties):
            self.count += 1
            if self.solution is None:
                self.solution = list(grid)
            return self.count >= self.limit
        row_of, col_of, box_of, popcount, forbid = _ROW, _COL, _BOX, _POPCOUNT, self.forbid_cell  # local lookups
        best_j, best_n, best_m = -1, 10, 0
        for j in range(depth, len(empties)):
            i = empties[j]
            m = _ALL & ~(rows[row_of[i]] | cols[col_of[i]] | boxes[box_of[i]])
            if i == forbid:
                m &= ~self.forbid_bit
            n = popcount[m]
            if n < best_n:
                best_j, best_n, best_m = j, n, m
                if n <= 1:
                    break
        if best_n == 0:
            self.backtracks += 1
            return False
        empties[depth], empties[best_j] = empties[best_j], empties[depth]
        i = empties[depth]
        r, c, b = _ROW[i], _COL[i], _BOX[i]
        bits = _BITS[best_m]
        if self.rng is not None:
            bits = list(bits)
            self.rng.shuffle(bits)
        elif self.prefer is not None and best_m >> self.prefer[i] & 1:  # try the preferred digit first
            first = 1 << self.prefer[i]
            bits = [first] + [bit for bit in bits if bit != first]
        for bit in bits:
            grid[i] = bit.bit_length() - 1
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            stop = self._dfs(depth + 1)
            rows[r] ^= bit
            cols[c] ^= bit
            boxes[b] ^= bit
            grid[i] = 0
            if stop:
                return True
        return False


def solve(grid, limit: int = 2) -> Tuple[int, Optional[List[int]], int]:
    """Solve an 81-digit grid (0 = blank): returns ``(number of solutions up to limit, first solution, backtracks)``.

    ``limit=2`` proves uniqueness; the backtrack count with ``limit=2`` is the puzzle's difficulty.
    """
    grid = [int(v) for v in np.asarray(grid).reshape(-1)]
    if len(grid) != 81 or not all(0 <= v <= 9 for v in grid):
        raise ValueError("solve expects 81 digits in 0..9 (0 = blank).")
    s = _Search(grid).run(limit)
    return s.count, s.solution, s.backtracks


MAX_BLANKS = 64  # 17 clues: the fewest any unique Sudoku has


def generate(rng: random.Random, min_difficulty: int = 0, max_tries: int = 10000, num_blanks: Optional[int] = None):
    """One unique puzzle with difficulty >= ``min_difficulty``: minimal, or with exactly ``num_blanks`` blank cells.

    A random full grid (randomised search on the empty grid), then clues removed in random order while the
    solution stays unique: removing cell ``i`` (digit ``v``) keeps uniqueness iff no solution has ``grid[i] != v``,
    one satisfiability search instead of a count. That search tries the known solution's digits first: another
    solution, where there is one, usually differs from it in a few cells only. Without ``num_blanks`` every cell is
    tried (a minimal puzzle, typically 55-60 blanks); with it, removal stops at ``num_blanks`` blanks (1 ..
    ``MAX_BLANKS``; fewer blanks = easier), and a grid whose removals stop short of it is replaced by a new one.
    Returns ``(puzzle, solution, difficulty)`` as lists of 81 ints.
    """
    if num_blanks is not None:
        check_number(num_blanks, "num_blanks", low=1, high=MAX_BLANKS, integer=True)
    for _ in range(max_tries):
        solution = _Search([0] * 81, rng=rng).run(1).solution
        puzzle, blanks = list(solution), 0
        order = list(range(81))
        rng.shuffle(order)
        for i in order:
            if blanks == num_blanks:
                break
            v, puzzle[i] = puzzle[i], 0
            if _Search(puzzle, forbid=(i, v), prefer=solution).run(1).count:
                puzzle[i] = v
            else:
                blanks += 1
        if num_blanks is not None and blanks < num_blanks:
            continue
        difficulty = _Search(puzzle).run(2).backtracks
        if difficulty >= min_difficulty:
            return puzzle, solution, difficulty
    wanted = f"difficulty >= {min_difficulty}" + ("" if num_blanks is None else f" and {num_blanks} blanks")
    raise RuntimeError(f"no puzzle with {wanted} in {max_tries} tries; lower min_difficulty or num_blanks.")


def _generate_seeded(seed: int, min_difficulty: int, num_blanks: Optional[int] = None):
    return generate(random.Random(seed), min_difficulty, num_blanks=num_blanks)


def _unit_indices() -> np.ndarray:
    """``[27, 9]`` cell indices of the 9 rows, 9 columns and 9 boxes."""
    idx = np.arange(81).reshape(9, 9)
    boxes = idx.reshape(3, 3, 3, 3).transpose(0, 2, 1, 3).reshape(9, 9)
    return np.concatenate([idx, idx.T, boxes])


UNITS = _unit_indices()


def invalid_solutions(solutions: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """Boolean ``[N]``: True where an ``[N, 81]`` grid is not a complete valid Sudoku (vectorised, in chunks)."""
    solutions = np.asarray(solutions)
    out = np.empty(len(solutions), dtype=bool)
    for lo in range(0, len(solutions), chunk):
        one_hot = solutions[lo:lo + chunk, UNITS][..., None] == np.arange(1, 10)  # [n, 27, 9, 9]
        out[lo:lo + chunk] = ~(one_hot.sum(axis=2) == 1).all(axis=(1, 2))
    return out


@dataclass(frozen=True)
class SudokuTransform:
    """A validity-preserving Sudoku symmetry: ``out[k] = digit_map[in[cell_map[k]]]``.

    Built from a digit permutation (0 stays blank), an optional transpose, a permutation of the bands and of the
    rows inside each band, and of the stacks and of the columns inside each stack.
    """

    digit_map: Tuple[int, ...]
    cell_map: Tuple[int, ...]

    @classmethod
    def random(cls, rng: np.random.Generator) -> "SudokuTransform":
        digits = (0, *(int(d) + 1 for d in rng.permutation(9)))
        idx = np.arange(81).reshape(9, 9)
        if rng.random() < 0.5:
            idx = idx.T
        rows = np.concatenate([3 * b + rng.permutation(3) for b in rng.permutation(3)])
        cols = np.concatenate([3 * s + rng.permutation(3) for s in rng.permutation(3)])
        return cls(digits, tuple(int(i) for i in idx[rows][:, cols].reshape(-1)))

    def apply(self, grids) -> np.ndarray:
        grids = np.asarray(grids)
        return np.asarray(self.digit_map)[grids[..., list(self.cell_map)]]

    def inverse(self) -> "SudokuTransform":
        digits, cells = [0] * 10, [0] * 81
        for d, e in enumerate(self.digit_map):
            digits[e] = d
        for k, i in enumerate(self.cell_map):
            cells[i] = k
        return SudokuTransform(tuple(digits), tuple(cells))


def _csv_error(path, line: int, message: str):
    return ValueError(f"{path}, line {line}: {message}")


def load_sudoku_csv(path, *, check_unique: bool = False):
    """Read a Sudoku-Extreme CSV (``source,q,a,rating``, see :func:`read_puzzle_csv`; ``.`` or ``0`` = blank).

    The ``a`` (solution) column is optional: without it every puzzle is solved here (unsolvable or ambiguous
    puzzles are errors). With it, each answer must be a valid grid that agrees with the givens. ``check_unique``
    also proves each puzzle has exactly one solution (slow for millions of rows). Returns ``(puzzles, solutions,
    ratings)`` as int arrays ``[N, 81]``, ``[N, 81]``, ``[N]`` (rating -1 when the column is missing).
    """
    columns = read_puzzle_csv(path, required=("q",))
    qs, ans = columns["q"], columns.get("a")
    ratings = columns.get("rating", ["-1"] * len(qs))
    puzzles = _parse_grids(path, qs, ".0123456789", "q")
    if ans is not None:
        solutions = _parse_grids(path, ans, "123456789", "a")
        bad = np.flatnonzero(invalid_solutions(solutions))
        if len(bad):
            raise _csv_error(path, bad[0] + 2, "answer `a` is not a valid Sudoku solution (a row, column or box "
                                               "repeats a digit).")
        clash = np.flatnonzero(((puzzles != 0) & (puzzles != solutions)).any(axis=1))
        if len(clash):
            raise _csv_error(path, clash[0] + 2, "answer `a` contradicts a given digit of `q` (inconsistent row).")
    else:
        solutions = np.zeros_like(puzzles)
    for n in range(len(puzzles)) if (check_unique or ans is None) else ():
        count, sol, _ = solve(puzzles[n], limit=2)
        if count == 0:
            raise _csv_error(path, n + 2, "puzzle `q` is unsolvable.")
        if count > 1:
            raise _csv_error(path, n + 2, "puzzle `q` has more than one solution.")
        solutions[n] = sol
    try:
        rating = np.array([float(r) for r in ratings]).astype(np.int64)
    except ValueError as e:
        raise ValueError(f"{path}: column `rating` must hold numbers ({e}).") from None
    return puzzles, solutions, rating


def _parse_grids(path, strings, alphabet: str, column: str) -> np.ndarray:
    for n, s in enumerate(strings):
        if len(s) != 81:
            raise _csv_error(path, n + 2, f"column `{column}` has {len(s)} characters; a Sudoku needs 81.")
    raw = np.frombuffer("".join(strings).encode("latin-1", errors="replace"), dtype=np.uint8).reshape(-1, 81)
    lut = np.full(256, -1, dtype=np.int64)
    for ch in alphabet:
        lut[ord(ch)] = 0 if ch in ".0" else int(ch)
    grids = lut[raw]
    bad = np.argwhere(grids < 0)
    if len(bad):
        n, k = bad[0]
        raise _csv_error(path, n + 2, f"column `{column}` has unknown character {strings[n][k]!r} at position {k}; "
                                      f"allowed: {alphabet!r}.")
    return grids


@register_task("sudoku")
def build_sudoku(split: str, *, seed: int = 0, num_puzzles: Optional[int] = None, min_difficulty: int = 0,
                 num_aug: int = 0, csv_path: Optional[str] = None, subsample: Optional[int] = None,
                 num_proc: int = 1, num_blanks: Optional[int] = None):
    """Generated (default) or CSV-loaded Sudoku.

    Generated: ``num_puzzles`` (default 1000) minimal unique puzzles with difficulty >= ``min_difficulty`` (train
    and test come from independent random streams; puzzle ``k`` depends only on the seed and ``k``, so ``num_proc``
    worker processes give the same data and a larger ``num_puzzles`` extends a smaller one). ``num_blanks``: every
    generated puzzle has exactly that many blank cells (1 .. 64; None: minimal puzzles) -- the difficulty control
    for small models (10 blanks fall to naked singles; minimal puzzles need search).
    ``csv_path``: read the official ``train.csv``/``test.csv`` instead, keeping the rows with ``rating >=
    min_difficulty`` (the research code's ``--min-difficulty``; a file without a ``rating`` column only allows
    ``min_difficulty=0``); ``subsample`` then keeps that many random rows of those (seeded; the research code's
    ``--subsample-size``). ``num_puzzles`` is for generated data only: with ``csv_path`` it is an error (use
    ``subsample``), as is ``subsample`` without ``csv_path``. ``num_aug``: add that many
    random symmetry copies of each puzzle (same ``group``, ``aug_id`` 1..num_aug).
    Columns: ``difficulty`` (backtracks, or the CSV ``rating``), ``group``, ``aug_id``.
    """
    check_number(num_aug, "num_aug", low=0, integer=True)
    check_number(min_difficulty, "min_difficulty", low=0, integer=True)
    check_number(num_proc, "num_proc", low=1, integer=True)
    if num_blanks is not None:
        check_number(num_blanks, "num_blanks", low=1, high=MAX_BLANKS, integer=True)
    rng = split_rng("sudoku", split, seed)
    if csv_path is not None:
        if num_puzzles is not None:
            raise ValueError(f"num_puzzles={num_puzzles!r} only applies to generated Sudoku; with csv_path use "
                             "subsample=N for N random rows (the research code's --subsample-size), or leave "
                             "num_puzzles out for every row.")
        if num_blanks is not None:
            raise ValueError(f"num_blanks={num_blanks!r} only applies to generated Sudoku; drop it with csv_path "
                             "(filter CSV rows by min_difficulty).")
        puzzles, solutions, difficulty = load_sudoku_csv(csv_path)
        if min_difficulty > 0:
            if (difficulty < 0).all():
                raise ValueError(f"min_difficulty={min_difficulty} needs a `rating` column, and {csv_path} has "
                                 "none; drop min_difficulty (or use 0) for this file.")
            keep = np.flatnonzero(difficulty >= min_difficulty)
            if not len(keep):
                raise ValueError(f"min_difficulty={min_difficulty} keeps no row of {csv_path} (highest rating "
                                 f"{int(difficulty.max())}); lower min_difficulty.")
            puzzles, solutions, difficulty = puzzles[keep], solutions[keep], difficulty[keep]
        if subsample is not None:
            check_number(subsample, "subsample", low=1, high=len(puzzles), integer=True)
            keep = np.sort(rng.choice(len(puzzles), size=subsample, replace=False))
            puzzles, solutions, difficulty = puzzles[keep], solutions[keep], difficulty[keep]
    else:
        if subsample is not None:
            raise ValueError(f"subsample={subsample!r} only applies to csv_path data; for generated Sudoku set "
                             "num_puzzles.")
        num_puzzles = 1000 if num_puzzles is None else num_puzzles
        check_number(num_puzzles, "num_puzzles", low=1, integer=True)
        jobs = [(int(s), min_difficulty, num_blanks) for s in rng.integers(2**63, size=num_puzzles)]
        if num_proc > 1:
            with multiprocessing.Pool(num_proc) as pool:
                made = pool.starmap(_generate_seeded, jobs, chunksize=16)
        else:
            made = [_generate_seeded(*job) for job in jobs]
        puzzles = np.array([m[0] for m in made], dtype=np.int64)
        solutions = np.array([m[1] for m in made], dtype=np.int64)
        difficulty = np.array([m[2] for m in made], dtype=np.int64)
    n = len(puzzles)
    inputs, labels, groups, aug_ids = [puzzles], [solutions], [np.arange(n)], [np.zeros(n, dtype=np.int64)]
    for a in range(1, num_aug + 1):
        transforms = [SudokuTransform.random(rng) for _ in range(n)]
        inputs.append(np.stack([t.apply(p) for t, p in zip(transforms, puzzles)]))
        labels.append(np.stack([t.apply(s) for t, s in zip(transforms, solutions)]))
        groups.append(np.arange(n))
        aug_ids.append(np.full(n, a, dtype=np.int64))
    group = np.concatenate(groups)
    order = np.lexsort((np.concatenate(aug_ids), group))  # rows of one group stay together
    columns = {
        "inputs": (np.concatenate(inputs) + 1)[order].astype(np.int32),
        "labels": (np.concatenate(labels) + 1)[order].astype(np.int32),
        "puzzle_identifiers": np.zeros(len(order), dtype=np.int64),
        "difficulty": np.tile(difficulty, num_aug + 1)[order],
        "group": group[order],
        "aug_id": np.concatenate(aug_ids)[order],
    }
    names = ("<pad>", ".", *"123456789")
    meta = PuzzleMetadata(task="sudoku", vocab_size=11, seq_len=81, grid_shape=(9, 9), num_groups=n,
                          difficulty="difficulty", token_names=names)
    return columns, meta
