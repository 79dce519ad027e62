"""Maze: labels are true shortest paths (independent BFS), dihedral copies invert, CSV loader checks."""

from collections import deque

import numpy as np
import pytest

from hf_fixedpoint.puzzles import build_dataset, inverse_dihedral
from hf_fixedpoint.puzzles.maze import load_maze_csv

CHARS = "# SGo"


def bfs_steps(grid, start, goal, passable):
    """Independent BFS over a 2-D token grid; returns the number of steps or None."""
    h, w = grid.shape
    seen = {start: 0}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            return seen[cell]
        r, c = cell
        for nxt in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nxt[0] < h and 0 <= nxt[1] < w and nxt not in seen and grid[nxt] in passable:
                seen[nxt] = seen[cell] + 1
                queue.append(nxt)
    return None


def check_label(x, y):
    start = tuple(np.argwhere(x == 3)[0])
    goal = tuple(np.argwhere(x == 4)[0])
    steps = bfs_steps(x, start, goal, passable={2, 3, 4})
    on_path = bfs_steps(y, start, goal, passable={3, 4, 5})
    assert steps is not None and on_path == steps  # the marked cells contain a shortest path ...
    assert (y == 5).sum() == steps - 1  # ... and nothing else
    assert np.array_equal(np.where(y == 5, 2, y), x) and (x[y == 5] == 2).all()
    return steps


def test_generated_labels_are_shortest_paths():
    ds, meta = build_dataset("maze", "train", num_mazes=6, min_path_length=60)
    assert meta.seq_len == 900 and meta.vocab_size == 6 and meta.grid_shape == (30, 30)
    for row in ds:
        x, y = np.array(row["inputs"]).reshape(30, 30), np.array(row["labels"]).reshape(30, 30)
        assert (x == 3).sum() == 1 and (x == 4).sum() == 1 and set(np.unique(x)) <= {1, 2, 3, 4}
        assert check_label(x, y) == row["difficulty"] >= 60


def test_dihedral_augmentation_inverts():
    ds, meta = build_dataset("maze", "test", num_mazes=2, min_path_length=40, dihedral_aug=True)
    assert len(ds) == 16 and ds["aug_id"] == list(range(8)) * 2 and meta.num_groups == 2
    x = np.array(ds["inputs"]).reshape(2, 8, 30, 30)
    y = np.array(ds["labels"]).reshape(2, 8, 30, 30)
    for g in range(2):
        assert len({x[g, t].tobytes() for t in range(8)}) == 8
        for t in range(8):
            assert np.array_equal(inverse_dihedral(x[g, t], t), x[g, 0])
            assert np.array_equal(inverse_dihedral(y[g, t], t), y[g, 0])
            check_label(x[g, t], y[g, t])


def test_reproducible_and_split_dependent():
    a, _ = build_dataset("maze", "train", num_mazes=2, min_path_length=40, seed=1)
    b, _ = build_dataset("maze", "train", num_mazes=2, min_path_length=40, seed=1)
    c, _ = build_dataset("maze", "test", num_mazes=2, min_path_length=40, seed=1)
    assert a["inputs"] == b["inputs"] and a["inputs"] != c["inputs"]


TINY_Q = "S  #" "## #" "#  #" "#G##"
TINY_A = "Soo#" "##o#" "#oo#" "#G##"


def _csv(path, rows):
    path.write_text("source,q,a,rating\n" + "\n".join(f"x,{q},{a},0" for q, a in rows) + "\n")
    return path


def test_csv_loader_reads_official_format(tmp_path):
    gen, _ = build_dataset("maze", "train", num_mazes=2, min_path_length=40)
    rows = [("".join(CHARS[v - 1] for v in r["inputs"]), "".join(CHARS[v - 1] for v in r["labels"])) for r in gen]
    ds, meta = build_dataset("maze", "test", csv_path=str(_csv(tmp_path / "test.csv", rows)))
    assert ds["inputs"] == gen["inputs"] and ds["labels"] == gen["labels"] and ds["difficulty"] == gen["difficulty"]
    inputs, labels, steps = load_maze_csv(_csv(tmp_path / "tiny.csv", [(TINY_Q, TINY_A)]))
    assert inputs.shape == (1, 16) and list(steps) == [6]
    (tmp_path / "q_only.csv").write_text(f"source,q\nx,{TINY_Q}\n")
    with pytest.raises(ValueError, match="has no column \\['a'\\]"):
        load_maze_csv(tmp_path / "q_only.csv")


@pytest.mark.parametrize("q,a,message", [
    (TINY_Q[:-1], TINY_A, "15 characters"),
    (TINY_Q, TINY_A[:-1] + "x", "unknown characters"),
    (TINY_Q.replace("G", " "), TINY_A, "exactly one S and one G"),
    (TINY_Q, TINY_A.replace("Soo", "S o"), "not a shortest"),
    (TINY_Q, "Soo#" "##o#" "#oo#" "oG##", "differs from `q`"),
    (TINY_Q.replace("## #", "####"), TINY_A.replace("##o#", "####"), "unsolvable"),
    (TINY_Q, "Soo#" "##o#" "#ooo" "#G##", "differs from `q`"),
])
def test_csv_loader_rejects_malformed_rows(tmp_path, q, a, message):
    with pytest.raises(ValueError, match=message) as err:
        load_maze_csv(_csv(tmp_path / "bad.csv", [(TINY_Q, TINY_A), (q, a)]))
    assert "line 3" in str(err.value)


def test_csv_loader_rejects_longer_path(tmp_path):
    q = "S   " "# # " "#   " "#G##"
    a = "Sooo" "# #o" "#ooo" "#G##"  # a path, but 8 steps where 4 suffice
    with pytest.raises(ValueError, match="not a shortest"):
        load_maze_csv(_csv(tmp_path / "long.csv", [(q, a)]))
