"""Exact / per-cell accuracy and the iterations-vs-difficulty table on hand-computed examples."""

import numpy as np
import pytest
import torch

from hf_fixedpoint.puzzles import (
    cell_accuracy,
    changed_labels,
    exact_accuracy,
    format_table,
    iterations_vs_difficulty,
    plot_iterations_vs_difficulty,
    scored_rows,
    sequence_correct,
)

LABELS = np.array([[1, 2, 3, -100], [4, 5, -100, -100], [7, 8, 9, 1]])
PREDS = np.array([[1, 2, 3, 0], [4, 6, 0, 0], [7, 8, 0, 0]])


def test_changed_labels_score_only_the_cells_to_fill_in():
    inputs = np.array([[1, 5, 1, 7], [1, 1, 1, 1]])  # Sudoku-style: 1 = blank, givens equal their labels
    labels = np.array([[3, 5, 4, 7], [2, 3, 4, -100]])
    preds = np.array([[3, 5, 9, 7], [2, 3, 4, 0]])
    changed = changed_labels(inputs, labels)
    assert changed.tolist() == [[3, -100, 4, -100], [2, 3, 4, -100]]
    assert cell_accuracy(preds, changed) == pytest.approx(4 / 5)  # givens, right anyway, are left out
    assert cell_accuracy(preds, labels) == pytest.approx(6 / 7)
    assert changed_labels(torch.tensor(inputs), torch.tensor(labels)).tolist() == changed.tolist()
    with pytest.raises(ValueError, match="inputs shape"):
        changed_labels(inputs[:, :3], labels)


def test_accuracies_ignore_unscored_positions():
    assert list(sequence_correct(PREDS, LABELS)) == [True, False, False]
    assert exact_accuracy(PREDS, LABELS) == pytest.approx(1 / 3)
    assert cell_accuracy(PREDS, LABELS) == pytest.approx(6 / 9)
    assert exact_accuracy(torch.tensor(PREDS), torch.tensor(LABELS)) == pytest.approx(1 / 3)
    assert exact_accuracy(PREDS, np.where(LABELS == -100, 0, LABELS), ignore_label_id=0) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="shape"):
        exact_accuracy(PREDS[:, :3], LABELS)


def test_rows_without_scored_labels_are_not_solved_and_cell_accuracy_has_two_averages():
    labels = np.array([[1, 2, 3, -100], [-100, -100, -100, -100], [4, 5, -100, -100]])
    preds = np.array([[1, 2, 3, 0], [0, 0, 0, 0], [4, 6, 0, 0]])
    assert list(scored_rows(labels)) == [True, False, True]
    assert list(sequence_correct(preds, labels)) == [True, True, False]  # vacuous for the unscored row
    assert exact_accuracy(preds, labels) == 0.5  # 1 of the 2 scored rows; the research code's valid_metrics
    assert np.isnan(exact_accuracy(preds[1:2], labels[1:2]))
    # pooled: 4 right of 5 scored cells; per puzzle (the research code's `accuracy`): mean(3/3, 1/2) over scored rows
    assert cell_accuracy(preds, labels) == 0.8 and cell_accuracy(preds, labels, average="pooled") == 0.8
    assert cell_accuracy(preds, labels, average="per_puzzle") == 0.75
    assert cell_accuracy(torch.tensor(PREDS), torch.tensor(LABELS), average="per_puzzle") == pytest.approx(
        (1 + 1 / 2 + 2 / 4) / 3)
    assert np.isnan(cell_accuracy(preds[1:2], labels[1:2], average="per_puzzle"))
    with pytest.raises(ValueError, match="average='mean' is not allowed. Allowed values: 'pooled', 'per_puzzle'"):
        cell_accuracy(preds, labels, average="mean")


def test_iterations_table_per_value_and_binned():
    rows = iterations_vs_difficulty([2, 4, 6, 10, 11], [32, 32, 64, 128, 128], correct=[1, 1, 0, 1, 0])
    assert [r["difficulty"] for r in rows] == [32, 64, 128]
    assert [r["count"] for r in rows] == [2, 1, 2]
    assert [r["mean_iterations"] for r in rows] == [3.0, 6.0, 10.5]
    assert [r["std_iterations"] for r in rows] == [1.0, 0.0, 0.5]
    assert [r["accuracy"] for r in rows] == [1.0, 0.0, 0.5]
    binned = iterations_vs_difficulty(np.arange(40), np.arange(40), num_bins=4)
    assert [r["difficulty"] for r in binned] == ["0-9", "10-19", "20-29", "30-39"]
    assert [r["mean_iterations"] for r in binned] == [4.5, 14.5, 24.5, 34.5]
    assert len(iterations_vs_difficulty(np.ones(100), np.arange(100))) == 10  # many values -> 10 bins
    table = format_table(rows)
    assert table.splitlines()[0].startswith("| difficulty | count | mean_iterations") and "| 128 | 2 | 10.50" in table
    with pytest.raises(ValueError, match="one entry per sample"):
        iterations_vs_difficulty([1, 2], [1])


def test_plot_is_written(tmp_path):
    rows = iterations_vs_difficulty([2, 4, 6], [32, 64, 128], correct=[True, True, False])
    path = plot_iterations_vs_difficulty(rows, tmp_path / "iters.png", title="A5", difficulty_name="length")
    assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
