"""Maze: a loader for the 30x30 Maze-Hard CSV format and a generator of hard mazes with shortest-path labels.

Characters and tokens (as in the research code): PAD 0, ``#`` wall 1, `` `` open 2, ``S`` start 3, ``G`` goal 4,
``o`` path 5; ``seq_len`` 900 (row-major 30x30). The input shows ``# SG``; the label adds ``o`` on the cells of the
shortest path strictly between S and G. Every label position is supervised.

Generated mazes are perfect mazes (randomised depth-first search on a 14x14 lattice of rooms, drawn on 29x29 cells
and padded with a wall row and column to 30x30), so the shortest path is unique and the label unambiguous.
"Hard" = the path has at least ``min_path_length`` steps (Maze-Hard keeps paths longer than 110).
Like Maze-Hard, this is a stand-in benchmark, not the original data; drop the real CSVs in with ``csv_path``.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from ..core.fp_registry import check_number
from .common import PuzzleMetadata, dihedral, read_puzzle_csv, register_task, split_rng

CHARSET = "# SGo"
WALL, OPEN, START, GOAL, PATH = 1, 2, 3, 4, 5
SIZE = 30


def _carve(rng: np.random.Generator, rooms: int) -> np.ndarray:
    """Perfect maze as a ``(2*rooms+1)^2`` grid of WALL/OPEN values (iterative randomised DFS)."""
    side = 2 * rooms + 1
    grid = np.full((side, side), WALL, dtype=np.int64)
    seen = np.zeros((rooms, rooms), dtype=bool)
    start = (int(rng.integers(rooms)), int(rng.integers(rooms)))
    stack = [start]
    seen[start] = True
    grid[2 * start[0] + 1, 2 * start[1] + 1] = OPEN
    while stack:
        r, c = stack[-1]
        nbrs = [(r + dr, c + dc) for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))
                if 0 <= r + dr < rooms and 0 <= c + dc < rooms and not seen[r + dr, c + dc]]
        if not nbrs:
            stack.pop()
            continue
        nr, nc = nbrs[int(rng.integers(len(nbrs)))]
        seen[nr, nc] = True
        grid[r + nr + 1, c + nc + 1] = OPEN  # the wall between the two rooms
        grid[2 * nr + 1, 2 * nc + 1] = OPEN
        stack.append((nr, nc))
    return grid


def bfs(grid: np.ndarray, start) -> np.ndarray:
    """Step distances from ``start`` over non-wall cells (4-neighbourhood); -1 where unreachable."""
    h, w = grid.shape
    dist = np.full((h, w), -1, dtype=np.int64)
    dist[start] = 0
    queue = deque([tuple(start)])
    while queue:
        r, c = queue.popleft()
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < h and 0 <= nc < w and dist[nr, nc] < 0 and grid[nr, nc] != WALL:
                dist[nr, nc] = dist[r, c] + 1
                queue.append((nr, nc))
    return dist


def shortest_path_label(maze: np.ndarray) -> np.ndarray:
    """Label grid for a token maze with one S and one G: ``o`` on one shortest S->G path (ValueError if none)."""
    start, goal = np.argwhere(maze == START)[0], np.argwhere(maze == GOAL)[0]
    dist = bfs(maze, tuple(start))
    if dist[tuple(goal)] < 0:
        raise ValueError("maze is unsolvable: the goal G cannot be reached from the start S.")
    label = maze.copy()
    r, c = goal
    while dist[r, c] > 1:  # walk back downhill; for a perfect maze this path is the only shortest path
        r, c = next((nr, nc) for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1))
                    if 0 <= nr < maze.shape[0] and 0 <= nc < maze.shape[1] and dist[nr, nc] == dist[r, c] - 1)
        label[r, c] = PATH
    return label


def generate(rng: np.random.Generator, min_path_length: int = 110, max_tries: int = 1000):
    """One ``30x30`` token maze and its label; S random, G random among cells at least ``min_path_length`` away."""
    for _ in range(max_tries):
        grid = np.full((SIZE, SIZE), WALL, dtype=np.int64)
        grid[: 2 * 14 + 1, : 2 * 14 + 1] = _carve(rng, 14)
        rooms = np.argwhere(grid == OPEN)
        start = tuple(rooms[int(rng.integers(len(rooms)))])
        dist = bfs(grid, start)
        far = np.argwhere(dist >= min_path_length)
        if len(far):
            goal = tuple(far[int(rng.integers(len(far)))])
            grid[start], grid[goal] = START, GOAL
            return grid, shortest_path_label(grid), int(dist[goal])
    raise RuntimeError(f"no maze with a path of >= {min_path_length} steps in {max_tries} tries; lower it.")


def load_maze_csv(path):
    """Read a Maze-Hard CSV (``source,q,a,rating``, see :func:`read_puzzle_csv`; ``q``/``a``: 900 chars of ``# SGo``).

    Checks: square grids of one size, known characters, exactly one S and one G, ``a`` equal to ``q`` except
    ``o`` on open cells, and the ``o`` cells forming a shortest S->G path (BFS). Returns ``(inputs, labels,
    path_lengths)``: token arrays ``[N, n*n]`` and ``[N]``.
    """
    columns = read_puzzle_csv(path, required=("q", "a"))
    rows = [(n + 2, q, a) for n, (q, a) in enumerate(zip(columns["q"], columns["a"]))]
    lut = {ch: i + 1 for i, ch in enumerate(CHARSET)}
    inputs, labels, lengths = [], [], []
    side = None
    for line, q, a in rows:
        for name, s in (("q", q), ("a", a)):
            n = int(round(len(s) ** 0.5))
            if n * n != len(s) or (side is not None and n != side):
                want = f"{side * side} ({side}x{side}, like the first row)" if side else "a square number"
                raise ValueError(f"{path}, line {line}: column `{name}` has {len(s)} characters; expected {want}.")
            side = n
            bad = sorted(set(s) - set(CHARSET))
            if bad:
                raise ValueError(f"{path}, line {line}: column `{name}` has unknown characters {bad}; "
                                 f"allowed: {CHARSET!r}.")
        qg = np.array([lut[ch] for ch in q]).reshape(side, side)
        ag = np.array([lut[ch] for ch in a]).reshape(side, side)
        if (qg == START).sum() != 1 or (qg == GOAL).sum() != 1 or (qg == PATH).any():
            raise ValueError(f"{path}, line {line}: `q` needs exactly one S and one G and no `o`.")
        if ((ag != qg) & ~((ag == PATH) & (qg == OPEN))).any():
            raise ValueError(f"{path}, line {line}: answer `a` differs from `q` outside path (`o`) cells on open "
                             f"cells (inconsistent row).")
        dist = bfs(qg, tuple(np.argwhere(qg == START)[0]))
        steps = dist[tuple(np.argwhere(qg == GOAL)[0])]
        if steps < 0:
            raise ValueError(f"{path}, line {line}: maze is unsolvable (G unreachable from S).")
        on_path = np.where((ag == PATH) | (ag == START) | (ag == GOAL), OPEN, WALL)
        path_steps = bfs(on_path, tuple(np.argwhere(qg == START)[0]))[tuple(np.argwhere(qg == GOAL)[0])]
        if path_steps != steps or (ag == PATH).sum() != steps - 1:
            raise ValueError(f"{path}, line {line}: the `o` cells of `a` are not a shortest S->G path "
                             f"({steps} steps).")
        inputs.append(qg.reshape(-1))
        labels.append(ag.reshape(-1))
        lengths.append(int(steps))
    return np.stack(inputs), np.stack(labels), np.array(lengths, dtype=np.int64)


@register_task("maze")
def build_maze(split: str, *, seed: int = 0, num_mazes: int = 1000, min_path_length: int = 110,
               dihedral_aug: bool = False, csv_path: Optional[str] = None):
    """Generated (default) or CSV-loaded 30x30 mazes.

    ``dihedral_aug``: each maze appears 8 times, once per dihedral transform (``aug_id`` = transform id 0..7;
    the research code's ``--aug``). Columns: ``difficulty`` (shortest-path steps), ``group``, ``aug_id``.
    """
    if csv_path is not None:
        inputs, labels, lengths = load_maze_csv(csv_path)
        side = int(round(inputs.shape[1] ** 0.5))
    else:
        check_number(num_mazes, "num_mazes", low=1, integer=True)
        check_number(min_path_length, "min_path_length", low=1, high=14 * 14 * 2, integer=True)
        rng = split_rng("maze", split, seed)
        made = [generate(rng, min_path_length) for _ in range(num_mazes)]
        inputs = np.stack([m[0].reshape(-1) for m in made])
        labels = np.stack([m[1].reshape(-1) for m in made])
        lengths = np.array([m[2] for m in made], dtype=np.int64)
        side = SIZE
    n = len(inputs)
    transforms = range(8) if dihedral_aug else (0,)
    x = inputs.reshape(n, side, side)
    y = labels.reshape(n, side, side)
    columns = {
        "inputs": np.stack([dihedral(x, t) for t in transforms], 1).reshape(-1, side * side).astype(np.int32),
        "labels": np.stack([dihedral(y, t) for t in transforms], 1).reshape(-1, side * side).astype(np.int32),
        "puzzle_identifiers": np.zeros(n * len(transforms), dtype=np.int64),
        "difficulty": np.repeat(lengths, len(transforms)),
        "group": np.repeat(np.arange(n), len(transforms)),
        "aug_id": np.tile(np.array(transforms), n),
    }
    meta = PuzzleMetadata(task="maze", vocab_size=6, seq_len=side * side, grid_shape=(side, side), num_groups=n,
                          difficulty="difficulty", token_names=("<pad>", *CHARSET))
    return columns, meta
