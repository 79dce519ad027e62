"""Export to / import from the HRM/TRM on-disk layout: file structure and lossless round trips."""

import json

import numpy as np
import pytest

from hf_fixedpoint.puzzles import build_dataset, export_research_format, load_research_format


def test_sudoku_layout_matches_the_research_builder(tmp_path):
    ds, meta = build_dataset("sudoku", "train", num_puzzles=3, num_aug=2)
    folder = export_research_format(ds, meta, tmp_path)
    info = json.loads((tmp_path / "train" / "dataset.json").read_text())
    assert info["ignore_label_id"] == 0 and info["total_groups"] == 3 and info["mean_puzzle_examples"] == 1
    assert info["vocab_size"] == 11 and info["seq_len"] == 81 and info["sets"] == ["all"]
    load = lambda name: np.load(f"{folder}/all__{name}.npy")
    assert list(load("puzzle_indices")) == list(range(10))  # one example per puzzle
    assert list(load("group_indices")) == [0, 3, 6, 9]  # original + 2 augmentations per group
    assert np.array_equal(load("inputs"), np.array(ds["inputs"]))
    assert json.loads((tmp_path / "identifiers.json").read_text()) == ["<blank>"]
    back, back_meta = load_research_format(tmp_path, "train", task="sudoku", grid_shape=(9, 9))
    for col in ("inputs", "labels", "puzzle_identifiers", "group", "aug_id"):
        assert back[col] == ds[col], col
    assert (back_meta.vocab_size, back_meta.seq_len, back_meta.grid_shape) == (11, 81, (9, 9))


def test_arc_and_padded_a5_round_trip(tmp_path):
    ds, meta = build_dataset("arc1", "train", max_tasks=2, num_aug=2)
    export_research_format(ds, meta, tmp_path / "arc")
    indices = np.load(tmp_path / "arc" / "train" / "all__puzzle_indices.npy")
    ids = np.load(tmp_path / "arc" / "train" / "all__puzzle_identifiers.npy")
    assert len(ids) == len(set(ids)) == 2 * 2 * 3  # (training + evaluation task) x 3 augmentations
    assert np.array_equal(np.repeat(ids, np.diff(indices)), np.array(ds["puzzle_identifiers"]))
    back, back_meta = load_research_format(tmp_path / "arc", "train")
    assert back["labels"] == ds["labels"] and back["aug_id"] == ds["aug_id"]
    assert back_meta.num_puzzle_identifiers == meta.num_puzzle_identifiers and back_meta.num_groups == 4

    a5, a5_meta = build_dataset("a5", "test", num_samples=3, length=5, pad_to=8)
    export_research_format(a5, a5_meta, tmp_path / "a5")
    assert (np.load(tmp_path / "a5" / "test" / "all__labels.npy")[:, 5:] == 0).all()  # -100 -> PAD on disk
    assert load_research_format(tmp_path / "a5", "test")[0]["labels"] == a5["labels"]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset.json"):
        load_research_format(tmp_path, "train")
    ds, meta = build_dataset("sudoku", "train", num_puzzles=2, num_aug=1)
    shuffled = ds.select([0, 2, 1, 3])  # groups 0, 1, 0, 1: not consecutive
    with pytest.raises(ValueError, match="consecutive"):
        export_research_format(shuffled, meta, tmp_path)
