"""Puzzle metrics: exact / per-cell accuracy, ARC pass@k with augmentation voting, iterations vs difficulty.

Inputs may be numpy arrays, lists or torch tensors (anything ``np.asarray`` accepts after ``.cpu()``).
Predictions are token ids (argmax of the logits), labels the dataset's ``labels`` (-100 = not scored).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..core.fp_registry import check_number
from .arc import invert_grid, sequence_to_grid
from .common import IGNORE_LABEL_ID


def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
    return np.asarray(x)


def _pairs(predictions, labels, ignore_label_id):
    predictions, labels = _np(predictions), _np(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions shape {predictions.shape} != labels shape {labels.shape}.")
    return predictions, labels, labels != ignore_label_id


def sequence_correct(predictions, labels, ignore_label_id: int = IGNORE_LABEL_ID) -> np.ndarray:
    """Boolean ``[N]``: every scored position of the row is right (vacuously True for a row with none scored:
    combine with :func:`scored_rows`, as :func:`exact_accuracy` does)."""
    predictions, labels, mask = _pairs(predictions, labels, ignore_label_id)
    return ((predictions == labels) | ~mask).all(axis=-1)


def scored_rows(labels, ignore_label_id: int = IGNORE_LABEL_ID) -> np.ndarray:
    """Boolean ``[N]``: the row has at least one scored label (the research code's ``loss_counts > 0``)."""
    return (_np(labels) != ignore_label_id).any(axis=-1)


def exact_accuracy(predictions, labels, ignore_label_id: int = IGNORE_LABEL_ID) -> float:
    """Fraction of rows solved exactly, among the rows with at least one scored label.

    Rows whose labels are all ``ignore_label_id`` are left out (not counted as solved), as in the research code's
    ``ACTLossHead`` (``valid_metrics = halted & (loss_counts > 0)``). NaN when no row is scored.
    """
    correct = sequence_correct(predictions, labels, ignore_label_id)
    scored = scored_rows(labels, ignore_label_id)
    return float(correct[scored].mean()) if scored.any() else float("nan")


CELL_AVERAGES = ("pooled", "per_puzzle")


def cell_accuracy(predictions, labels, ignore_label_id: int = IGNORE_LABEL_ID, average: str = "pooled") -> float:
    """Fraction of scored positions predicted right.

    ``average="pooled"``: over all scored positions of all rows together (rows with more scored positions weigh
    more). ``average="per_puzzle"``: each row's fraction, then the mean over the rows with at least one scored
    position; this is the ``accuracy`` the TRM/HRM/URM research code logs (``ACTLossHead``). The two differ
    when rows have different numbers of scored positions (ARC grids, padded A5 words); for Sudoku and Maze,
    where every row is scored on every position, they are equal. NaN when no position is scored.
    """
    if average not in CELL_AVERAGES:
        raise ValueError(f"average={average!r} is not allowed. Allowed values: {', '.join(map(repr, CELL_AVERAGES))}.")
    predictions, labels, mask = _pairs(predictions, labels, ignore_label_id)
    if not mask.any():
        return float("nan")
    right = (predictions == labels) & mask
    if average == "pooled":
        return float(right.sum() / mask.sum())
    counts, hits = mask.sum(axis=-1), right.sum(axis=-1)
    scored = counts > 0
    return float((hits[scored] / counts[scored]).mean())


def changed_labels(inputs, labels, ignore_label_id: int = IGNORE_LABEL_ID) -> np.ndarray:
    """``labels`` with every position whose label equals the input set to ``ignore_label_id``: only the cells the
    model has to change stay scored (Sudoku: the blank cells; the givens are copied). Pass the result to
    :func:`cell_accuracy` / :func:`exact_accuracy` in place of ``labels``."""
    inputs, labels = _np(inputs), _np(labels)
    if inputs.shape != labels.shape:
        raise ValueError(f"inputs shape {inputs.shape} != labels shape {labels.shape}.")
    return np.where(inputs == labels, ignore_label_id, labels)


def _key(grid: np.ndarray):
    return grid.shape, grid.astype(np.int8).tobytes()


def arc_vote(dataset, predictions, scores=None) -> Dict[tuple, dict]:
    """Vote over the augmented copies of each ARC test input.

    ``dataset``: the ``test`` split of ``arc1``/``arc2`` (or a dict of its columns); ``predictions``: ``[N, 900]``
    token ids in the same row order; ``scores``: optional ``[N]`` confidences (e.g. ``sigmoid(q_halt)``) that
    break ties. Each prediction is cropped (:func:`~hf_fixedpoint.puzzles.arc.sequence_to_grid`), mapped back
    by the row's inverse augmentation, and identical answers pool their votes. Returns
    ``{(task_id, example): {"candidates": [grid, ...] best first, "votes": [...], "answer": grid}}``, ranked by
    (number of votes, mean score), the research code's rule.
    """
    predictions = _np(predictions)
    scores = np.zeros(len(predictions)) if scores is None else _np(scores).astype(np.float64)
    if len(predictions) != len(dataset["labels"]) or len(scores) != len(predictions):
        raise ValueError(f"{len(predictions)} predictions / {len(scores)} scores for {len(dataset['labels'])} rows.")
    pools = defaultdict(dict)
    answers = {}
    for n, (task_id, example, t, perm, label) in enumerate(zip(
            dataset["task_id"], dataset["example"], dataset["transform"], dataset["color_perm"], dataset["labels"])):
        key = (task_id, int(example))
        label = _np(label)
        answers.setdefault(key, invert_grid(sequence_to_grid(np.where(label < 0, 0, label)), t, perm))
        grid = sequence_to_grid(predictions[n])
        if grid.size == 0:
            continue  # an empty crop is no answer
        grid = invert_grid(grid, t, perm)
        votes = pools[key].setdefault(_key(grid), [grid, 0, 0.0])
        votes[1] += 1
        votes[2] += scores[n]
    out = {}
    for key, answer in answers.items():
        ranked = sorted(pools[key].values(), key=lambda v: (v[1], v[2] / v[1]), reverse=True)
        out[key] = {"candidates": [v[0] for v in ranked], "votes": [v[1] for v in ranked], "answer": answer}
    return out


def arc_pass_at_k(dataset, predictions, scores=None, ks: Sequence[int] = (1, 2), per_task: str = "fraction"):
    """ARC pass@k after :func:`arc_vote`: a test input passes if one of its top-k voted answers is exact.

    ``per_task="fraction"`` credits a task with the fraction of its test inputs that pass (TRM's evaluator);
    ``"all"`` counts a task only when all of them pass (HRM's notebook). Returns ``{"pass@k": value, ...,
    "num_tasks": n}`` averaged over tasks.
    """
    if per_task not in ("fraction", "all"):
        raise ValueError(f"per_task={per_task!r} is not allowed. Allowed values: 'fraction', 'all'.")
    for k in ks:
        check_number(k, "ks", low=1, integer=True)
    votes = arc_vote(dataset, predictions, scores)
    tasks = defaultdict(list)
    for (task_id, _), v in votes.items():
        hits = [any(_key(c) == _key(v["answer"]) for c in v["candidates"][:k]) for k in ks]
        tasks[task_id].append(hits)
    result = {}
    for j, k in enumerate(ks):
        per = [np.mean([h[j] for h in hits]) if per_task == "fraction" else all(h[j] for h in hits)
               for hits in tasks.values()]
        result[f"pass@{k}"] = float(np.mean(per))
    result["num_tasks"] = len(tasks)
    return result


def arc_submission(votes: Dict[tuple, dict], attempts: int = 2) -> Dict[str, List[dict]]:
    """Kaggle ``submission.json`` content from :func:`arc_vote`: ``{task_id: [{"attempt_1": grid, ...}, ...]}``."""
    out = defaultdict(dict)
    for (task_id, example), v in votes.items():
        cands = v["candidates"][:attempts] or [np.zeros((1, 1), dtype=np.int64)]
        cands = cands + [cands[-1]] * (attempts - len(cands))
        out[task_id][example] = {f"attempt_{a + 1}": c.tolist() for a, c in enumerate(cands)}
    return {t: [ex[k] for k in sorted(ex)] for t, ex in out.items()}


def iterations_vs_difficulty(iterations, difficulty, correct=None, num_bins: Optional[int] = None) -> List[dict]:
    """Table of solver/ACT iterations used per difficulty level (A5 length, Sudoku rating, maze path length).

    ``iterations`` and ``difficulty``: ``[N]`` per sample; ``correct``: optional ``[N]`` booleans (adds an
    ``accuracy`` column). ``num_bins``: group difficulties into that many quantile bins; default: one row per
    distinct value when there are at most 20, else 10 bins. Rows: ``difficulty`` (value or ``"lo-hi"``),
    ``count``, ``mean_iterations``, ``std_iterations``, ``min_iterations``, ``max_iterations`` [, ``accuracy``].
    """
    it, diff = _np(iterations).astype(np.float64).reshape(-1), _np(difficulty).reshape(-1)
    if len(it) != len(diff) or (correct is not None and len(_np(correct).reshape(-1)) != len(it)):
        raise ValueError("iterations, difficulty and correct must have one entry per sample.")
    values = np.unique(diff)
    if num_bins is None and len(values) <= 20:
        groups = [(v.item(), diff == v) for v in values]
    else:
        num_bins = 10 if num_bins is None else num_bins
        check_number(num_bins, "num_bins", low=1, integer=True)
        edges = np.unique(np.quantile(diff, np.linspace(0, 1, num_bins + 1)))
        bins = np.clip(np.searchsorted(edges, diff, side="right") - 1, 0, len(edges) - 2)
        groups = []
        for b in range(len(edges) - 1):
            mask = bins == b
            if mask.any():
                groups.append((f"{diff[mask].min():g}-{diff[mask].max():g}", mask))
    rows = []
    for label, mask in groups:
        row = {"difficulty": label, "count": int(mask.sum()), "mean_iterations": float(it[mask].mean()),
               "std_iterations": float(it[mask].std()), "min_iterations": float(it[mask].min()),
               "max_iterations": float(it[mask].max())}
        if correct is not None:
            row["accuracy"] = float(_np(correct).reshape(-1)[mask].mean())
        rows.append(row)
    return rows


def format_table(rows: List[dict]) -> str:
    """Markdown table of :func:`iterations_vs_difficulty` rows."""
    if not rows:
        return ""
    cols = list(rows[0])
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot_iterations_vs_difficulty(rows: List[dict], path, title: str = "", difficulty_name: str = "difficulty"):
    """Save a PNG/PDF (by ``path``'s suffix) of mean ± std iterations per difficulty row (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install 'hf-fixedpoint[puzzles]'.") from e
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(x, [r["mean_iterations"] for r in rows], yerr=[r["std_iterations"] for r in rows], marker="o",
                capsize=3, label="iterations")
    ax.set_xticks(x, [str(r["difficulty"]) for r in rows], rotation=45 if len(rows) > 8 else 0)
    ax.set_xlabel(difficulty_name)
    ax.set_ylabel("iterations used")
    if "accuracy" in rows[0]:
        acc = ax.twinx()
        acc.plot(x, [r["accuracy"] for r in rows], "s--", color="tab:orange", label="accuracy")
        acc.set_ylabel("exact accuracy")
        acc.set_ylim(0, 1.05)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
