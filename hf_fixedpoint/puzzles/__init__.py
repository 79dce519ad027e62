"""Puzzle datasets (Sudoku, Maze, A5, ARC-AGI) in the TRM/HRM token format, and their evaluation.

Not imported by ``import hf_fixedpoint``: it needs numpy and datasets (``pip install hf-fixedpoint[puzzles]``).

    >>> from hf_fixedpoint.puzzles import build_dataset
    >>> ds, meta = build_dataset("a5", "train", num_samples=8, length=32)
"""

from . import a5, arc, maze, sudoku  # noqa: F401  (register their tasks)
from .common import (
    IGNORE_LABEL_ID,
    TASKS,
    PuzzleMetadata,
    build_dataset,
    dihedral,
    inverse_dihedral,
    load_saved,
    save_split,
)
from .evaluation import (
    arc_pass_at_k,
    arc_submission,
    arc_vote,
    cell_accuracy,
    changed_labels,
    exact_accuracy,
    format_table,
    iterations_vs_difficulty,
    plot_iterations_vs_difficulty,
    scored_rows,
    sequence_correct,
)
from .research_format import export_research_format, load_research_format

__all__ = [
    "IGNORE_LABEL_ID",
    "TASKS",
    "PuzzleMetadata",
    "arc_pass_at_k",
    "arc_submission",
    "arc_vote",
    "build_dataset",
    "cell_accuracy",
    "changed_labels",
    "dihedral",
    "exact_accuracy",
    "export_research_format",
    "format_table",
    "inverse_dihedral",
    "iterations_vs_difficulty",
    "load_research_format",
    "load_saved",
    "plot_iterations_vs_difficulty",
    "save_split",
    "scored_rows",
    "sequence_correct",
]
