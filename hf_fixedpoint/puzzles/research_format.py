"""Read and write the on-disk layout of the HRM/TRM data builders, for data exchange with the research code.

A split folder ``<dir>/<split>/`` holds ``dataset.json`` (pad_id, ignore_label_id, blank_identifier_id, vocab_size,
seq_len, num_puzzle_identifiers, total_groups, mean_puzzle_examples, sets) and, per set (``all``),
``all__inputs.npy`` / ``all__labels.npy`` ``[examples, seq_len]``, ``all__puzzle_identifiers.npy`` ``[puzzles]``,
``all__puzzle_indices.npy`` (first example of each puzzle, plus the total) and ``all__group_indices.npy`` (first
puzzle of each group, plus the total). ``<dir>/identifiers.json`` names the puzzle ids. The research files mark
unsupervised labels with ``ignore_label_id`` = 0 (PAD); this package uses -100.

So ``export_research_format`` lets the original training scripts run on data generated here, and
``load_research_format`` brings data built by the original scripts (e.g. the full Sudoku-Extreme) into this package.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Tuple

import numpy as np

from .common import IGNORE_LABEL_ID, PuzzleMetadata, _to_dataset

SET_NAME = "all"


def export_research_format(dataset, metadata: PuzzleMetadata, out_dir, split: Optional[str] = None) -> str:
    """Write one split to ``out_dir/<split>/`` in the research layout; returns that folder.

    A puzzle is a run of consecutive rows with the same ``(group, aug_id, puzzle_identifiers)``; a group is a run
    with the same ``group`` (every row is its own group when the column is missing).
    """
    split = split or metadata.split
    data = dataset.with_format("numpy")[:]
    n = len(dataset)
    group = data["group"] if "group" in data else np.arange(n)
    aug = data["aug_id"] if "aug_id" in data else np.zeros(n, dtype=np.int64)
    ids = data["puzzle_identifiers"]
    key = np.stack([group, aug, ids], axis=1)
    new_puzzle = np.r_[True, (key[1:] != key[:-1]).any(axis=1)]
    starts = np.flatnonzero(new_puzzle)
    group_of_puzzle = group[starts]
    group_starts = np.flatnonzero(np.r_[True, group_of_puzzle[1:] != group_of_puzzle[:-1]])
    if len(np.unique(group_of_puzzle)) != len(group_starts):
        raise ValueError("rows of a group must be consecutive to export them in the research layout.")
    labels = np.where(data["labels"] == metadata.ignore_label_id, metadata.pad_id, data["labels"])
    folder = os.path.join(os.fspath(out_dir), split)
    os.makedirs(folder, exist_ok=True)
    arrays = {"inputs": data["inputs"].astype(np.int32), "labels": labels.astype(np.int32),
              "puzzle_identifiers": ids[starts].astype(np.int32),
              "puzzle_indices": np.r_[starts, n].astype(np.int32),
              "group_indices": np.r_[group_starts, len(starts)].astype(np.int32)}
    for name, arr in arrays.items():
        np.save(os.path.join(folder, f"{SET_NAME}__{name}.npy"), arr)
    info = {"pad_id": metadata.pad_id, "ignore_label_id": metadata.pad_id,
            "blank_identifier_id": metadata.blank_identifier_id, "vocab_size": metadata.vocab_size,
            "seq_len": metadata.seq_len, "num_puzzle_identifiers": metadata.num_puzzle_identifiers,
            "total_groups": len(group_starts), "mean_puzzle_examples": n / len(starts), "total_puzzles": len(starts),
            "sets": [SET_NAME]}
    with open(os.path.join(folder, "dataset.json"), "w") as f:
        json.dump(info, f)
    names = ["<blank>"] + [f"{metadata.task}_{i}" for i in range(1, metadata.num_puzzle_identifiers)]
    with open(os.path.join(os.fspath(out_dir), "identifiers.json"), "w") as f:
        json.dump(names, f)
    return folder


def load_research_format(data_dir, split: str, *, task: str = "research",
                         grid_shape: Optional[Tuple[int, int]] = None):
    """Read ``data_dir/<split>/`` written by the research builders (or :func:`export_research_format`).

    Returns ``(datasets.Dataset, PuzzleMetadata)`` like :func:`~hf_fixedpoint.puzzles.build_dataset`: labels equal to
    the file's ``ignore_label_id`` become -100, each row gets its puzzle's id and ``group`` / ``aug_id`` (position
    of the puzzle inside its group) columns. ``grid_shape`` is recorded in the metadata (e.g. ``(9, 9)``).
    """
    folder = os.path.join(os.fspath(data_dir), split)
    path = os.path.join(folder, "dataset.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: expected a research-format split folder with dataset.json.")
    with open(path) as f:
        info = json.load(f)
    sets = info.get("sets", [SET_NAME])
    parts = {name: np.concatenate([np.load(os.path.join(folder, f"{s}__{name}.npy")) for s in sets])
             for name in ("inputs", "labels")}
    rows_id, rows_group, rows_aug = [], [], []
    offset_examples = offset_groups = 0
    for s in sets:
        puzzle_indices = np.load(os.path.join(folder, f"{s}__puzzle_indices.npy"))
        group_indices = np.load(os.path.join(folder, f"{s}__group_indices.npy"))
        ids = np.load(os.path.join(folder, f"{s}__puzzle_identifiers.npy"))
        examples_per_puzzle = np.diff(puzzle_indices)
        puzzle_group = np.repeat(np.arange(len(group_indices) - 1), np.diff(group_indices))
        puzzle_aug = np.arange(len(ids)) - group_indices[:-1][puzzle_group]
        rows_id.append(np.repeat(ids, examples_per_puzzle))
        rows_group.append(np.repeat(puzzle_group + offset_groups, examples_per_puzzle))
        rows_aug.append(np.repeat(puzzle_aug, examples_per_puzzle))
        offset_examples += int(puzzle_indices[-1])
        offset_groups += len(group_indices) - 1
    if offset_examples != len(parts["inputs"]):
        raise ValueError(f"{folder}: puzzle_indices cover {offset_examples} examples, inputs has "
                         f"{len(parts['inputs'])}.")
    ignore = info["ignore_label_id"]
    labels = parts["labels"].astype(np.int64)
    if ignore is not None:
        labels = np.where(labels == ignore, IGNORE_LABEL_ID, labels)
    columns = {"inputs": parts["inputs"].astype(np.int32), "labels": labels.astype(np.int32),
               "puzzle_identifiers": np.concatenate(rows_id).astype(np.int64),
               "group": np.concatenate(rows_group), "aug_id": np.concatenate(rows_aug)}
    meta = PuzzleMetadata(task=task, vocab_size=info["vocab_size"], seq_len=info["seq_len"],
                          num_puzzle_identifiers=info["num_puzzle_identifiers"], pad_id=info["pad_id"],
                          blank_identifier_id=info["blank_identifier_id"], grid_shape=grid_shape, split=split,
                          num_examples=offset_examples, num_groups=offset_groups,
                          build_kwargs={"data_dir": os.fspath(data_dir)})
    return _to_dataset(columns), meta
