"""Registry, metadata, caching, import hygiene and the dihedral group shared by the puzzle tasks."""

import subprocess
import sys

import numpy as np
import pytest

from hf_fixedpoint.puzzles import TASKS, PuzzleMetadata, build_dataset, dihedral, inverse_dihedral


def test_registry_lists_every_task_and_rejects_unknown_ones():
    assert TASKS.names() == ["a5", "arc1", "arc2", "maze", "sudoku"]
    with pytest.raises(ValueError, match="Unknown puzzle task 'sudokku'. Valid puzzle tasks: 'a5', 'arc1'"):
        build_dataset("sudokku", "train")
    with pytest.raises(ValueError, match="split='valid' is not allowed"):
        build_dataset("a5", "valid")
    with pytest.raises(TypeError, match="num_puzzles"):
        build_dataset("a5", "train", num_puzzles=3)
    with pytest.raises(ValueError, match="seed must be an integer"):
        build_dataset("a5", "train", seed="0")


def test_metadata_round_trip_and_validation():
    ds, meta = build_dataset("sudoku", "train", num_puzzles=2)
    d = meta.to_dict()
    assert d["grid_shape"] == [9, 9] and d["build_kwargs"] == {"seed": 0, "num_puzzles": 2}
    assert PuzzleMetadata.from_dict(d) == meta and d["num_examples"] == len(ds) == 2
    with pytest.raises(ValueError, match="unknown keys \\['colour'\\]"):
        PuzzleMetadata.from_dict({**d, "colour": 1})
    with pytest.raises(ValueError, match="grid_shape"):
        PuzzleMetadata(task="x", vocab_size=3, seq_len=10, grid_shape=(3, 3))
    assert ds.features["inputs"].length == 81 and ds.with_format("numpy")[:]["labels"].shape == (2, 81)


def test_cache_dir_reuses_the_built_split(tmp_path):
    first, meta = build_dataset("maze", "test", num_mazes=2, min_path_length=30, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    again, meta2 = build_dataset("maze", "test", num_mazes=2, min_path_length=30, cache_dir=tmp_path)
    assert again.cache_files and again["inputs"] == first["inputs"] and meta2 == meta
    build_dataset("maze", "test", num_mazes=2, min_path_length=31, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 2  # other arguments, other entry
    build_dataset("sudoku", "test", num_puzzles=2, cache_dir=tmp_path)
    parallel, _ = build_dataset("sudoku", "test", num_puzzles=2, num_proc=2, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 3 and parallel.cache_files  # num_proc changes speed, not data


def test_import_hf_fixedpoint_does_not_import_puzzles():
    code = "import sys, hf_fixedpoint; print([m for m in sys.modules if m.startswith('hf_fixedpoint.puzzles')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_dihedral_group():
    grid = np.arange(12).reshape(3, 4)
    images = [dihedral(grid, t) for t in range(8)]
    assert len({(g.shape, g.tobytes()) for g in images}) == 8
    assert np.array_equal(images[1], np.rot90(grid)) and np.array_equal(images[6], grid.T)
    for t in range(8):
        assert np.array_equal(inverse_dihedral(dihedral(grid, t), t), grid)
        assert np.array_equal(dihedral(inverse_dihedral(grid, t), t), grid)
    batch = np.stack([grid, grid + 1])
    assert np.array_equal(dihedral(batch, 7)[1], dihedral(grid + 1, 7))
    with pytest.raises(ValueError, match="dihedral transform id"):
        dihedral(grid, 8)
