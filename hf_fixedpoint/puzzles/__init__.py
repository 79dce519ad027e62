"""Puzzle datasets (Sudoku, Maze, A5, ARC-AGI) in the TRM/HRM token format, and their evaluation.

Not imported by ``import hf_fixedpoint``: it needs numpy and datasets (``pip install hf-fixedpoint[puzzles]``).

    >>> from hf_fixedpoint.puzzles import build_dataset
    >>> ds, meta = build_dataset("a5", "train", num_samples=8, length=32)
"""

from . import a5, sudoku  # noqa: F401  (register their tasks)
from .common import IGNORE_LABEL_ID, TASKS, PuzzleMetadata, build_dataset, dihedral, inverse_dihedral

__all__ = ["IGNORE_LABEL_ID", "TASKS", "PuzzleMetadata", "build_dataset", "dihedral", "inverse_dihedral"]
